"""RMSNorm and residual-add + RMSNorm (Hugging Face Llama semantics).

    y = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)        (statistics in fp32)
    add_rmsnorm(x, r): s = (x + r) in the input dtype; return (rmsnorm(s), s)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, S, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    xf = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # the sum rounded to the input dtype, as eager adds
        r = tl.load(R + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        xf = (xf + r).to(S.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(S + row * n_cols + cols, xf, mask=mask)
        xf = xf.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * (1.0 / tl.sqrt(var + eps))).to(Y.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(Y + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def _launch(x: Tensor, r: Tensor | None, weight: Tensor, eps: float):
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty_like(x2)
    s = torch.empty_like(x2) if r is not None else y
    r2 = r.reshape(-1, n).contiguous() if r is not None else x2
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight.contiguous(), y, s, n, eps, HAS_RES=r is not None,
                                        BLOCK=triton.next_power_of_2(n))
    return y.view(x.shape), s.view(x.shape)


@torch.library.custom_op("eagle_fx::triton_rmsnorm", mutates_args=())
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _launch(x, None, weight, eps)[0]


@rmsnorm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("eagle_fx::triton_add_rmsnorm", mutates_args=())
def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _launch(x, residual, weight, eps)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def rmsnorm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rmsnorm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x + residual
    return rmsnorm_ref(s, weight, eps), s
