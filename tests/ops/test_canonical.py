"""The torch reference of eagle_fx::cached_attention: the one-call path for sequences with equal
query counts == attending each sequence on its own (the per-sequence path)."""
import pytest
import torch

from eagle_fx.ops.canonical import cached_attention_ref


def _case(lens_before, per_seq, heads=4, kvh=2, d=8, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_seq = len(lens_before)
    blocks_per_seq = 6
    pool = torch.randn(2, 2, n_seq * blocks_per_seq + 1, block_size, kvh, d, generator=g)
    block_table = torch.randperm(n_seq * blocks_per_seq, generator=g).view(n_seq, blocks_per_seq)
    pos = torch.cat([torch.arange(n, n + per_seq) for n in lens_before])
    seq = torch.arange(n_seq).repeat_interleave(per_seq)
    slots = block_table[seq, pos // block_size] * block_size + pos % block_size
    total = n_seq * per_seq
    q, k, v = (torch.randn(1, h, total, d, generator=g) for h in (heads, kvh, kvh))
    qsl = torch.arange(n_seq + 1) * per_seq
    return q, k, v, pool, slots, block_table, qsl, pos[None]


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("lens_before,per_seq", [([3, 10, 0], 1), ([7, 2], 4), ([0, 0, 0, 0], 6)])
def test_uniform_batch_equals_per_sequence(lens_before, per_seq, window):
    q, k, v, pool, slots, bt, qsl, pos = _case(lens_before, per_seq)
    pool_all = pool.clone()
    together = cached_attention_ref(q, k, v, pool_all, 1, slots, bt, qsl, pos, 0.3, window)
    for s in range(len(lens_before)):  # one sequence per call: the per-sequence path
        rows = slice(s * per_seq, (s + 1) * per_seq)
        alone = cached_attention_ref(q[:, :, rows], k[:, :, rows], v[:, :, rows], pool, 1, slots[rows], bt[s:s + 1],
                                     torch.tensor([0, per_seq]), pos[:, rows], 0.3, window)
        torch.testing.assert_close(together[:, :, rows], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool_all, pool)  # both wrote the same K/V


def test_attention_op_has_the_sdpa_gradient():
    """eagle_fx::attention's autograd formula: the gradients of the causal SDPA it stands for (GQA, window)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 7, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 7, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 7, 8, generator=g, requires_grad=True)
    for window in (0, 3):
        grads = torch.autograd.grad(torch.ops.eagle_fx.attention(q, k, v, 0.3, window).pow(2).sum(), (q, k, v))
        t = torch.arange(7)
        mask = (t[:, None] >= t) & ((t[:, None] - t < window) if window else True)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
        for got, want in zip(grads, torch.autograd.grad(ref.pow(2).sum(), (q, k, v))):
            torch.testing.assert_close(got, want)
