"""canonicalize_attention: every scaled-dot-product attention becomes one `eagle_fx::attention`.

Before (what Hugging Face's sdpa path exports, GQA heads repeated for SDPA):

    k_rep = reshape(expand(unsqueeze(k, 2), ...), [B, H, T, D])      # repeat_kv
    v_rep = reshape(expand(unsqueeze(v, 2), ...), [B, H, T, D])
    mask  = <causal / packed / sliding-window mask subgraph>
    out   = aten.scaled_dot_product_attention(q, k_rep, v_rep, mask, scale=s)

After:

    out   = eagle_fx.attention(q, k, v, s, window)   # k/v un-repeated, mask subgraph dead and gone

The sliding window of each layer is read from the attention module the node came from
(`nn_module_stack`), exactly as the model passes it to its attention function. The node records
its layer ordinal in `node.meta["eagle_fx_layer"]`. Attention computed any other way (eager
softmax attention, soft-capping) is an error naming the op, never a silent fallback.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import GraphModule, Node

import eagle_fx.ops  # noqa: F401  (defines torch.ops.eagle_fx.*)

from .result import PassContext, PassResult

aten = torch.ops.aten

# targets whose first three args are (q, k, v) and that compute softmax(q k^T * scale) v
_SDPA = {
    aten.scaled_dot_product_attention.default: "plain",
    torch.nn.functional.scaled_dot_product_attention: "plain",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "tuple",
    aten._scaled_dot_product_flash_attention.default: "tuple",
    aten._scaled_dot_product_efficient_attention.default: "tuple",
}
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_SOFTMAX = {aten._softmax.default, aten.softmax.int, torch.softmax, torch.nn.functional.softmax}


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def unrepeat_kv(node: Node) -> Node:
    """`reshape(expand(unsqueeze(x, 2)))` (Hugging Face's repeat_kv) -> x; anything else as is."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target in _RESHAPES):
        return node
    inner = node.args[0]
    if inner.target == aten.clone.default:
        inner = inner.args[0]
    if inner.target != aten.expand.default:
        return node
    unsq = inner.args[0]
    if unsq.target == aten.unsqueeze.default and unsq.args[1] == 2:
        return unsq.args[0]
    return node


def _module_path(node: Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values()]
    return paths[-1] if paths else None


def _clean_path(path: str) -> str:
    # dynamo paths look like "L['self'].model.layers[0].self_attn"
    path = path.replace("L['self'].", "").replace("L['self']", "")
    out = []
    for part in path.replace("]", "").split("["):
        out.append(part.strip("'\""))
    return ".".join(p for p in ".".join(out).split(".") if p)


def attention_module(root: torch.nn.Module | None, node: Node) -> torch.nn.Module | None:
    """The module an attention node was traced in, walking out to the one that looks like attention."""
    path = _module_path(node)
    if root is None or path is None:
        return None
    parts = _clean_path(path).split(".")
    while parts:
        try:
            mod = root.get_submodule(".".join(parts))
        except AttributeError:
            parts.pop()
            continue
        if hasattr(mod, "layer_idx") or hasattr(mod, "q_proj"):
            return mod
        parts.pop()
    return None


def layer_sliding_window(attn: torch.nn.Module | None) -> int:
    """The window the model hands its attention function for this layer (0: full attention)."""
    if attn is None:
        return 0
    if hasattr(attn, "sliding_window"):
        return int(attn.sliding_window or 0)
    config = getattr(attn, "config", None)
    if config is None:
        return 0
    layer_types = getattr(config, "layer_types", None)
    idx = getattr(attn, "layer_idx", None)
    if layer_types is not None and idx is not None:
        return int(config.sliding_window or 0) if layer_types[idx] == "sliding_attention" else 0
    return int(getattr(config, "sliding_window", None) or 0)


def _sdpa_args(node: Node):
    """(q, k, v, attn_mask, is_causal, scale) of an SDPA-like node."""
    kind = _SDPA[node.target]
    names = ["query", "key", "value"]
    q, k, v = (node.args[i] if len(node.args) > i else node.kwargs[names[i]] for i in range(3))
    if kind == "plain":
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    else:  # flash/efficient: (q, k, v, [attn_bias,] dropout, is_causal, ...)
        mask = node.kwargs.get("attn_mask", node.kwargs.get("attn_bias"))
        causal = node.kwargs.get("is_causal", node.args[4] if len(node.args) > 4 else False)
        if node.target == aten._scaled_dot_product_efficient_attention.default:
            mask = node.args[3] if len(node.args) > 3 else mask
            causal = node.args[6] if len(node.args) > 6 else causal
    scale = node.kwargs.get("scale")
    return q, k, v, mask, bool(causal), scale


def run(gm: GraphModule, ctx: PassContext | None = None, only_unmasked: bool = False) -> PassResult:
    """ctx.expected_attention_layers: the number of matches the model must give (else an error).
    only_unmasked: canonicalise only causal SDPA without an explicit mask whose only used output is
    the attention, and leave the rest as they are (for arbitrary graphs, e.g. the torch.compile
    backend, where a mask may be padding and a training graph saves the logsumexp)."""
    ctx = ctx or PassContext()
    graph = gm.graph
    matches = 0
    notes: list[str] = []
    windows: set[int] = set()
    kept = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        q, k, v, mask, causal, scale = _sdpa_args(node)
        where = _module_path(node) or node.name
        if only_unmasked and (mask is not None or not causal):
            kept += 1
            continue
        if mask is None and not causal:
            raise ValueError(
                f"eagle_fx: attention {node.target} at {where} is not causal (no mask, is_causal=False); "
                "eagle_fx speculates for causal language models only"
            )
        extra_outputs = [u for u in node.users if not (u.target is operator.getitem and u.args[1] == 0) and u.users]
        if only_unmasked and _SDPA[node.target] == "tuple" and extra_outputs:
            kept += 1  # training: its logsumexp is saved for the backward, which eagle_fx::attention does not give
            continue
        k0, v0 = unrepeat_kv(k), unrepeat_kv(v)
        qv, kv = _val(q), _val(k0)
        if qv is not None and kv is not None and qv.shape[1] % kv.shape[1] != 0:
            raise ValueError(f"eagle_fx: attention at {where}: {qv.shape[1]} query heads are not a multiple of {kv.shape[1]} kv heads")
        if scale is None:
            scale = 1.0 / math.sqrt(qv.shape[-1]) if qv is not None else None
        if scale is None:
            raise ValueError(f"eagle_fx: attention at {where} has no scale and no shape metadata to derive it")
        window = layer_sliding_window(attention_module(ctx.root, node))
        windows.add(window)
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.eagle_fx.attention.default, (q, k0, v0, float(scale), window))
        new.meta = dict(node.meta)
        new.meta["eagle_fx_layer"] = matches
        if _SDPA[node.target] == "tuple":
            for user in list(node.users):
                if user.target is operator.getitem and user.args[1] == 0:
                    user.replace_all_uses_with(new)
                    graph.erase_node(user)
                elif user.users:
                    raise ValueError(f"eagle_fx: attention at {where}: output {user.args[1]} of {node.target} is used; only the attention output can be canonicalised")
                else:
                    graph.erase_node(user)
        else:
            node.replace_all_uses_with(new)
        graph.erase_node(node)
        matches += 1
    # a softmax left inside an attention module is attention computed another way (eager attention)
    leftovers = [n for n in graph.nodes if n.op == "call_function" and n.target in _SOFTMAX
                 and any(w in (_module_path(n) or "").lower() for w in ("attn", "attention"))] if not only_unmasked else []
    if leftovers:
        n = leftovers[0]
        raise ValueError(
            f"eagle_fx: attention at {_module_path(n) or n.name} is computed with {n.target} and did not match "
            "eagle_fx::attention (scaled_dot_product_attention); load the model with attn_implementation='sdpa' "
            "(its family must support it; soft-capped attention is not supported)"
        )
    expected_layers = ctx.expected_attention_layers
    if expected_layers is not None and matches != expected_layers:
        raise ValueError(
            f"eagle_fx: matched {matches} scaled_dot_product_attention op(s) but the model has {expected_layers} "
            "attention layers; the others use an attention form eagle_fx does not canonicalise"
        )
    graph.eliminate_dead_code()
    gm.recompile()
    if matches:
        notes.append(f"windows {sorted(windows)}")
    if kept:
        notes.append(f"{kept} SDPA kept (an explicit mask, not causal, or a logsumexp the backward needs)")
    return PassResult(gm, matches, notes)
