"""insert_kv_cache: `eagle_fx::attention` becomes paged cached attention over a KV pool input.

Before:

    out = eagle_fx.attention(q, k, v, scale, window)

After (new graph inputs `kv_pool` (named by ctx.pool_name), `slot_mapping`, `block_table`,
`query_start_loc`; the graph's existing `positions` input is reused):

    out = eagle_fx.cached_attention(q, k, v, kv_pool, layer, slot_mapping, block_table,
                                    query_start_loc, positions, scale, window)

`layer` is the node's ordinal plus `ctx.kv_layer_offset`, so several graphs can share one pool.
The op writes k/v at `slot_mapping` (mutating `kv_pool`, declared in the op schema) and reads
each sequence's keys through `block_table`.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

import eagle_fx.ops  # noqa: F401

from .result import PassContext, PassResult

CACHE_INPUTS = ("slot_mapping", "block_table", "query_start_loc")


def graph_input(gm: GraphModule, name: str, create: bool = True):
    """The placeholder called `name`, appended after the existing inputs if missing."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        if n.target == name:
            return n
    if not create:
        raise ValueError(f"eagle_fx: graph has no input named {name!r} (inputs: {[n.target for n in placeholders]})")
    anchor = placeholders[-1] if placeholders else None
    ctx = gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before(None)
    with ctx:
        return gm.graph.placeholder(name)


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    ctx = ctx or PassContext()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.eagle_fx.attention.default]
    if not nodes:
        return PassResult(gm, 0, ["no eagle_fx.attention left"])
    positions = graph_input(gm, "positions", create=False)
    inputs = {"kv_pool": graph_input(gm, ctx.pool_name)} | {name: graph_input(gm, name) for name in CACHE_INPUTS}
    for i, node in enumerate(nodes):
        q, k, v, scale, window = node.args
        layer = ctx.kv_layer_offset + node.meta.get("eagle_fx_layer", i)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                torch.ops.eagle_fx.cached_attention.default,
                (q, k, v, inputs["kv_pool"], layer, inputs["slot_mapping"], inputs["block_table"],
                 inputs["query_start_loc"], positions, scale, window),
            )
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, len(nodes), [f"pool layers {ctx.kv_layer_offset}..{ctx.kv_layer_offset + len(nodes) - 1}"])
