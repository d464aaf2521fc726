"""alias_draft_kv: the draft's KV cache becomes one more layer of the base's KV pool.

Before (a draft graph after insert_kv_cache with pool_name="draft_kv_pool"):

    out = eagle_fx.cached_attention(q, k, v, draft_kv_pool, 0, slot_mapping, block_table, ...)

After (ctx.shared_pool_layer = L, the base's number of layers):

    out = eagle_fx.cached_attention(q, k, v, kv_pool, L, slot_mapping, block_table, ...)

The draft's own pool input is gone; the draft reads and writes layer L of the same pool, block
table and slot mapping as the base, so one allocation and one prefix-cache chain cover both.
Only aligned when the draft prefill is unshifted (draft slot p holds t_p, like the base);
`eagle_fx.compile` applies it for kv_share="pool" when shapes allow.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from .insert_kv_cache import graph_input
from .result import PassContext, PassResult

DRAFT_POOL = "draft_kv_pool"


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    ctx = ctx or PassContext()
    g = gm.graph
    own = next((n for n in g.nodes if n.op == "placeholder" and n.target == DRAFT_POOL), None)
    if own is None:
        return PassResult(gm, 0, [f"no {DRAFT_POOL} input: already aliased or not a draft graph"])
    shared = graph_input(gm, "kv_pool")
    matches = 0
    for n in list(own.users):
        if n.target != torch.ops.eagle_fx.cached_attention.default:
            raise ValueError(f"eagle_fx: {DRAFT_POOL} is used by {n.target}, not only by cached attention; cannot alias it")
        args = list(n.args)
        args[3] = shared
        args[4] = ctx.shared_pool_layer + args[4]
        n.args = tuple(args)
        matches += 1
    g.erase_node(own)
    g.lint()
    gm.recompile()
    return PassResult(gm, matches, [f"draft attention -> kv_pool layer {ctx.shared_pool_layer}"])
