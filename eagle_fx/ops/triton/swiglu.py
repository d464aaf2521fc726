"""SwiGLU activation: silu(gate) * up, each step rounded to the input dtype as eager torch does."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _swiglu_kernel(G, U, O, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(O.dtype.element_ty)
    tl.store(O + offs, (s.to(tl.float32) * u.to(tl.float32)).to(O.dtype.element_ty), mask=mask)


@torch.library.custom_op("eagle_fx::triton_swiglu", mutates_args=())
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        block = 1024
        _swiglu_kernel[(triton.cdiv(n, block),)](g, u, out, n, BLOCK=block)
    return out


@swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate)


def swiglu_ref(gate: Tensor, up: Tensor) -> Tensor:
    return torch.nn.functional.silu(gate) * up
