"""eagle_fx graph passes: one file per pass, each `run(gm, ctx) -> PassResult`.

`PASSES` is the one registry (name -> run); `eagle_fx.pipeline` decides which passes run on which
step graph, in which order, with which PassContext. `fx_graph` holds FX helpers the passes share.
"""
from . import (alias_draft_kv, batch_invariant, canonicalize_attention, drop_prefill_shift, insert_kv_cache,
               inline_uniform_attention, insert_tree_mask, lower_to_triton, mark_uniform_queries,
               prune_draft_rows, shard_tensor_parallel)
from .result import PassContext, PassResult

PASSES = {
    "canonicalize_attention": canonicalize_attention.run,
    "insert_kv_cache": insert_kv_cache.run,
    "drop_prefill_shift": drop_prefill_shift.run,
    "batch_invariant": batch_invariant.run,
    "alias_draft_kv": alias_draft_kv.run,
    "prune_draft_rows": prune_draft_rows.run,
    "lower_to_triton": lower_to_triton.run,
    "insert_tree_mask": insert_tree_mask.run,
    "mark_uniform_queries": mark_uniform_queries.run,
    "inline_uniform_attention": inline_uniform_attention.run,
    "shard_tensor_parallel": shard_tensor_parallel.run,
}

__all__ = ["PASSES", "PassContext", "PassResult", "alias_draft_kv", "batch_invariant", "canonicalize_attention",
           "drop_prefill_shift", "inline_uniform_attention", "insert_kv_cache", "insert_tree_mask", "lower_to_triton",
           "mark_uniform_queries", "prune_draft_rows", "shard_tensor_parallel"]
