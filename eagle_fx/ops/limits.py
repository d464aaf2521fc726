"""The sizes at which the reference attention switches to bounded-memory strategies (tiles, key
chunks), read at call time (and, for a compiled graph, at trace time) from one object.

    QUERY_TILE          tiled ragged attention: query rows per tile
    SCORE_LIMIT         ragged attention: scores (heads x rows x keys) of one call, else tiles of
                        at most this many
    UNIFORM_MASK_LIMIT  ragged call with equal rows per sequence: batched when a mask is this small
    KV_READ_LIMIT       device-side attention, not compiled: K/V elements read at once (longer:
                        key chunks)
    COMPILED_KEY_CHUNK  device-side attention traced into a compiled graph: keys per sequence read
                        at once (longer tables: a loop over chunks of this many keys)
    FUSED_CHUNK_KERNEL  use a device's fused chunk kernel (the CPU's flash attention, which returns
                        the log-sum-exp) where there is one; False: the explicit softmax everywhere

A test (or a deployment with other memory) sets them with `attention_limits(...)` (a context
manager) or `set_attention_limits(...)`; both name the fields of `AttentionLimits`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class AttentionLimits:
    query_tile: int = 256
    score_limit: int = 1 << 22
    uniform_mask_limit: int = 1 << 16
    kv_read_limit: int = 1 << 20
    compiled_key_chunk: int = 4096
    fused_chunk_kernel: bool = True


_current = AttentionLimits()


def attention_limits_now() -> AttentionLimits:
    """The limits in force."""
    return _current


def set_attention_limits(**changes) -> AttentionLimits:
    """Replace the named limits (fields of AttentionLimits) from now on; returns the previous ones."""
    global _current
    previous = _current
    _current = dataclasses.replace(_current, **changes)
    return previous


@contextlib.contextmanager
def attention_limits(**changes) -> Iterator[AttentionLimits]:
    """The named limits within the block, the previous ones after it."""
    global _current
    previous = set_attention_limits(**changes)
    try:
        yield _current
    finally:
        _current = previous
