"""The torch reference implementations of the eagle_fx ops (registered as their kernels by
canonical.py; traced into compiled graphs by passes/inline_uniform_attention.py): the KV write,
then the strategy a call's layout picks (ragged_attention.py, uniform_attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle_fx.ops.limits import attention_limits_now
from eagle_fx.ops.masks import tree_visible_keys, visible_keys
from eagle_fx.ops.paged_pool import paged_keys, paged_reader, shared_reader, write_kv
from eagle_fx.ops.ragged_attention import ragged_sdpa, rows_one_by_one
from eagle_fx.ops.uniform_attention import uniform_attention, uniform_sdpa


def attention_ref(q: Tensor, k: Tensor, v: Tensor, scale: float, sliding_window: int) -> Tensor:
    """Causal attention over one sequence per batch row (the model's own, uncached semantics)."""
    t = q.shape[-2]
    mask = visible_keys(torch.arange(t, device=q.device), t, sliding_window)
    # enable_gqa=True also for equal head counts: a constant where a size comparison is symbolic (a
    # traced backward with dynamic shapes)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def cached_attention_ref(q: Tensor, k: Tensor, v: Tensor, kv_pool: Tensor, layer: int, slot_mapping: Tensor,
                         block_table: Tensor, query_start_loc: Tensor, positions: Tensor, scale: float,
                         sliding_window: int, batch_invariant: bool = False, uniform_queries: bool = False) -> Tensor:
    """Write k/v at their slots, then attend each query to its sequence's cached keys.

    uniform_queries=True: device-side only (uniform_attention.py). batch_invariant=True attends
    one query row at a time, so a row's result does not depend on how many rows share the call
    (chunked prefill then gives bit-identical KV to unchunked prefill).
    """
    pool = kv_pool[layer]  # [2, blocks, block_size, kvh, d]
    write_kv(kv_pool, layer, k, v, slot_mapping)
    pos = positions.reshape(-1)
    kvh, block_size = kv_pool.shape[4], kv_pool.shape[3]
    if uniform_queries and not batch_invariant:
        q_pos = pos.view(block_table.shape[0], -1)

        def read(columns, first_key):
            kv = paged_keys(pool, columns, q.dtype)
            return kv, visible_keys(q_pos, kv.shape[2], sliding_window, first_key)

        return uniform_attention(q, block_table, block_size, kvh, q.shape[3], read, scale)
    out = torch.empty_like(q)
    n_seq = query_start_loc.shape[0] - 1
    # one host read for all sequences: query bounds, each sequence's first and last query position
    meta = torch.cat([query_start_loc, pos[query_start_loc[:-1].clamp(max=max(pos.numel() - 1, 0))],
                      pos[(query_start_loc[1:] - 1).clamp(min=0)]]).tolist()
    bounds, firsts, ends = meta[:n_seq + 1], meta[n_seq + 1:2 * n_seq + 1], meta[2 * n_seq + 1:]
    per_seq = bounds[1]
    if (not batch_invariant and n_seq > 1 and per_seq * (max(ends) + 1) <= attention_limits_now().uniform_mask_limit
            and all(bounds[s + 1] - bounds[s] == per_seq for s in range(n_seq))):
        # equal rows per sequence and a small mask (many short prompts): one attention for all
        nb = -(-(max(ends) + 1) // block_size)
        kv = paged_keys(pool, block_table[:, :nb], q.dtype)
        return uniform_sdpa(q, kv, visible_keys(pos.view(n_seq, per_seq), kv.shape[2], sliding_window), scale)
    for s in range(n_seq):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        num_keys = ends[s] + 1  # a sequence's queries are its last positions
        read = paged_reader(pool, block_table[s], q.dtype)
        if batch_invariant:
            out[:, :, a:b] = rows_one_by_one(q[:, :, a:b], read(0, num_keys), pos[a:b].tolist(), scale,
                                             sliding_window)
            continue
        out[:, :, a:b] = ragged_sdpa(q[:, :, a:b], read, kvh, num_keys, pos[a:b], firsts[s], scale, sliding_window)
    return out


def shared_cached_attention_ref(q: Tensor, k: Tensor | None, v: Tensor | None, kv_pool: Tensor, base_layer: int,
                                spec_kv: Tensor, spec_rows: Tensor, committed_len: Tensor, block_table: Tensor,
                                query_start_loc: Tensor, positions: Tensor, scale: float, sliding_window: int,
                                batch_invariant: bool = False, uniform_queries: bool = False) -> Tensor:
    """Write the uncommitted rows' k/v into the ring, then attend each query to its sequence's keys:
    the base layer's below committed_len, the ring's from there on. uniform_queries=True:
    device-side only (a sequence's rows then span at most the ring's size in positions);
    batch_invariant=True: one query row at a time, as cached_attention's."""
    kvh, ring = spec_kv.shape[-2], spec_kv.shape[2]
    pos = positions.reshape(-1)
    if uniform_queries and not batch_invariant:
        num_seqs, total = block_table.shape[0], pos.shape[0]
        seq = torch.arange(total, device=pos.device) // (total // num_seqs)
        if k is not None and v is not None:  # committed rows write back what the ring holds
            own = (pos >= committed_len[seq])[None, :, None, None]
            rows, slots = spec_rows[seq], pos % ring
            new = torch.stack([k[0], v[0]]).transpose(1, 2).to(spec_kv.dtype)  # [2, T, kvh, d]
            spec_kv[:, rows, slots] = torch.where(own, new, spec_kv[:, rows, slots])
        q_pos = pos.view(num_seqs, -1)
        ring_rows = spec_kv[:, spec_rows]  # [2, B, R, kvh, d]

        def read(columns, first_key):
            base = paged_keys(kv_pool[base_layer], columns, q.dtype)  # [2, B, c, kvh, d]
            key_pos = torch.arange(base.shape[2], device=pos.device) + first_key
            ring_kv = ring_rows[:, :, key_pos % ring].to(q.dtype)  # [2, B, c, kvh, d]
            committed = (key_pos[None] < committed_len[:, None])[None, :, :, None, None]
            return torch.where(committed, base, ring_kv), visible_keys(q_pos, base.shape[2], sliding_window, first_key)

        return uniform_attention(q, block_table, kv_pool.shape[3], kvh, q.shape[3], read, scale)
    n_seq = query_start_loc.shape[0] - 1
    meta = torch.cat([query_start_loc, pos[query_start_loc[1:] - 1], committed_len, spec_rows]).tolist()
    bounds, ends = meta[:n_seq + 1], meta[n_seq + 1:2 * n_seq + 1]
    committed, rows = meta[2 * n_seq + 1:3 * n_seq + 1], meta[3 * n_seq + 1:]
    seq = torch.repeat_interleave(torch.arange(n_seq, device=pos.device), query_start_loc.diff())
    own = pos >= committed_len[seq]
    if k is None or v is None:
        if bool(own.any()):
            raise ValueError("eagle_fx.shared_cached_attention: rows at positions >= committed_len need their k/v")
    else:
        r = own.nonzero().squeeze(1)
        if r.numel():
            new = torch.stack([k[0][:, r], v[0][:, r]]).transpose(1, 2).to(spec_kv.dtype)  # [2, r, kvh, d]
            spec_kv[:, spec_rows[seq[r]], pos[r] % ring] = new
    out = torch.empty_like(q)
    for s in range(n_seq):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        num_keys = ends[s] + 1
        c = min(committed[s], num_keys)
        if num_keys - c > ring:
            raise ValueError(f"eagle_fx.shared_cached_attention: {num_keys - c} uncommitted positions > ring size {ring}")
        first = ends[s] + 1 - (b - a)
        read = shared_reader(paged_reader(kv_pool[base_layer], block_table[s], q.dtype), spec_kv[:, rows[s]], c,
                             q.dtype)
        if batch_invariant:
            out[:, :, a:b] = rows_one_by_one(q[:, :, a:b], read(0, num_keys), pos[a:b].tolist(), scale,
                                             sliding_window)
            continue
        out[:, :, a:b] = ragged_sdpa(q[:, :, a:b], read, kvh, num_keys, pos[a:b], first, scale, sliding_window)
    return out


def tree_cached_attention_ref(q: Tensor, k: Tensor, v: Tensor, kv_pool: Tensor, layer: int, slot_mapping: Tensor,
                              block_table: Tensor, query_start_loc: Tensor, positions: Tensor, tree_mask: Tensor,
                              tree_start: Tensor, scale: float, sliding_window: int,
                              batch_invariant: bool = False) -> Tensor:
    """Write k/v at their slots, then attend each query to its sequence's keys below tree_start and
    to the tree slots its tree_mask row marks. Device-side only; batch_invariant=True: one query
    row at a time."""
    pool = kv_pool[layer]
    write_kv(kv_pool, layer, k, v, slot_mapping)
    num_seqs, width = block_table.shape[0], tree_mask.shape[1]
    q_pos = positions.reshape(num_seqs, -1)
    tree_rows = tree_mask.view(num_seqs, -1, width)

    def read(columns, first_key):
        kv = paged_keys(pool, columns, q.dtype)
        return kv, tree_visible_keys(q_pos, tree_rows, tree_start, kv.shape[2], sliding_window, first_key)

    if not batch_invariant:
        return uniform_attention(q, block_table, kv_pool.shape[3], kv_pool.shape[4], q.shape[3], read, scale)
    kv, mask = read(block_table, 0)
    heads, total = q.shape[1], q.shape[2]
    per_seq = total // num_seqs
    out = torch.empty_like(q)
    gqa = kv.shape[-2] != heads
    for i in range(total):
        s, r = divmod(i, per_seq)
        out[:, :, i:i + 1] = F.scaled_dot_product_attention(
            q[:, :, i:i + 1], kv[0, s].transpose(0, 1)[None], kv[1, s].transpose(0, 1)[None],
            attn_mask=mask[s, r:r + 1], scale=scale, enable_gqa=gqa)
    return out


def rowwise_linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear one row at a time: each row's result is independent of how many rows there are."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    out = torch.cat([F.linear(r, weight, bias) for r in rows.split(1)])
    return out.reshape(*x.shape[:-1], weight.shape[0])
