"""eagle_fx graph passes: one file per pass, each `run(gm, ctx) -> PassResult`.

`PASSES` is the one registry (name -> run); `capture` decides which graph each pass runs on.
"""
from . import (alias_draft_kv, batch_invariant, canonicalize_attention, drop_prefill_shift, insert_kv_cache,
               insert_tree_mask, lower_draft_prefill, prune_draft_rows)
from .result import PassContext, PassResult

PASSES = {
    "canonicalize_attention": canonicalize_attention.run,
    "insert_kv_cache": insert_kv_cache.run,
    "drop_prefill_shift": drop_prefill_shift.run,
    "batch_invariant": batch_invariant.run,
    "alias_draft_kv": alias_draft_kv.run,
    "prune_draft_rows": prune_draft_rows.run,
    "lower_draft_prefill": lower_draft_prefill.run,
    "insert_tree_mask": insert_tree_mask.run,
}
CAPTURE_PASSES = ("canonicalize_attention", "insert_kv_cache")

__all__ = ["CAPTURE_PASSES", "PASSES", "PassContext", "PassResult", "alias_draft_kv", "batch_invariant", "canonicalize_attention",
           "drop_prefill_shift", "insert_kv_cache", "insert_tree_mask", "lower_draft_prefill",
           "prune_draft_rows"]
