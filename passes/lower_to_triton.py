"""lower_to_triton: swap the canonical subgraphs of a step graph for fused Triton kernels.

It runs last on every step graph (the base, the draft graphs, the tree graphs; eagle_fx.pipeline)
and on any graph the torch.compile backend gets (eagle_fx.dynamo_backend). The same patterns
everywhere:

  attention   eagle_fx.cached_attention(q, k, v, pool, ...)      -> eagle_fx.triton_cached_attention
              (KV write by slot mapping + paged attention, one op, same arguments)
  rmsnorm     w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)
                                                                  -> eagle_fx.triton_rmsnorm(x, w, eps)
  add_rmsnorm the same where x = a + b feeds the next residual too
                                                                  -> eagle_fx.triton_add_rmsnorm(a, b, w, eps)
                                                                     (normed, a + b)
  swiglu      silu(g) * u                                         -> eagle_fx.triton_swiglu(g, u)
  draft_input linear(cat([embedding(E, ids), f], -1), W, b)       -> eagle_fx.triton_draft_input(ids, E, f, W, b)
              and EAGLE-3's linear(cat([rmsnorm(E[ids]), rmsnorm(f)]), W)
                                                                  -> the same op with both norm weights

Norms of another form (Gemma's 1 + w), row-by-row batch-invariant ops and a KV-sharing draft's
shared attention are left as they are (the torch ops; counted in the notes as not lowered).
When Triton cannot run on the graph's device (no CUDA and no TRITON_INTERPRET=1, or no triton
package) the graph is left untouched and the reason is the note: 0 matches.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from .fx_graph import call_op, op_arguments
from .result import PassContext, PassResult

aten = torch.ops.aten


def _is(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def _device(gm: GraphModule, ctx: PassContext):
    """Where the graph runs: its parameters, the captured module's, or its inputs' (an AOTAutograd
    graph takes its parameters as inputs)."""
    for p in gm.parameters():
        return p.device
    if ctx.root is not None:
        for p in ctx.root.parameters():
            return p.device
    for n in gm.graph.nodes:
        if n.op == "placeholder" and isinstance(_val(n), torch.Tensor):
            return _val(n).device
    return torch.device("cpu")


def _lower_attention(g, ops) -> int:
    n_done = 0
    for n in list(g.nodes):
        if _is(n, torch.ops.eagle_fx.cached_attention.default):
            # batch_invariant and uniform_queries need nothing more: each query row is its own program,
            # on the device
            arguments = op_arguments(n)
            del arguments["batch_invariant"], arguments["uniform_queries"]
            with g.inserting_before(n):
                new = call_op(g, ops.triton_cached_attention.default, arguments)
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            g.erase_node(n)
            n_done += 1
    return n_done


def _match_rmsnorm(out: Node):
    """out = mul(w, to(mul(xf, rsqrt(add(mean(pow(xf, 2), [-1], True), eps))))) -> (x, xf, w, eps, inner)."""
    if not _is(out, aten.mul.Tensor) or len(out.args) != 2:
        return None
    for w, cast in (out.args, out.args[::-1]):
        if not isinstance(w, Node) or w.op not in ("get_attr", "placeholder"):
            continue
        inner = cast.args[0] if _is(cast, aten.to.dtype) else cast
        if not _is(inner, aten.mul.Tensor):
            continue
        xf, r = inner.args
        if not _is(r, aten.rsqrt.default) or not _is(r.args[0], aten.add.Tensor):
            continue
        mean, eps = r.args[0].args
        if not _is(mean, aten.mean.dim) or not isinstance(eps, float) or list(mean.args[1]) != [-1] or not mean.args[2]:
            continue
        pw = mean.args[0]
        if not _is(pw, aten.pow.Tensor_Scalar) or pw.args[0] is not xf or pw.args[1] != 2:
            continue
        x = xf.args[0] if _is(xf, aten.to.dtype) and xf.args[1] == torch.float32 else xf
        chain = {out, inner, r, r.args[0], mean, pw} | ({cast} if cast is not inner else set())
        if any(u not in chain for n in chain - {out} for u in n.users):
            continue
        return x, xf, w, eps, chain
    return None


def _lower_rmsnorm(g, ops) -> tuple[int, int]:
    plain = fused = 0
    for out in list(g.nodes):
        m = _match_rmsnorm(out)
        if m is None:
            continue
        x, xf, w, eps, chain = m
        inside = chain | {xf}
        residual = (_is(x, aten.add.Tensor) and len(x.args) == 2 and all(isinstance(a, Node) for a in x.args)
                    and _val(x.args[0]) is not None and _val(x.args[1]) is not None
                    and tuple(_val(x.args[0]).shape) == tuple(_val(x.args[1]).shape))
        with g.inserting_before(out):
            if residual:
                node = g.call_function(ops.triton_add_rmsnorm.default, (x.args[0], x.args[1], w, eps))
                normed = g.call_function(operator.getitem, (node, 0))
                total = g.call_function(operator.getitem, (node, 1))
            else:
                normed = g.call_function(ops.triton_rmsnorm.default, (x, w, eps))
        normed.meta = dict(out.meta)
        out.replace_all_uses_with(normed)
        if residual:
            total.meta = dict(x.meta)
            x.replace_all_uses_with(total, delete_user_cb=lambda u: u not in inside and u is not node)
            if xf is not x:  # the fp32 copy of the sum feeds a later residual add too
                with g.inserting_after(total):
                    total_f32 = g.call_function(aten.to.dtype, (total, torch.float32))
                xf.replace_all_uses_with(total_f32, delete_user_cb=lambda u: u not in inside)
            fused += 1
        else:
            plain += 1
        g.eliminate_dead_code()
    return plain, fused


def _lower_swiglu(g, ops) -> int:
    n_done = 0
    for n in list(g.nodes):
        if not _is(n, aten.mul.Tensor) or len(n.args) != 2:
            continue
        a, b = n.args
        for s, u in ((a, b), (b, a)):
            if _is(s, aten.silu.default) and isinstance(u, Node) and len(s.users) == 1 \
                    and _val(s) is not None and _val(u) is not None and tuple(_val(s).shape) == tuple(_val(u).shape):
                with g.inserting_before(n):
                    new = g.call_function(ops.triton_swiglu.default, (s.args[0], u))
                new.meta = dict(n.meta)
                n.replace_all_uses_with(new)
                g.erase_node(n)
                g.erase_node(s)
                n_done += 1
                break
    return n_done


def _draft_input_parts(cat: Node, ops):
    """cat([embedding(E, ids) | rmsnorm(embedding(E, ids)), f | rmsnorm(f)], -1) -> (ids, E, f, ne, nf, eps)."""
    if not _is(cat, aten.cat.default) or len(cat.args[0]) != 2 or (len(cat.args) > 1 and cat.args[1] not in (-1, 2)):
        return None
    a, f = cat.args[0]
    ne = nf = None
    eps = 0.0
    if _is(a, ops.triton_rmsnorm.default) and _is(f, ops.triton_rmsnorm.default):
        if a.args[2] != f.args[2]:
            return None
        ne, nf, eps = a.args[1], f.args[1], a.args[2]
        a, f = a.args[0], f.args[0]
    if not _is(a, aten.embedding.default):
        return None
    E, ids = a.args[0], a.args[1]
    if _val(ids) is None or _val(f) is None or tuple(_val(f).shape[:-1]) != tuple(_val(ids).shape):
        return None
    return ids, E, f, ne, nf, eps


def _lower_draft_input(g, ops) -> int:
    n_done = 0
    for n in list(g.nodes):
        if not _is(n, aten.linear.default):
            continue
        parts = _draft_input_parts(n.args[0], ops)
        if parts is None:
            continue
        ids, E, f, ne, nf, eps = parts
        bias = n.args[2] if len(n.args) > 2 else None
        with g.inserting_before(n):
            new = g.call_function(ops.triton_draft_input.default, (ids, E, f, n.args[1], bias, ne, nf, eps))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        g.erase_node(n)
        n_done += 1
    g.eliminate_dead_code()
    return n_done


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    ctx = ctx or PassContext()
    from eagle_fx.ops.triton import load_kernels, triton_status

    ok, why = triton_status(_device(gm, ctx))
    if not ok:
        return PassResult(gm, 0, [f"left unlowered: {why}"])
    load_kernels()
    ops = torch.ops.eagle_fx
    g = gm.graph
    attention = _lower_attention(g, ops)
    plain, fused = _lower_rmsnorm(g, ops)
    swiglu = _lower_swiglu(g, ops)
    draft_input = _lower_draft_input(g, ops)
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    left = sum(1 for n in g.nodes if _is(n, torch.ops.eagle_fx.shared_cached_attention.default,
                                         torch.ops.eagle_fx.rowwise_linear.default))
    notes = [f"attention {attention}, rmsnorm {plain}, add_rmsnorm {fused}, swiglu {swiglu}, draft_input {draft_input}"
             f" ({why})"]
    if left:
        notes.append(f"{left} shared-attention/row-wise op(s) kept as torch ops")
    return PassResult(gm, attention + plain + fused + swiglu + draft_input, notes)
