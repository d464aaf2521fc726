"""Weights as graph inputs, for export: every step graph shares one weights file.

A captured step graph reads its weights through `get_attr` nodes, so torch.export would write a
copy of them into each graph file (the base's into five files). `lift_weights` turns those reads
into graph inputs (placeholders `w_0`, `w_1`, ...), and `SharedWeights` keeps one tensor per
distinct weight across graphs, written once as `weights.safetensors`. A loaded graph is called
with its weights from that file (the manifest maps each graph's `w_i` to a file key).
"""
from __future__ import annotations

import operator
from pathlib import Path

import torch
from torch.fx import Graph, GraphModule

WEIGHTS_FILE = "weights.safetensors"


def lift_weights(gm: GraphModule) -> tuple[GraphModule, dict[str, tuple[str, torch.Tensor]]]:
    """A copy of gm whose tensor attributes are inputs, and {input name: (attribute name, tensor)}."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    lifted: dict[str, tuple[str, torch.Tensor]] = {}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(node.target)(gm)
        if not isinstance(value, torch.Tensor):
            continue
        with graph.inserting_after(anchor):
            placeholder = graph.placeholder(f"w_{len(lifted)}")
        anchor = placeholder
        placeholder.meta = dict(node.meta)
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        lifted[placeholder.name] = (node.target, value.detach())
    graph.lint()
    rest = {n.target: operator.attrgetter(n.target)(gm) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    return GraphModule(rest, graph, class_name=type(gm).__name__), lifted


class SharedWeights:
    """One entry per distinct tensor (same storage, offset, shape, stride and dtype) across graphs."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._keys: dict[tuple, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> str:
        """The file key of `tensor` (`name`, suffixed if another tensor already has that name)."""
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                 tuple(tensor.stride()), tensor.dtype, tensor.device)
        if ident in self._keys:
            return self._keys[ident]
        key, n = name, 1
        while key in self.tensors:
            key, n = f"{name}.{n}", n + 1
        self.tensors[key] = tensor
        self._keys[ident] = key
        return key

    def save(self, out_dir: Path) -> Path:
        from safetensors.torch import save_file

        seen: set[int] = set()
        state = {}
        for key, t in self.tensors.items():  # safetensors refuses two entries over one storage: copy the later ones
            t = t.contiguous().cpu()
            ptr = t.untyped_storage().data_ptr()
            state[key] = t.clone() if ptr in seen else t
            seen.add(ptr)
        path = Path(out_dir) / WEIGHTS_FILE
        save_file(state, str(path))
        return path


def load_weights(out_dir: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(out_dir) / WEIGHTS_FILE), device=str(device))
