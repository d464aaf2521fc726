"""Paged attention over the KV pool, one kernel for every step shape.

A program per (query token, head): the query at position p of sequence s attends keys
max(0, p - window + 1) .. p of its sequence, read block by block through block_table[s], with an
online softmax in fp32. That covers ragged causal prefill (many rows per sequence), the extend
and verify steps (k+1 rows) and decode (one row), grouped-query heads (head h reads kv head
h // (H // KVH)) and sliding windows (0 = full attention).

`cached_attention` = write the step's k/v by slot mapping, then attend: the Triton form of
`eagle_fx::cached_attention` (same arguments and semantics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from eagle_fx.ops.triton.paged_kv import launch_write_kv


@triton.jit
def _paged_attention_kernel(Q, O, POOL, BT, SEQ, POS, layer_off, scale, window, group,
                            sq_h, sq_t, so_h, so_t, sp_kv, sp_b, sp_o, sp_h, sbt,
                            BS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D_PAD)
    md = d < D
    s = tl.load(SEQ + t).to(tl.int64)
    p = tl.load(POS + t).to(tl.int64)
    kvh = h // group
    q = tl.load(Q + h * sq_h + t * sq_t + d, mask=md, other=0.0).to(tl.float32) * scale
    lo = p * 0  # int64, like p (the compiler wants one type on both branches)
    if window > 0:
        lo = tl.maximum(p - window + 1, 0)
    m_i = tl.full([], -1.0e30, tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    o = tl.arange(0, BS)
    base = POOL + layer_off + kvh * sp_h
    for j in range(lo // BS, p // BS + 1):
        blk = tl.load(BT + s * sbt + j).to(tl.int64)
        kpos = j * BS + o
        mk = (kpos <= p) & (kpos >= lo)
        ptr = base + blk * sp_b + o[:, None] * sp_o + d[None, :]
        k = tl.load(ptr, mask=mk[:, None] & md[None, :], other=0.0).to(tl.float32)
        scores = tl.where(mk, tl.sum(k * q[None, :], axis=1), -1.0e30)
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        pr = tl.where(mk, tl.exp(scores - m_new), 0.0)
        v = tl.load(ptr + sp_kv, mask=mk[:, None] & md[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(pr[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(pr, axis=0)
        m_i = m_new
    tl.store(O + h * so_h + t * so_t + d, (acc / l_i).to(O.dtype.element_ty), mask=md)


def launch_paged_attention(q: Tensor, kv_pool: Tensor, layer: int, block_table: Tensor, query_start_loc: Tensor,
                           positions: Tensor, scale: float, sliding_window: int) -> Tensor:
    """q [1, H, T, D] -> [1, H, T, D]; keys and values from the pool."""
    H, T, D = q.shape[1], q.shape[2], q.shape[3]
    out = q.new_empty(q.shape)  # contiguous, whatever q's strides
    if T == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    p = kv_pool
    assert p.is_contiguous(), "the KV pool must be contiguous"
    tok = torch.arange(T, device=q.device)
    seq = torch.searchsorted(query_start_loc[1:].contiguous(), tok, right=True)  # sequence of each token
    bt = block_table.contiguous()
    # the layer's offset is computed here: a Python int, passed as 64-bit once it passes 2^31
    _paged_attention_kernel[(T, H)](q, out, p, bt, seq, positions.reshape(-1).contiguous(), layer * p.stride(0), scale,
                                    sliding_window, H // p.shape[4], q.stride(1), q.stride(2), out.stride(1),
                                    out.stride(2), p.stride(1), p.stride(2), p.stride(3), p.stride(4),
                                    bt.stride(0), BS=p.shape[3], D=D, D_PAD=triton.next_power_of_2(D))
    return out


@torch.library.custom_op("eagle_fx::triton_cached_attention", mutates_args=("kv_pool",))
def cached_attention(q: Tensor, k: Tensor, v: Tensor, kv_pool: Tensor, layer: int, slot_mapping: Tensor,
                     block_table: Tensor, query_start_loc: Tensor, positions: Tensor, scale: float,
                     sliding_window: int) -> Tensor:
    launch_write_kv(k, v, kv_pool, layer, slot_mapping)
    return launch_paged_attention(q, kv_pool, layer, block_table, query_start_loc, positions, scale, sliding_window)


@cached_attention.register_fake
def _(q, k, v, kv_pool, layer, slot_mapping, block_table, query_start_loc, positions, scale, sliding_window):
    return q.new_empty(q.shape)
