"""batch_invariant: every row's numerics independent of how many rows share a step.

Before:

    y   = aten.linear(x, w, b)
    out = eagle_fx.cached_attention(..., batch_invariant=False)

After:

    y   = eagle_fx.rowwise_linear(x, w, b)          # one GEMV per row
    out = eagle_fx.cached_attention(..., batch_invariant=True)   # one query row at a time

Matrix kernels pick their blocking (and so their summation order) by the number of rows, so a
token's K/V in a 7-token chunk can differ in the last bit from the same token in a 37-token
prefill. This pass trades speed for bit-identical results across chunkings and batchings
(`eagle_fx.compile(..., batch_invariant=True)`); elementwise ops and per-row reductions
(norms, RoPE) are already row-independent.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

import eagle_fx.ops  # noqa: F401

from .fx_graph import op_arguments, set_op_arguments
from .result import PassContext, PassResult

aten = torch.ops.aten


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    g = gm.graph
    linears = attn = 0
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target == aten.linear.default:
            with g.inserting_before(n):
                new = g.call_function(torch.ops.eagle_fx.rowwise_linear.default, tuple(n.args), dict(n.kwargs))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            g.erase_node(n)
            linears += 1
        elif n.target == torch.ops.eagle_fx.cached_attention.default:
            if op_arguments(n)["batch_invariant"]:
                continue
            set_op_arguments(n, batch_invariant=True)
            attn += 1
    g.lint()
    gm.recompile()
    return PassResult(gm, linears + attn, [f"{linears} linear -> rowwise_linear, {attn} cached_attention row by row"])
