"""drop_prefill_shift: the draft prefill sees the same tokens at the same positions as the base.

Before (shifted reference form; draft slot p holds (t_{p+1}, f_p)):

    ids   = index_put(roll(input_ids, -1, dim=1), (zeros, query_start_loc[1:] - 1), next_tokens)
    out   = draft(ids, positions, features)

After (unshifted; draft slot p holds (t_p, f_{p-1}), f_{-1} = the carried feature):

    feats = index_put(roll(features, 1, dim=0), (query_start_loc[:-1],), carry_features)
    out   = draft(input_ids, positions, feats)

`carry_features` [B, F] is a new graph input: the bootstrap feature b for a sequence's first chunk,
the last base feature of the previous chunk (or cached prefix) otherwise. No look-ahead token is
needed, so draft slot p depends only on t_0..t_p, exactly like the base's KV. The now-unused
`next_tokens` input is removed. A graph without the shift is left alone (0 matches).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from .fx_graph import graph_input
from .result import PassContext, PassResult

aten = torch.ops.aten


def _is_token_shift(node: Node, input_ids: Node) -> bool:
    """index_put(roll(input_ids, [-1], [1]), [_, last], next_tokens)."""
    if node.op != "call_function" or node.target not in (aten.index_put.default, aten.index_put_.default):
        return False
    src = node.args[0]
    return (isinstance(src, Node) and src.target == aten.roll.default and src.args[0] is input_ids
            and list(src.args[1]) == [-1] and list(src.args[2]) == [1])


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    g = gm.graph
    names = {n.target: n for n in g.nodes if n.op == "placeholder"}
    if "input_ids" not in names or "features" not in names:
        return PassResult(gm, 0, ["no input_ids/features inputs: not a draft prefill graph"])
    input_ids, features = names["input_ids"], names["features"]
    shifts = [n for n in g.nodes if _is_token_shift(n, input_ids)]
    if not shifts:
        return PassResult(gm, 0, ["already unshifted"])
    for n in shifts:
        n.replace_all_uses_with(input_ids)
    qsl = graph_input(gm, "query_start_loc", create=False)
    carry = graph_input(gm, "carry_features")
    feature_users = [u for u in features.users]
    with g.inserting_before(carry.next):
        rolled = g.call_function(aten.roll.default, (features, [1], [0]))
        firsts = g.call_function(aten.slice.Tensor, (qsl, 0, 0, -1))
        shifted = g.call_function(aten.index_put.default, (rolled, [firsts], carry))
    if "val" in features.meta:  # same shape as the features (later passes read token dims from it)
        rolled.meta["val"] = shifted.meta["val"] = features.meta["val"]
    for u in feature_users:
        u.replace_input_with(features, shifted)
    g.eliminate_dead_code()
    removed = []
    nt = names.get("next_tokens")
    if nt is not None and not nt.users:
        g.erase_node(nt)
        removed.append("next_tokens")
    g.lint()
    gm.recompile()
    return PassResult(gm, len(shifts), [f"features shifted right with carry_features; removed inputs {removed}"])
