"""xgrammar's packed token bitmasks, unpacked and applied in plain torch, so they can live inside a
compiled cycle graph as a mask tensor input (no host work, no data-dependent python: both
functions trace under make_fx and torch.compile(fullgraph=True)).

Layout (xgrammar's): int32 words, ceil(vocab_size / 32) per row; token t is allowed when bit
(t % 32) of word (t // 32) is set. Bit 31 is the int32 sign bit: the shift below is arithmetic, so
a negative word shifted by 31 is -1, and `& 1` keeps exactly that bit. Bits past vocab_size in the
last word carry nothing (xgrammar may set them) and are cut off.
"""
from __future__ import annotations

import torch


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of vocab_size tokens."""
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [..., vocab_size]: True where the packed int32 bitmask [..., W] allows the token.

    vocab_size is the logits width (a python int, fixed per model); W must cover it."""
    if bitmask.dtype != torch.int32:
        raise TypeError(f"a token bitmask is int32 (xgrammar's layout), got {bitmask.dtype}")
    if bitmask.shape[-1] * 32 < vocab_size:
        raise ValueError(f"a bitmask of {bitmask.shape[-1]} words covers {bitmask.shape[-1] * 32} tokens, fewer than "
                         f"vocab_size={vocab_size}; allocate {bitmask_width(vocab_size)} words per row")
    # token t's word and bit, gathered per token (no flatten-and-cut of a [..., W, 32] view: inductor
    # fails to lower that slice with dynamic sizes)
    tokens = torch.arange(vocab_size, device=bitmask.device)
    words = bitmask.index_select(-1, tokens // 32)  # [..., vocab_size]
    return ((words >> (tokens % 32).to(torch.int32)) & 1) != 0


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits with -inf where `allowed` (bool, broadcastable to logits) is False; a new tensor."""
    return logits.masked_fill(~allowed, float("-inf"))
