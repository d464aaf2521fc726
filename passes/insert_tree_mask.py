"""insert_tree_mask: paged cached attention becomes tree attention (EAGLE-2 draft trees).

Before (a base or draft-step graph after insert_kv_cache / alias_draft_kv):

    out = eagle_fx.cached_attention(q, k, v, kv_pool, layer, slot_mapping, block_table,
                                    query_start_loc, positions, scale, window)

After (new graph inputs `tree_mask` [T, W] bool and `tree_start` [B] int64):

    out = eagle_fx.tree_cached_attention(q, k, v, kv_pool, layer, slot_mapping, block_table,
                                         query_start_loc, positions, tree_mask, tree_start,
                                         scale, window)

A sequence's tree nodes sit in W cache slots from logical index tree_start; a query attends to
every key below tree_start and to the tree slots its mask row marks (its ancestors and itself),
while its RoPE position stays `positions` (tree_start + depth). Sliding windows apply to both,
by position (a marked ancestor's position is tree_start + its rank in the row). The verify of a draft tree and the
draft's own tree expansion steps run such graphs; `capture` makes them from copies of the base and
draft-step graphs, so the chain graphs stay as they are.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

import eagle_fx.ops  # noqa: F401

from .fx_graph import call_op, graph_input, op_arguments
from .result import PassContext, PassResult

TREE_INPUTS = ("tree_mask", "tree_start")


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.eagle_fx.cached_attention.default]
    if not nodes:
        return PassResult(gm, 0, ["no eagle_fx.cached_attention (already tree attention, or not a cached graph)"])
    inputs = {name: graph_input(gm, name) for name in TREE_INPUTS}
    for node in nodes:
        arguments = op_arguments(node)
        arguments.pop("uniform_queries")  # tree attention is device-side by construction
        with gm.graph.inserting_before(node):
            new = call_op(gm.graph, torch.ops.eagle_fx.tree_cached_attention.default, arguments | inputs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, len(nodes), ["attention reads tree_mask / tree_start"])
