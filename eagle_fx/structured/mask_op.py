"""The grammar's masks as ops of the cycle graph: the host's matchers called from inside it.

A cycle under a grammar needs the mask of draft j+1 after draft j is picked, and the verify's k+1
rows after all drafts (eagle_fx.structured.cycle_masks). Both are host work (xgrammar's matchers).
Here they are two custom ops the chain cycle calls where it needs a mask, so a compiled cycle stays
one compiled call with the host's work inside it, in the order its data flow gives (row j takes
draft j, which was picked under row j-1; the verify's rows take every draft):

    with filling(masks):                        # masks: the cycle's CycleMasks
        words = grammar_draft_row(previous, j, width)   # [B, W] int32: row j (previous: draft j,
                                                        #   or any [B] tensor for j = 0)
        rows = grammar_verify_rows(drafts, width)       # [B, k+1, W]: every row; matchers rolled back

The ops read the cycle's CycleMasks from a context variable that `filling` sets around the call (a
cycle runs on one thread), so no Python object passes through the graph. They return new tensors
on the input's device; on a GPU each is a sync (the draft's token read on the host). Compiled with
inductor (cpp_wrapper included) an op costs about 30 µs of calling Python back on this project's
CPU, against about 0.2 ms per extra compiled call when the cycle ran in pieces.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

_active = contextvars.ContextVar("eagle_fx_cycle_masks", default=None)


@contextlib.contextmanager
def filling(masks):
    """The cycle's CycleMasks for the grammar ops called inside; the matchers rolled back after it
    (also when the cycle raised)."""
    token = _active.set(masks)
    try:
        yield
    finally:
        _active.reset(token)
        masks.rollback()


def _masks():
    masks = _active.get()
    if masks is None:
        raise RuntimeError("a grammar mask op ran outside a cycle with masks (eagle_fx.structured.mask_op.filling)")
    return masks


@torch.library.custom_op("eagle_fx::grammar_draft_row", mutates_args=())
def grammar_draft_row(previous: torch.Tensor, j: int, width: int) -> torch.Tensor:
    """Row j of the cycle's masks, int32 [B, width]: what the grammar allows after the drafts before
    draft j+1. previous [B]: draft j (j >= 1); for j = 0 any [B] tensor (it orders the op)."""
    words = _masks().draft_row(j, previous if j > 0 else None)
    return words.to(previous.device, copy=True)


@grammar_draft_row.register_fake
def _(previous, j, width):
    return previous.new_empty((previous.shape[0], width), dtype=torch.int32)


@torch.library.custom_op("eagle_fx::grammar_verify_rows", mutates_args=())
def grammar_verify_rows(drafts: torch.Tensor, width: int) -> torch.Tensor:
    """Every row of the cycle's masks, int32 [B, k+1, width], for drafts [B, k]; the matchers are
    back at each request's committed output after it."""
    return _masks().verify_rows(drafts).to(drafts.device, copy=True)


@grammar_verify_rows.register_fake
def _(drafts, width):
    return drafts.new_empty((drafts.shape[0], drafts.shape[1] + 1, width), dtype=torch.int32)
