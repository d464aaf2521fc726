"""prune_draft_rows: a KV-sharing draft computes only the rows whose outputs are used.

A draft graph returns `out[logits_indices]` (the last token of each sequence). With kv_share=LAYER
its attention reads every committed position's K/V from the base, so the other rows' outputs feed
nothing: each row of the draft layer (embedding, fc, q/k/v, RoPE, o_proj, norms, MLP) is computed
for its own sake. This pass gathers the graph's token rows at `logits_indices` where they enter
the row-wise region and drops the final index:

Before:   ids[1,T], pos[1,T], feats[T,F] -> row-wise ops -> out[T,H] -> out[logits_indices]
After:    ids[:, li], pos[:, li], feats[li] -> row-wise ops -> out[N,H]

The row-wise region is found, not assumed: walking back from the final index, a node joins when
its op maps each token row to the same output row (pointwise ops, linear, embedding, and
views/reductions/concats off the token dimension, read from the node's shape metadata) and every
user of it is in the region. Its inputs from outside the region are gathered (index_select at
logits_indices); sym sizes of the token dimension become the number of kept rows; the shared
attention's query_start_loc becomes arange(N + 1) (one query row per sequence).

Contract (what the runtime passes): logits_indices holds exactly one row per sequence, in sequence
order, and every row not kept is a committed position (its K/V are the base's). Graphs whose
attention writes every row's K/V (plain cached_attention) are left alone: 0 matches.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from .fx_graph import set_op_arguments
from .result import PassContext, PassResult

aten = torch.ops.aten
SHARED = torch.ops.eagle_fx.shared_cached_attention.default

ROW_OPS = {aten.linear.default, aten.embedding.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout,
           aten._to_copy.default, aten.clone.default, aten.alias.default, aten.contiguous.default,
           aten.unsqueeze.default, aten.transpose.int, aten.permute.default, torch.ops.eagle_fx.rowwise_linear.default}
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
DIM_OPS = {aten.select.int: 1, aten.slice.Tensor: 1, aten.cat.default: 1, aten.mean.dim: 1, aten.sum.dim_IntList: 1,
           aten.squeeze.dim: 1, aten.amax.default: 1, aten.softmax.int: 1, aten._softmax.default: 1}


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def _is_T(size, T) -> bool:
    return isinstance(size, torch.SymInt) and size.node.expr == T.node.expr


def token_dim(n, T) -> int | None:
    v = _val(n)
    if not isinstance(v, torch.Tensor):
        return None
    dims = [i for i, s in enumerate(v.shape) if _is_T(s, T)]
    return dims[0] if len(dims) == 1 else None


def _prefix_is_one(shape, d) -> bool:
    return all(not isinstance(s, torch.SymInt) and s == 1 for s in shape[:d])


def _row_local(n: Node, T) -> bool:
    """Each token row of n's output depends only on the same token row of its inputs."""
    if n.op != "call_function" or token_dim(n, T) is None:
        return False
    t = n.target
    if t == SHARED:
        return True
    if t in ROW_OPS or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
        return True
    if t in VIEW_OPS:
        src = n.args[0]
        ds, do = token_dim(src, T), token_dim(n, T)
        return ds is not None and _prefix_is_one(_val(src).shape, ds) and _prefix_is_one(_val(n).shape, do)
    if t in DIM_OPS:
        src = n.args[0][0] if t == aten.cat.default else n.args[0]
        ds = token_dim(src, T)
        rank = _val(src).dim() if ds is not None else 0
        dims = n.args[1] if len(n.args) > 1 else 0
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        return ds is not None and all(int(x) % rank != ds for x in dims)
    return False


def _uses_only_T(n: Node, T) -> bool:
    """Symbolic-size args of n are the token count itself (sym_size of a token dim), nothing derived."""
    for a in n.all_input_nodes:
        v = _val(a)
        if isinstance(v, torch.SymInt) and not (a.target == aten.sym_size.int and _is_T(v, T)):
            return False
    return True


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    g = gm.graph
    ph = {n.target: n for n in g.nodes if n.op == "placeholder"}
    if "logits_indices" not in ph or "positions" not in ph or _val(ph["positions"]) is None:
        return PassResult(gm, 0, ["no logits_indices/positions inputs: not a draft graph"])
    if any(n.target == torch.ops.eagle_fx.cached_attention.default for n in g.nodes):
        return PassResult(gm, 0, ["attention writes every row's K/V (no kv_share=LAYER): rows cannot be pruned"])
    li = ph["logits_indices"]
    T = _val(ph["positions"]).shape[1]
    final = [n for n in li.users if n.target == aten.index.Tensor and n.args[1] == [li]]
    if len(final) != 1 or not isinstance(final[0].args[0], Node):
        return PassResult(gm, 0, ["no single out[logits_indices]: nothing to prune (already pruned?)"])
    final = final[0]
    top = final.args[0]
    if token_dim(top, T) != 0:
        return PassResult(gm, 0, ["the indexed tensor has no leading token dimension"])

    region: set[Node] = set()
    cone = {top}
    for n in reversed(list(g.nodes)):
        if n not in cone:
            continue
        if _row_local(n, T) and _uses_only_T(n, T) and all(u in region or u is final for u in n.users):
            region.add(n)
            cone.update(a for a in n.all_input_nodes)
    if top not in region or not any(n.target == SHARED for n in region):
        return PassResult(gm, 0, ["no row-wise region through the shared attention"])

    last_input = [n for n in g.nodes if n.op == "placeholder"][-1]
    with g.inserting_after(last_input):
        n_rows = g.call_function(aten.sym_size.int, (li, 0))
    with g.inserting_after(n_rows):
        plus_one = g.call_function(operator.add, (n_rows, 1))
    with g.inserting_after(plus_one):
        starts = g.call_function(aten.arange.default, (plus_one,), {"dtype": torch.long, "device": _val(li).device})

    gathered: dict[Node, Node] = {}

    def gather(a: Node) -> Node:
        if a not in gathered:
            with g.inserting_after(starts if a.op == "placeholder" else a):
                gathered[a] = g.call_function(aten.index_select.default, (a, token_dim(a, T), li))
        return gathered[a]

    num_sources = 0
    for n in [n for n in g.nodes if n in region]:  # graph order, so the rewritten graph is the same every run
        for a in list(n.all_input_nodes):
            if a in region:
                continue
            v = _val(a)
            if isinstance(v, torch.SymInt) and _is_T(v, T):
                n.replace_input_with(a, n_rows)
            elif isinstance(v, torch.Tensor) and token_dim(a, T) is not None:
                num_sources += a not in gathered
                n.replace_input_with(a, gather(a))
        if n.target == SHARED:
            set_op_arguments(n, query_start_loc=starts)  # one kept row per sequence
    final.replace_all_uses_with(top)
    g.erase_node(final)
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    return PassResult(gm, 1, [f"{len(region)} row-wise nodes now run on the logits rows only; {num_sources} inputs gathered"])
