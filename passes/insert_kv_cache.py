"""insert_kv_cache: `eagle_fx::attention` becomes paged cached attention over a KV pool input.

Before:

    out = eagle_fx.attention(q, k, v, scale, window)

After (new graph inputs `kv_pool` (named by ctx.pool_name), `slot_mapping`, `block_table`,
`query_start_loc`; the graph's existing `positions` input is reused):

    out = eagle_fx.cached_attention(q, k, v, kv_pool, layer, slot_mapping, block_table,
                                    query_start_loc, positions, scale, window)

`layer` is the node's layer ordinal (canonicalize_attention's `eagle_fx_layer`), so a graph's
attention layers are pool layers 0..L-1. The op writes k/v at `slot_mapping` (mutating `kv_pool`,
declared in the op schema) and reads each sequence's keys through `block_table`.

Graphs share one pool through a later pass, alias_draft_kv: a draft graph gets its attention
inserted here over a pool of its own (ctx.pool_name="draft_kv_pool"), and alias_draft_kv moves it
to layer `ctx.shared_pool_layer` of the base's `kv_pool`.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

import eagle_fx.ops  # noqa: F401

from .fx_graph import call_op, graph_input, op_arguments
from .result import PassContext, PassResult

CACHE_INPUTS = ("slot_mapping", "block_table", "query_start_loc")


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    ctx = ctx or PassContext()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.eagle_fx.attention.default]
    if not nodes:
        return PassResult(gm, 0, ["no eagle_fx.attention left"])
    positions = graph_input(gm, "positions", create=False)
    inputs = {"kv_pool": graph_input(gm, ctx.pool_name)} | {name: graph_input(gm, name) for name in CACHE_INPUTS}
    for i, node in enumerate(nodes):
        attention = op_arguments(node)  # q, k, v, scale, sliding_window
        layer = node.meta.get("eagle_fx_layer", i)
        with gm.graph.inserting_before(node):
            new = call_op(gm.graph, torch.ops.eagle_fx.cached_attention.default,
                          attention | inputs | {"layer": layer, "positions": positions})
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, len(nodes), [f"pool layers 0..{len(nodes) - 1}"])
