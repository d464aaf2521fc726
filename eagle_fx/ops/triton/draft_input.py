"""The draft's input projection in one kernel: embedding gather + concat + linear.

    EAGLE-1:  y = [E[ids], f] W^T + b
    EAGLE-3:  y = [rmsnorm(E[ids]) * ne, rmsnorm(f) * nf] W^T     (q/k/v of its first layer)

The concatenated [T, He + Hf] activation is never materialised: each K tile is read from the
embedding row or the feature row it belongs to (and normalised on the fly for EAGLE-3).
Accumulation is fp32; bf16/fp16 tiles use the tensor-core dot on a GPU, fp32 (exact products) in
the CPU interpreter, which has no bf16 dot.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _row_inv_rms(X, rows, mrow, n_cols, eps, BM: tl.constexpr, BK: tl.constexpr):
    acc = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, n_cols, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(X + rows[:, None] * n_cols + rk[None, :], mask=mrow[:, None] & (rk[None, :] < n_cols), other=0.0)
        x = x.to(tl.float32)
        acc += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(acc / n_cols + eps)


@triton.jit
def _accumulate(acc, X, rows, mm, H, inv, NW, W, w_col0, K, rn, mn, Y,
                NORM: tl.constexpr, F32: tl.constexpr, BK: tl.constexpr):
    """acc += X[rows, :H] (normalised: * inv * NW when NORM) @ W[rn, w_col0:w_col0 + H]^T."""
    for k0 in range(0, H, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < H
        a = tl.load(X + rows[:, None] * H + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        if NORM:
            a = (a.to(tl.float32) * inv[:, None]).to(Y.dtype.element_ty)
            a = (a.to(tl.float32) * tl.load(NW + rk, mask=mk, other=0.0).to(tl.float32)[None, :]).to(Y.dtype.element_ty)
        w = tl.load(W + rn[None, :] * K + w_col0 + rk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        if F32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a.to(w.dtype), w)
    return acc


@triton.jit
def _draft_input_kernel(IDS, E, F, W, B, NE, NF, Y, M, N, He, Hf, eps,
                        NORM: tl.constexpr, HAS_BIAS: tl.constexpr, F32: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mm, mn = rm < M, rn < N
    ids = tl.load(IDS + rm, mask=mm, other=0).to(tl.int64)
    K = He + Hf
    inv_e = tl.zeros([BM], dtype=tl.float32)
    inv_f = tl.zeros([BM], dtype=tl.float32)
    if NORM:
        inv_e = _row_inv_rms(E, ids, mm, He, eps, BM, BK)
        inv_f = _row_inv_rms(F, rm, mm, Hf, eps, BM, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc = _accumulate(acc, E, ids, mm, He, inv_e, NE, W, 0, K, rn, mn, Y, NORM, F32, BK)  # embedding rows
    acc = _accumulate(acc, F, rm, mm, Hf, inv_f, NF, W, He, K, rn, mn, Y, NORM, F32, BK)  # feature rows
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * N + rn[None, :], acc.to(Y.dtype.element_ty), mask=mm[:, None] & mn[None, :])


@torch.library.custom_op("eagle_fx::triton_draft_input", mutates_args=())
def draft_input(ids: Tensor, embed: Tensor, features: Tensor, weight: Tensor, bias: Tensor | None,
                embed_norm: Tensor | None, feature_norm: Tensor | None, eps: float) -> Tensor:
    """ids [...], embed [V, He], features [..., Hf], weight [N, He + Hf] -> [..., N]."""
    He, Hf, N = embed.shape[1], features.shape[-1], weight.shape[0]
    flat_ids = ids.reshape(-1).contiguous()
    f = features.reshape(-1, Hf).to(weight.dtype).contiguous()
    M = flat_ids.shape[0]
    y = torch.empty(M, N, dtype=weight.dtype, device=weight.device)
    norm = embed_norm is not None
    if M:
        bm, bn, bk = 16, 32, 32
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
        _draft_input_kernel[grid](flat_ids, embed.contiguous(), f, weight.contiguous(),
                                  bias if bias is not None else weight, embed_norm if norm else weight,
                                  feature_norm if norm else weight, y, M, N, He, Hf, eps,
                                  NORM=norm, HAS_BIAS=bias is not None,
                                  F32=weight.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
                                  BM=bm, BN=bn, BK=bk)
    return y.view(*ids.shape, N)


@draft_input.register_fake
def _(ids, embed, features, weight, bias, embed_norm, feature_norm, eps):
    return weight.new_empty(*ids.shape, weight.shape[0])


def draft_input_ref(ids, embed, features, weight, bias=None, embed_norm=None, feature_norm=None, eps=1e-6):
    from eagle_fx.ops.triton.norms import rmsnorm_ref

    e = torch.nn.functional.embedding(ids, embed)
    f = features.to(weight.dtype)
    if embed_norm is not None:
        e, f = rmsnorm_ref(e, embed_norm, eps), rmsnorm_ref(f, feature_norm, eps)
    return torch.nn.functional.linear(torch.cat([e, f], dim=-1), weight, bias)
