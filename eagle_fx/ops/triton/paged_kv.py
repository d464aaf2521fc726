"""KV cache writes and copies on the paged pool [L, 2, blocks, block_size, kv_heads, head_dim].

Layer offsets are computed on the host (Python ints, passed as 64-bit once past 2^31 elements).

    write_kv(k, v, pool, layer, slot_mapping): token t's k/v -> pool[layer, :, slot // bs, slot % bs]
    copy_kv(pool, src_layer, src_slots, dst_layer, dst_slots): K/V of src slots -> dst slots
        (a shifted pair sharing KV: draft slot p takes the base's K/V of slot p + 1)
"""
from __future__ import annotations

import torch
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


@torch.library.custom_op("eagle_fx::triton_write_kv", mutates_args=("kv_pool",))
def write_kv(k: Tensor, v: Tensor, kv_pool: Tensor, layer: int, slot_mapping: Tensor) -> None:
    launch_write_kv(k, v, kv_pool, layer, slot_mapping)


def write_kv_ref(k, v, kv_pool, layer, slot_mapping):
    kvh, d = k.shape[1], k.shape[3]
    kv_pool[layer].view(2, -1, kvh, d).index_copy_(1, slot_mapping, torch.stack([k[0], v[0]]).transpose(1, 2).to(kv_pool.dtype))


@triton.jit
def _copy_kv_kernel(POOL, SRC, DST, src_off, dst_off, sp_kv, sp_slot, sp_h,
                    D: tl.constexpr, D_PAD: tl.constexpr):
    i, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D_PAD)
    md = d < D
    s, t = tl.load(SRC + i).to(tl.int64), tl.load(DST + i).to(tl.int64)
    src = POOL + src_off + s * sp_slot + h * sp_h + d
    dst = POOL + dst_off + t * sp_slot + h * sp_h + d
    for kv in range(2):
        tl.store(dst + kv * sp_kv, tl.load(src + kv * sp_kv, mask=md), mask=md)


@torch.library.custom_op("eagle_fx::triton_copy_kv", mutates_args=("kv_pool",))
def copy_kv(kv_pool: Tensor, src_layer: int, src_slots: Tensor, dst_layer: int, dst_slots: Tensor) -> None:
    n, kvh, D = src_slots.shape[0], kv_pool.shape[4], kv_pool.shape[5]
    if n == 0:
        return
    p = kv_pool
    _copy_kv_kernel[(n, kvh)](p, src_slots.contiguous(), dst_slots.contiguous(), src_layer * p.stride(0),
                              dst_layer * p.stride(0), p.stride(1), p.stride(3), p.stride(4), D=D,
                              D_PAD=triton.next_power_of_2(D))


def copy_kv_ref(kv_pool, src_layer, src_slots, dst_layer, dst_slots):
    kvh, d = kv_pool.shape[4], kv_pool.shape[5]
    src = kv_pool[src_layer].view(2, -1, kvh, d)[:, src_slots]
    kv_pool[dst_layer].view(2, -1, kvh, d)[:, dst_slots] = src
