"""Ragged (prefill) attention strategies: one sequence's queries at consecutive positions over its
keys, read through a KeyReader, with a host-known first position.

  one SDPA            a small call (the causal kernel for a fresh sequence from position 0
                      without a window, else a position mask)
  query tiles         a call whose scores (heads x rows x keys) would pass SCORE_LIMIT: query
                      tiles x key chunks through the online softmax (online_softmax.py), reading
                      one chunk's blocks at a time; transient memory bounded by the tiles
  row by row          batch_invariant: each query row alone, so its result does not depend on
                      how many rows share the call
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle_fx.ops.limits import attention_limits_now
from eagle_fx.ops.masks import visible_keys
from eagle_fx.ops.online_softmax import attend_in_chunks
from eagle_fx.ops.paged_pool import KeyReader


def ragged_sdpa(q: Tensor, read_kv: KeyReader, kv_heads: int, num_keys: int, q_pos: Tensor, first: int,
                scale: float, sliding_window: int) -> Tensor:
    """One sequence's queries q [1, H, n, D] at the consecutive positions q_pos = first..first+n-1
    (first known on the host) over its keys 0..num_keys-1, read through `read_kv`. Small calls are
    one SDPA; a call whose scores would exceed SCORE_LIMIT is attended in tiles (tiled_attention),
    so its transient memory does not grow with the context."""
    heads, n = q.shape[1], q.shape[2]
    if first == 0 and n == num_keys and sliding_window == 0:
        kv = read_kv(0, num_keys)
        return F.scaled_dot_product_attention(q, kv[0][None], kv[1][None], is_causal=True, scale=scale,
                                              enable_gqa=kv.shape[1] != heads)
    if heads * n * num_keys > attention_limits_now().score_limit:
        return tiled_attention(q, read_kv, kv_heads, q_pos, first, scale, sliding_window)
    kv = read_kv(0, num_keys)
    mask = None
    if n > 1 or 0 < sliding_window < num_keys:  # else the one query sees every key
        mask = visible_keys(q_pos, num_keys, sliding_window)
    return F.scaled_dot_product_attention(q, kv[0][None], kv[1][None], attn_mask=mask, scale=scale,
                                          enable_gqa=kv.shape[1] != heads)


def tiled_attention(q: Tensor, read_kv: KeyReader, kv_heads: int, q_pos: Tensor, first: int, scale: float,
                    sliding_window: int) -> Tensor:
    """Attention of q [1, H, n, D] (consecutive positions from `first`) in tiles: query tiles of at
    most QUERY_TILE rows, each over the key chunks it can see (causal, window) through the online
    softmax. Query heads are grouped by their kv head, so keys are never repeated for GQA, and a
    chunk's scores or mask stay within SCORE_LIMIT: the transient memory is bounded by the tiles,
    not by the context."""
    limits = attention_limits_now()
    heads, n, d = q.shape[1], q.shape[2], q.shape[3]
    out = torch.empty_like(q)
    rows = min(n, limits.query_tile)
    group = heads // kv_heads
    for a in range(0, n, rows):
        b = min(n, a + rows)
        lo_pos, hi_pos = first + a, first + b - 1  # the tile's first and last query positions
        key_lo = max(0, lo_pos + 1 - sliding_window) if sliding_window > 0 else 0
        qg = q[0, :, a:b].reshape(1, kv_heads, group * (b - a), d)  # heads grouped by kv head (h // group)
        chunk = max(1, limits.score_limit // (heads * (b - a)))
        tile_pos = q_pos[a:b]

        def chunk_at(i: int, key_lo=key_lo, lo_pos=lo_pos, hi_pos=hi_pos, chunk=chunk, tile_pos=tile_pos):
            c0 = key_lo + i * chunk
            c1 = min(hi_pos + 1, c0 + chunk)
            kv = read_kv(c0, c1)  # [2, KVH, c, D]
            visible = None
            if c1 - 1 > lo_pos or (sliding_window > 0 and c0 <= hi_pos - sliding_window):  # some key hidden
                visible = visible_keys(tile_pos, c1 - c0, sliding_window, first_key=c0).repeat(group, 1)[None, None]
            return kv[0][None], kv[1][None], visible

        acc = attend_in_chunks(qg, chunk_at, -(-(hi_pos + 1 - key_lo) // chunk), scale)  # [1, KVH, G r, D]
        out[0, :, a:b] = acc.view(heads, b - a, d).to(out.dtype)
    return out


def rows_one_by_one(q: Tensor, kv: Tensor, q_pos: list[int], scale: float, sliding_window: int) -> Tensor:
    """Each query row of q [1, H, n, D] (at positions q_pos) alone over its visible keys of kv
    [2, KVH, S, D] (batch_invariant: a row's result does not depend on the rows sharing the call)."""
    out = torch.empty_like(q)
    kt, vt = kv[0][None], kv[1][None]
    gqa = kv.shape[1] != q.shape[1]
    for i, p in enumerate(q_pos):
        lo = max(0, p + 1 - sliding_window) if sliding_window > 0 else 0
        out[:, :, i:i + 1] = F.scaled_dot_product_attention(q[:, :, i:i + 1], kt[:, :, lo:p + 1], vt[:, :, lo:p + 1],
                                                            scale=scale, enable_gqa=gqa)
    return out

