"""The KV cache write on the paged pool [L, 2, blocks, block_size, kv_heads, head_dim].

    launch_write_kv(k, v, pool, layer, slot_mapping): token t's k/v -> pool[layer, :, slot // bs, slot % bs]

A launcher, not an op of its own: `eagle_fx::triton_cached_attention` (paged_attention.py) calls it
before it attends, and the tests check the write through that op. The layer offset is computed on
the host (a Python int, passed as 64-bit once past 2^31 elements).
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _write_kv_kernel(K, V, POOL, SLOTS, layer_off, sk_h, sk_t, sv_h, sv_t, sp_kv, sp_slot, sp_h,
                     D: tl.constexpr, D_PAD: tl.constexpr):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D_PAD)
    md = d < D
    slot = tl.load(SLOTS + t).to(tl.int64)
    dst = POOL + layer_off + slot * sp_slot + h * sp_h + d
    tl.store(dst, tl.load(K + h * sk_h + t * sk_t + d, mask=md).to(POOL.dtype.element_ty), mask=md)
    tl.store(dst + sp_kv, tl.load(V + h * sv_h + t * sv_t + d, mask=md).to(POOL.dtype.element_ty), mask=md)


def launch_write_kv(k: Tensor, v: Tensor, kv_pool: Tensor, layer: int, slot_mapping: Tensor) -> None:
    """k, v [1, KVH, T, D] (any strides; D contiguous)."""
    T, kvh, D = k.shape[2], k.shape[1], k.shape[3]
    if T == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    p = kv_pool
    assert p.is_contiguous(), "the KV pool must be contiguous"
    _write_kv_kernel[(T, kvh)](k, v, p, slot_mapping.contiguous(), layer * p.stride(0), k.stride(1), k.stride(2),
                               v.stride(1), v.stride(2), p.stride(1), p.stride(3), p.stride(4),
                               D=D, D_PAD=triton.next_power_of_2(D))
