"""A pass test harness: snapshot op counts of a graph before and after a pass."""
from collections import Counter

import torch


def op_counts(gm: torch.fx.GraphModule) -> Counter:
    c = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            c[str(n.target)] += 1
        elif n.op == "placeholder":
            c["placeholder"] += 1
    return c


def exported_base(arch: str):
    """The base step of a tiny model as torch.export leaves it, before any pass."""
    from conftest import tiny_base

    from eagle_fx.capture import BaseStep, _example_inputs, export_graph

    step = BaseStep(tiny_base(arch)).eval()
    ids, pos, li, _ = _example_inputs("cpu")
    T, N = torch.export.Dim("T", min=1, max=4096), torch.export.Dim("N", min=1, max=4096)
    return step, export_graph(step, (ids, pos, li), ({1: T}, {1: T}, {0: N}))
