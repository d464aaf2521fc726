"""alias_draft_kv: the draft's attention uses the base's KV pool instead of a pool of its own.

Before (a draft graph after insert_kv_cache with pool_name="draft_kv_pool"):

    out = eagle_fx.cached_attention(q, k, v, draft_kv_pool, 0, slot_mapping, block_table, ...)

After, kv_share="pool" (ctx.shared_pool_layer = L, the base's number of layers):

    out = eagle_fx.cached_attention(q, k, v, kv_pool, L, slot_mapping, block_table, ...)

The draft reads and writes layer L of the same pool, block table and slot mapping as the base, so
one allocation and one prefix-cache chain cover both.

After, kv_share=LAYER (ctx.kv_share_layer = LAYER):

    out = eagle_fx.shared_cached_attention(q, k, v, kv_pool, LAYER, spec_kv, spec_rows, committed_len,
                                           block_table, query_start_loc, positions, scale, window)

The draft reads base layer LAYER's K/V for every committed position (< committed_len) and keeps
only the speculated positions' K/V, in the small `spec_kv` ring (new inputs spec_kv, spec_rows,
committed_len; slot_mapping goes; batch_invariant and uniform_queries carry over, by name). With
ctx.all_rows_committed (the draft prefill: every row is a
prompt token the base has just cached) k and v become None, so the k/v projections are dead code
and are removed.

Both are only aligned when the draft prefill is unshifted (draft slot p holds t_p, like the base);
`eagle_fx.compile` applies this pass per its kv_share option (eagle_fx.kv_share has the rules).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from .fx_graph import call_op, graph_input, op_arguments, set_op_arguments
from .result import PassContext, PassResult

DRAFT_POOL = "draft_kv_pool"
SHARED_INPUTS = ("spec_kv", "spec_rows", "committed_len")


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    ctx = ctx or PassContext()
    g = gm.graph
    own = next((n for n in g.nodes if n.op == "placeholder" and n.target == DRAFT_POOL), None)
    if own is None:
        return PassResult(gm, 0, [f"no {DRAFT_POOL} input: already aliased or not a draft graph"])
    for n in own.users:
        if n.target != torch.ops.eagle_fx.cached_attention.default:
            raise ValueError(f"eagle_fx: {DRAFT_POOL} is used by {n.target}, not only by cached attention; cannot alias it")
    shared = graph_input(gm, "kv_pool")
    users = list(own.users)
    if ctx.kv_share_layer is None:
        for n in users:
            set_op_arguments(n, kv_pool=shared, layer=ctx.shared_pool_layer + op_arguments(n)["layer"])
        note = f"draft attention -> kv_pool layer {ctx.shared_pool_layer}"
    else:
        extra = {name: graph_input(gm, name) for name in SHARED_INPUTS}
        for n in users:
            own_args = op_arguments(n)
            same = ("q", "k", "v", "block_table", "query_start_loc", "positions", "scale", "sliding_window")
            shared_args = {name: own_args[name] for name in same} | extra | {"kv_pool": shared,
                                                                            "base_layer": ctx.kv_share_layer}
            # flags at their defaults stay unsaid; a set one carries over (row by row stays row by row)
            shared_args |= {flag: True for flag in ("batch_invariant", "uniform_queries") if own_args[flag]}
            if ctx.all_rows_committed:
                shared_args |= {"k": None, "v": None}
            with g.inserting_before(n):
                new = call_op(g, torch.ops.eagle_fx.shared_cached_attention.default, shared_args)
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            g.erase_node(n)
        note = (f"draft attention reads base layer {ctx.kv_share_layer}'s K/V below committed_len, its own in spec_kv"
                + ("; every row committed: k/v projections removed" if ctx.all_rows_committed else ""))
    g.erase_node(own)
    g.eliminate_dead_code()
    for name in ("slot_mapping",):
        ph = next((n for n in g.nodes if n.op == "placeholder" and n.target == name), None)
        if ph is not None and not ph.users:
            g.erase_node(ph)
    g.lint()
    gm.recompile()
    return PassResult(gm, len(users), [note])
