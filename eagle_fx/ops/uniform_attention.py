"""Device-side (uniform) attention strategies: B sequences of P = T // B query rows each, every
sequence reading the keys of its whole block-table row, masked by position (or by a draft tree's
mask). Nothing is read on the host and no shape depends on data.

  one read      the table's K/V at once ([2, B, S, KVH, D]) and one SDPA under a [B, P, S] mask,
                while the table fits a chunk
  key chunks    a longer table, a chunk of table columns at a time through the online softmax
                (online_softmax.py): eagerly chunks of KV_READ_LIMIT elements, in a compiled graph
                chunks of COMPILED_KEY_CHUNK keys per sequence in a torch.while_loop over the
                table's (dynamic) width. Transient memory is bounded by a chunk, not the context.

What a chunk holds is the op's: a `ChunkReader` gives the K/V and the mask of a run of table
columns starting at a key position (cached: the layer's pool; a KV-sharing draft: the base's
pool below committed_len, its ring above; a tree: the tree mask).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle_fx.ops.limits import attention_limits_now
from eagle_fx.ops.online_softmax import attend_in_chunks, group_heads, ungroup_heads

# (table columns [B, c], the first one's key position: an int, or a 0-d tensor in a compiled loop)
#   -> (K/V [2, B, c * block_size, KVH, D], visible [B, P, c * block_size])
ChunkReader = Callable[[Tensor, int | Tensor], tuple[Tensor, Tensor]]


def uniform_sdpa(q: Tensor, kv: Tensor, mask: Tensor, scale: float) -> Tensor:
    """q [1, H, T, D] as B sequences of T // B rows against kv [2, B, S, KVH, D] under mask [B, T // B, S]."""
    heads, total, d = q.shape[1], q.shape[2], q.shape[3]
    num_seqs = kv.shape[1]
    per_seq = total // num_seqs
    # contiguous: inductor's SDPA lowering cannot re-stride these views when a size is the constant 1
    # (a compiled single-sequence cycle)
    qs = q[0].reshape(heads, num_seqs, per_seq, d).transpose(0, 1).contiguous()  # [B, H, P, D]
    keys, values = kv[0].transpose(1, 2).contiguous(), kv[1].transpose(1, 2).contiguous()  # [B, KVH, S, D]
    # enable_gqa=True also for equal head counts (groups of one): a constant, where the comparison
    # of two sizes would be symbolic in a compiled graph
    out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    # in q's layout, as the ops' fake kernels (empty_like(q)) promise
    return torch.empty_like(q).copy_(out.transpose(0, 1).reshape(1, heads, total, d))


def key_chunk_blocks(block_table: Tensor, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, bool]:
    """(table columns per key chunk, traced?): while compiling, COMPILED_KEY_CHUNK keys per
    sequence (a constant: the loop over a dynamic width is a torch.while_loop); eagerly as many
    columns as KV_READ_LIMIT elements of K/V hold."""
    limits = attention_limits_now()
    if torch.compiler.is_compiling():
        return max(1, limits.compiled_key_chunk // block_size), True
    per_block = 2 * block_table.shape[0] * block_size * kv_heads * head_dim
    return max(1, limits.kv_read_limit // per_block), False


def uniform_attention(q: Tensor, block_table: Tensor, block_size: int, kv_heads: int, head_dim: int,
                      read: ChunkReader, scale: float) -> Tensor:
    """q [1, H, T, D] (B = block_table.shape[0] sequences of T // B rows) over the keys `read`
    gives for their block tables: one read while the table fits a key chunk, else key chunks."""
    num_seqs, width = block_table.shape
    chunk_blocks, traced = key_chunk_blocks(block_table, block_size, kv_heads, head_dim)
    if width <= chunk_blocks:
        kv, mask = read(block_table, 0)
        return uniform_sdpa(q, kv, mask, scale)
    group = q.shape[1] // kv_heads
    num_chunks = -(-width // chunk_blocks)
    if traced:  # a chunk index is a tensor: the table padded to whole chunks (padding keys sit past every query)
        chunks = F.pad(block_table, (0, num_chunks * chunk_blocks - width)).view(num_seqs, num_chunks, chunk_blocks)

        def columns(i):
            return chunks.index_select(1, i.view(1)).view(num_seqs, chunk_blocks)
    else:
        def columns(i):
            return block_table[:, i * chunk_blocks:(i + 1) * chunk_blocks]

    def chunk_at(i):
        kv, visible = read(columns(i), i * (chunk_blocks * block_size))
        kv = kv.transpose(2, 3)  # [2, B, KVH, c, D]
        return kv[0], kv[1], visible.repeat(1, group, 1)[:, None]  # [B, 1, G P, c]

    acc = attend_in_chunks(group_heads(q, num_seqs, kv_heads), chunk_at, num_chunks, scale, traced=traced)
    return ungroup_heads(acc, q)
