"""Canonical attention ops.

`eagle_fx::attention` is what `canonicalize_attention` turns every SDPA of a captured model into:
causal self-attention over one packed row of tokens, grouped-query heads kept un-repeated.

`eagle_fx::cached_attention` is what `insert_kv_cache` turns it into: the token's K/V are written
into a paged pool through a slot mapping, and each query attends to its own sequence's keys read
back through a block table. The pool is a graph input that the op mutates.

Layouts:
  q            [1, H, T, D]    (T = all tokens of all sequences of the step, packed)
  k, v         [1, KVH, T, D]
  kv_pool      [L, 2, num_blocks, block_size, KVH, D]
  slot_mapping [T]             int64, block * block_size + offset for each token
  block_table  [B, max_blocks] int32/64, the blocks of each sequence in position order
  query_start_loc [B + 1]      int64, token t belongs to sequence s if qsl[s] <= t < qsl[s+1]
  positions    [1, T]          int64, position of each token in its sequence
sliding_window 0 means full attention; otherwise key j is visible to query i when
0 <= i - j < sliding_window (the Hugging Face convention).
"""
from __future__ import annotations

import torch
from torch import Tensor


def visible_keys(q_pos: Tensor, num_keys: int, sliding_window: int) -> Tensor:
    """Bool mask [Tq, num_keys]: key position j is visible to a query at position p."""
    k_pos = torch.arange(num_keys, device=q_pos.device)
    dist = q_pos[:, None] - k_pos[None, :]
    mask = dist >= 0
    if sliding_window > 0:
        mask &= dist < sliding_window
    return mask


@torch.library.custom_op("eagle_fx::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, sliding_window: int) -> Tensor:
    """Causal attention over one sequence per batch row (the model's own, uncached semantics)."""
    t = q.shape[-2]
    pos = torch.arange(t, device=q.device)
    mask = visible_keys(pos, t, sliding_window)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


@attention.register_fake
def _(q, k, v, scale, sliding_window):
    return torch.empty_like(q)


@torch.library.custom_op("eagle_fx::cached_attention", mutates_args=("kv_pool",))
def cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_pool: Tensor,
    layer: int,
    slot_mapping: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    positions: Tensor,
    scale: float,
    sliding_window: int,
    batch_invariant: bool = False,
) -> Tensor:
    """Write k/v at their slots, then attend each query to its sequence's cached keys.

    batch_invariant=True attends one query row at a time, so a row's result does not depend on how
    many rows share the call (chunked prefill then gives bit-identical KV to unchunked prefill).
    """
    kvh, d = k.shape[1], k.shape[3]
    block_size = kv_pool.shape[3]
    k_cache = kv_pool[layer, 0].view(-1, kvh, d)
    v_cache = kv_pool[layer, 1].view(-1, kvh, d)
    k_cache[slot_mapping] = k[0].transpose(0, 1).to(kv_pool.dtype)
    v_cache[slot_mapping] = v[0].transpose(0, 1).to(kv_pool.dtype)

    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    pos = positions.reshape(-1)
    for s in range(len(starts) - 1):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        q_pos = pos[a:b]
        num_keys = int(q_pos.max()) + 1
        num_blocks = -(-num_keys // block_size)
        blocks = block_table[s, :num_blocks].long()
        ks = kv_pool[layer, 0, blocks].reshape(-1, kvh, d)[:num_keys]
        vs = kv_pool[layer, 1, blocks].reshape(-1, kvh, d)[:num_keys]
        kt, vt = ks.transpose(0, 1)[None].to(q.dtype), vs.transpose(0, 1)[None].to(q.dtype)
        gqa = kvh != q.shape[1]
        if batch_invariant:
            for i, p in enumerate(q_pos.tolist(), start=a):
                lo = max(0, p + 1 - sliding_window) if sliding_window > 0 else 0
                out[:, :, i:i + 1] = torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, i:i + 1], kt[:, :, lo:p + 1], vt[:, :, lo:p + 1], scale=scale, enable_gqa=gqa)
            continue
        mask = visible_keys(q_pos, num_keys, sliding_window)
        out[:, :, a:b] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out


@cached_attention.register_fake
def _(q, k, v, kv_pool, layer, slot_mapping, block_table, query_start_loc, positions, scale, sliding_window,
      batch_invariant=False):
    return torch.empty_like(q)


@torch.library.custom_op("eagle_fx::rowwise_linear", mutates_args=())
def rowwise_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear one row at a time: each row's result is independent of how many rows there are."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([torch.nn.functional.linear(r, weight, bias) for r in rows.split(1)]) if rows.shape[0] else \
        rows.new_empty(0, weight.shape[0])
    return out.reshape(*x.shape[:-1], weight.shape[0])


@rowwise_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
