"""mark_uniform_queries: a decode-step graph's cached attention runs device-side only.

A draft step (one row per sequence), a verify (k+1 rows) and the padded draft extend (k+1 rows)
give every sequence the same number of query rows. This pass tells their attention so:

Before:   out = eagle_fx.cached_attention(q, k, v, pool, layer, ..., scale, window, batch_invariant)
After:    out = eagle_fx.cached_attention(q, k, v, pool, layer, ..., scale, window, batch_invariant,
                                          uniform_queries=True)

(and likewise `eagle_fx.shared_cached_attention`). The op then reads no value on the host and
builds no shape from data: each sequence's T // B rows attend its whole block-table row, masked
by position (eagle_fx/ops/uniform_attention.py). The prefill graphs, whose rows are ragged, are not
marked; tree attention is uniform by construction and has no flag. A batch-invariant attention
(row by row, on the host) is left alone.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

import eagle_fx.ops  # noqa: F401

from .fx_graph import op_arguments, set_op_arguments
from .result import PassContext, PassResult

CACHED = torch.ops.eagle_fx.cached_attention.default
SHARED = torch.ops.eagle_fx.shared_cached_attention.default


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    marked = skipped = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (CACHED, SHARED):
            continue
        named = op_arguments(n)
        if named.get("batch_invariant", False):
            skipped += 1
            continue
        if named["uniform_queries"]:
            continue
        set_op_arguments(n, uniform_queries=True)
        marked += 1
    gm.graph.lint()
    gm.recompile()
    notes = [f"{marked} attention(s) device-side"] + ([f"{skipped} batch-invariant left on the host"] if skipped else [])
    return PassResult(gm, marked, notes)
