"""eagle_fx graph passes: one file per pass, each `run(gm, ctx) -> PassResult`.

`CAPTURE_PASSES` is the one ordered registry of the passes `capture` applies.
"""
from . import canonicalize_attention, insert_kv_cache
from .result import PassContext, PassResult

CAPTURE_PASSES = {
    "canonicalize_attention": canonicalize_attention.run,
    "insert_kv_cache": insert_kv_cache.run,
}

__all__ = ["CAPTURE_PASSES", "PassContext", "PassResult", "canonicalize_attention", "insert_kv_cache"]
