"""inline_uniform_attention: a decode-step graph's device-side attention as torch code a compiler
can see into.

`eagle_fx::cached_attention` / `shared_cached_attention` marked `uniform_queries=True`
(mark_uniform_queries) and `tree_cached_attention` read nothing on the host. As custom ops they
are opaque to torch.compile: inductor calls them as fallback kernels, one Python call of a dozen
eager ops per layer. This pass makes each such node call the op's torch implementation directly:

Before:   out = eagle_fx.cached_attention(q, k, v, pool, ..., uniform_queries=True)
After:    out = cached_attention_ref(q, k, v, pool, ..., uniform_queries=True)

so dynamo traces the KV write (an in-place index_put_ into the pool input), the gather through
the block table, the position mask and the attention into the compiled graph, and inductor fuses
them with the rest of the step. A table longer than COMPILED_KEY_CHUNK keys (eagle_fx.ops.limits)
is read in key chunks by a torch.while_loop (eagle_fx/ops/online_softmax.py): one graph for every
table width, memory bounded by a chunk. The numerics are the op's own. Only for graphs that are compiled
(eagle_fx.runtime.chain_cycle with backend="inductor"); exported graphs keep the ops.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

import eagle_fx.ops  # noqa: F401  (defines torch.ops.eagle_fx.*)
from eagle_fx.ops.reference import cached_attention_ref, shared_cached_attention_ref, tree_cached_attention_ref

from .fx_graph import op_arguments
from .result import PassContext, PassResult

INLINE = {torch.ops.eagle_fx.cached_attention.default: cached_attention_ref,
          torch.ops.eagle_fx.shared_cached_attention.default: shared_cached_attention_ref,
          torch.ops.eagle_fx.tree_cached_attention.default: tree_cached_attention_ref}


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    count = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in INLINE:
            continue
        named = op_arguments(n)
        uniform = n.target == torch.ops.eagle_fx.tree_cached_attention.default or named["uniform_queries"]
        if not uniform or named.get("batch_invariant", False):
            continue  # ragged or row-by-row attention reads the host: stays an opaque op
        n.target = INLINE[n.target]
        count += 1
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, count, [f"{count} device-side attention(s) as traceable torch code"])
