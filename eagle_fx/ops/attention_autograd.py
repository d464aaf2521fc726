"""eagle_fx::attention's autograd formula: the backward of the SDPA it stands for, recomputed from
the saved q, k, v (no logsumexp kept), so a graph rewritten by canonicalize_attention still trains.
The cached ops are inference-only (they mutate the KV pool) and have none."""
from __future__ import annotations

import torch

from eagle_fx.ops.reference import attention_ref


def attention_setup_context(ctx, inputs, output):
    q, k, v, scale, sliding_window = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scale, ctx.sliding_window = scale, sliding_window


def attention_backward(ctx, grad_out):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = attention_ref(q_, k_, v_, ctx.scale, ctx.sliding_window)
        dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), grad_out)
    return dq, dk, dv, None, None
