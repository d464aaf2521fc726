"""Each Triton kernel against its torch reference, under TRITON_INTERPRET=1 on the CPU (set in
conftest.py before any kernel module is imported): fp32 tight, bf16 loose, odd shapes."""
import pytest
import torch

from eagle_fx.ops.canonical import cached_attention_ref
from eagle_fx.ops.triton import load_kernels

load_kernels()
from eagle_fx.ops.triton import draft_input, norms, paged_attention, swiglu  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 48), (1, 3, 100), (2, 3, 4, 24)])
def test_rmsnorm(shape, dtype):
    g = _g()
    x, r = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=g).to(dtype)
    torch.testing.assert_close(norms.rmsnorm(x, w, 1e-6), norms.rmsnorm_ref(x, w, 1e-6), **TOL[dtype])
    y, s = norms.add_rmsnorm(x, r, w, 1e-5)
    y_ref, s_ref = norms.add_rmsnorm_ref(x, r, w, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(s, s_ref)  # the residual sum, rounded in the input dtype like eager
    else:  # the CPU interpreter narrows fp32 -> bf16 by truncation (a GPU rounds to nearest): 1 ulp
        torch.testing.assert_close(s, s_ref, **TOL[dtype])
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(dtype):
    g = _g(1)
    gate, up = (torch.randn(3, 7, 33, generator=g).to(dtype) for _ in range(2))
    torch.testing.assert_close(swiglu.swiglu(gate, up), swiglu.swiglu_ref(gate, up), **TOL[dtype])
    assert swiglu.swiglu(gate[:0], up[:0]).shape == (0, 7, 33)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eagle3", [False, True])
def test_draft_input(eagle3, dtype):
    """EAGLE-1: [E[ids], f] W^T + b; EAGLE-3: [norm(E[ids]), norm(f)] W^T; non-power-of-two sizes."""
    g = _g(2)
    He, Hf, N, V = 40, 72, 36, 50  # Hf != He: EAGLE-3's fc input sizes differ in general
    ids = torch.randint(0, V, (1, 7), generator=g)
    E = torch.randn(V, He, generator=g).to(dtype)
    f = torch.randn(1, 7, Hf, generator=g).to(dtype)
    W = (torch.randn(N, He + Hf, generator=g) * 0.1).to(dtype)
    if eagle3:
        ne, nf, b = torch.randn(He, generator=g).to(dtype), torch.randn(Hf, generator=g).to(dtype), None
    else:
        ne = nf = None
        b = torch.randn(N, generator=g).to(dtype)
    got = draft_input.draft_input(ids, E, f, W, b, ne, nf, 1e-6)
    ref = draft_input.draft_input_ref(ids, E, f, W, b, ne, nf, 1e-6)
    assert got.shape == (1, 7, N)
    torch.testing.assert_close(got, ref, **TOL[dtype])


def _paged_case(lens, starts, heads, kv_heads, block_size, dtype, D=24, seed=3):
    """Ragged sequences with cached prefixes: seq s holds query positions starts[s]..starts[s]+lens[s]-1."""
    g = _g(seed)
    nb_per_seq = 4
    B = len(lens)
    pool = torch.randn(2, 2, B * nb_per_seq + 1, block_size, kv_heads, D, generator=g).to(dtype)
    bt = torch.randperm(B * nb_per_seq, generator=g).view(B, nb_per_seq)  # scattered blocks
    qsl = torch.tensor([0] + lens).cumsum(0)
    pos = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens)])[None]
    seq = torch.repeat_interleave(torch.arange(B), torch.tensor(lens))
    slots = bt[seq, pos[0] // block_size] * block_size + pos[0] % block_size
    T = pos.shape[1]
    q = torch.randn(1, T, heads, D, generator=g).to(dtype).transpose(1, 2)  # [1, H, T, D] views, as in the graphs
    k = torch.randn(1, T, kv_heads, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(1, T, kv_heads, D, generator=g).to(dtype).transpose(1, 2)
    return q, k, v, pool, slots, bt, qsl, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("window", [0, 3, 4])
@pytest.mark.parametrize("kind,lens,starts", [("prefill", [9, 1, 4], [0, 0, 0]), ("verify", [4, 4], [6, 3]),
                                              ("decode", [1, 1, 1], [7, 0, 12])])
def test_paged_attention(kind, lens, starts, heads, kv_heads, window, dtype):
    """Prefill (ragged causal), verify (k+1 rows after a cached prefix), decode; GQA 1/2/4; window
    edges (3, and 4 = the block size); sequences crossing block boundaries."""
    q, k, v, pool, slots, bt, qsl, pos = _paged_case(lens, starts, heads, kv_heads, 4, dtype)
    pool_ref = pool.clone()
    ref = cached_attention_ref(q, k, v, pool_ref, 1, slots, bt, qsl, pos, 0.2, window)
    got = paged_attention.cached_attention(q, k, v, pool, 1, slots, bt, qsl, pos, 0.2, window)
    assert torch.equal(pool, pool_ref)  # the KV write is a copy: exact
    torch.testing.assert_close(got, ref, **TOL[dtype])


def test_fake_impls_export():
    """The ops have fake impls: a function using them exports (torch.export, dynamic tokens)."""
    class M(torch.nn.Module):
        def forward(self, x, r, w, g):
            y, s = torch.ops.eagle_fx.triton_add_rmsnorm(x, r, w, 1e-6)
            return torch.ops.eagle_fx.triton_swiglu(y, g), s

    x = torch.randn(1, 5, 48)
    T = torch.export.Dim("T", min=2, max=64)
    ep = torch.export.export(M(), (x, x, torch.randn(48), x), dynamic_shapes=({1: T}, {1: T}, None, {1: T}))
    out, s = ep.module()(x, x, torch.ones(48), x)
    assert out.shape == x.shape and torch.equal(s, x + x)
