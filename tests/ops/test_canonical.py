"""The torch reference of eagle_fx::cached_attention: the one-call path for sequences with equal
query counts == attending each sequence on its own (the per-sequence path)."""
import pytest
import torch

from eagle_fx.ops.canonical import attention_limits, cached_attention_ref
from tests.ops.paged_case import paged_layout


def _case(lens_before, per_seq, heads=4, kvh=2, d=8, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool, block_table, slots, pos, qsl, total = paged_layout(lens_before, per_seq, kvh, d, block_size, 6, g)
    q, k, v = (torch.randn(1, h, total, d, generator=g) for h in (heads, kvh, kvh))
    return q, k, v, pool, slots, block_table, qsl, pos


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


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash", "explicit-softmax"])
@pytest.mark.parametrize("window", [0, 7, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys_per_chunk", [1, 2])
def test_tiled_long_context_path_equals_the_masked_formula(window, dtype, fused, keys_per_chunk):
    """A prefill chunk whose scores would exceed SCORE_LIMIT is attended in query tiles x key chunks
    merged by their log-sum-exp, reading only the blocks a chunk needs: == one masked softmax over
    all of the sequence's keys. Tiles are forced small here (4 query rows, chunks of 1 or 2 keys,
    blocks of 3, so chunks cross block boundaries), with GQA, windows (2: rows that see no key of
    their tile's first chunks, or of its last ones) and a prefill chunk that starts mid-sequence; through
    the CPU's flash kernel and through the explicit softmax other devices use."""
    from eagle_fx.ops import canonical

    g = torch.Generator().manual_seed(1)
    heads, kvh, d, block_size, before, n = 4, 2, 8, 3, 9, 8
    pool = torch.randn(2, 2, 9, block_size, kvh, d, generator=g).to(dtype)
    block_table = torch.tensor([[5, 0, 7, 2, 6, 8, 1]])
    pos = torch.arange(before, before + n)
    slots = block_table[0, pos // block_size] * block_size + pos % block_size
    q, k, v = (torch.randn(1, h, n, d, generator=g).to(dtype) for h in (heads, kvh, kvh))
    # heads x rows x keys per chunk
    with attention_limits(query_tile=4, score_limit=4 * 4 * keys_per_chunk, fused_chunk_kernel=fused):
        out = cached_attention_ref(q, k, v, pool, 1, slots, block_table, torch.tensor([0, n]), pos[None], 0.3, window)
    keys = pool[1][:, block_table[0]].flatten(1, 2)[:, :before + n].transpose(1, 2).float()  # [2, kvh, S, d]
    mask = canonical.visible_keys(pos, before + n, window)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), keys[0][None], keys[1][None], attn_mask=mask,
                                                            scale=0.3, enable_gqa=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


def _kv_sharing_case(seed: int, pool_layers: int, first_query: int):
    """One sequence of a KV-sharing draft: 10 committed tokens in base-pool blocks [3, 1, 4, 0], a
    ring of 6 speculated slots, 5 query rows at first_query..first_query+4 (4 heads, 2 kv heads of 8)."""
    g = torch.Generator().manual_seed(seed)
    heads, kvh, d, block_size, ring = 4, 2, 8, 4, 6
    pool = torch.randn(pool_layers, 2, 6, block_size, kvh, d, generator=g)
    spec_kv = torch.randn(2, 2, ring, kvh, d, generator=g)
    table, committed, n = torch.tensor([[3, 1, 4, 0]]), 10, 5
    pos = torch.arange(first_query, first_query + n)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h in (heads, kvh, kvh))
    return q, k, v, pool, spec_kv, table, committed, n, pos


def test_tiled_path_of_a_kv_sharing_draft_reads_base_then_ring():
    """shared_cached_attention's ragged path in tiles: committed keys from the base pool's blocks,
    later ones from the ring, == the masked formula over the two concatenated."""
    from eagle_fx.ops import canonical

    q, k, v, pool, spec_kv, block_table, committed, n, pos = _kv_sharing_case(2, 3, 9)  # 4 queries past committed
    ring = spec_kv.shape[2]
    ring_after = spec_kv.clone()
    with attention_limits(query_tile=2, score_limit=4 * 2 * 3):
        out = canonical.shared_cached_attention_ref(q, k, v, pool, 2, ring_after, torch.tensor([1]),
                                                    torch.tensor([committed]), block_table, torch.tensor([0, n]),
                                                    pos[None], 0.3, 0)
    base = pool[2][:, block_table[0]].flatten(1, 2)[:, :committed]
    tail = ring_after[:, 1, torch.arange(committed, committed + n - 1) % ring]
    keys = torch.cat([base, tail], dim=1).transpose(1, 2)
    mask = canonical.visible_keys(pos, keys.shape[2], 0)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys[0][None], keys[1][None], attn_mask=mask, scale=0.3,
                                                            enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def _largest_allocation(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


def test_chunked_prefill_attention_memory_does_not_grow_with_the_context():
    """A prefill chunk over 4x the cached keys allocates no larger buffer: the tiled path reads the
    blocks of one key chunk at a time and keeps heads grouped (no GQA copy of the keys), so its
    transient memory is set by SCORE_LIMIT, not by the context. The whole-sequence read it
    replaced allocated the sequence's K and V."""
    heads, kvh, d, block_size, n = 4, 2, 16, 16, 32

    def largest(context):
        g = torch.Generator().manual_seed(0)
        blocks = context // block_size
        pool = torch.randn(1, 2, blocks, block_size, kvh, d, generator=g)
        table = torch.randperm(blocks, generator=g)[None]
        pos = torch.arange(context - n, context)
        slots = table[0, pos // block_size] * block_size + pos % block_size
        q, k, v = (torch.randn(1, h, n, d, generator=g) for h in (heads, kvh, kvh))
        whole_kv = 2 * context * kvh * d * 4
        return whole_kv, _largest_allocation(lambda: cached_attention_ref(q, k, v, pool, 0, slots, table,
                                                                           torch.tensor([0, n]), pos[None], 0.25, 0))

    with attention_limits(score_limit=1 << 14):
        kv_short, short = largest(1024)
        kv_long, long = largest(4096)
    assert long == short  # bounded by the tiles
    assert long < kv_long / 8  # and far below the sequence's own K/V


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash", "explicit-softmax"])
@pytest.mark.parametrize("window", [0, 5, 2])
@pytest.mark.parametrize("lens_before,per_seq", [([3, 10, 0], 1), ([7, 2], 4), ([13, 1], 3)])
def test_device_side_attention_in_key_chunks_equals_one_read(lens_before, per_seq, window, fused):
    """The device-side (uniform) attention of a long context, not compiled, reads the block table in
    key chunks (here 1 block of 4 keys each) merged by log-sum-exp: == reading every sequence's
    whole table at once, for batches, GQA, windows (2: rows with no visible key in a chunk), and
    returns q's layout."""
    q, k, v, pool, slots, bt, qsl, pos = _case(lens_before, per_seq)
    pool_once = pool.clone()
    once = cached_attention_ref(q, k, v, pool_once, 1, slots, bt, qsl, pos, 0.3, window, uniform_queries=True)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a projection's layout: [1, T, H, D] seen as [1, H, T, D]
    one_block = 2 * len(lens_before) * 4 * 2 * 8  # K/V elements of one table column
    with attention_limits(kv_read_limit=one_block, fused_chunk_kernel=fused):
        chunked = cached_attention_ref(q, k, v, pool, 1, slots, bt, qsl, pos, 0.3, window, uniform_queries=True)
    torch.testing.assert_close(chunked, once, rtol=1e-5, atol=1e-5)
    assert chunked.stride() == q.stride()  # the fake kernel's promise (empty_like(q)): compiled graphs assert it
    torch.testing.assert_close(pool, pool_once)


def test_device_side_attention_memory_does_not_grow_with_the_context():
    """A decode step's attention over 4x the cached keys allocates no larger buffer (not compiled:
    key chunks of KV_READ_LIMIT elements), and far less than the sequence's K/V."""
    heads, kvh, d, block_size = 4, 2, 16, 16

    def largest(context):
        g = torch.Generator().manual_seed(0)
        blocks = context // block_size
        pool = torch.randn(1, 2, blocks, block_size, kvh, d, generator=g)
        table = torch.randperm(blocks, generator=g)[None]
        pos = torch.tensor([context - 1])
        slots = table[0, pos // block_size] * block_size + pos % block_size
        q, k, v = (torch.randn(1, h, 1, d, generator=g) for h in (heads, kvh, kvh))
        return _largest_allocation(lambda: cached_attention_ref(q, k, v, pool, 0, slots, table, torch.tensor([0, 1]),
                                                                pos[None], 0.25, 0, uniform_queries=True))

    from eagle_fx.ops.limits import attention_limits_now

    short_context = 2 * attention_limits_now().kv_read_limit // (2 * kvh * d)  # twice the keys one read may hold
    short, long = largest(short_context), largest(4 * short_context)
    assert long == short
    assert long < 2 * (4 * short_context) * kvh * d * 4 / 4


def test_compiled_layers_write_the_pool_in_place():
    """Several layers' device-side attention compiled into one graph (as in a cycle) write the KV
    pool in place: inductor's code has no loop over the whole pool (an index_put_ into a view of
    the pool made it copy the pool in and out on every call: two loops of pool.numel()), and the
    result and the pool are the eager ones."""
    import re

    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(0)
    layers, heads, kvh, d, block_size, blocks = 3, 4, 2, 8, 4, 512
    pool = torch.randn(layers, 2, blocks, block_size, kvh, d, generator=g)
    table = torch.tensor([[7, 3, 9, 1]])
    pos = torch.tensor([[13]])
    slots = table[0, pos[0] // block_size] * block_size + pos[0] % block_size
    q, k, v = (torch.randn(1, h, 1, d, generator=g) for h in (heads, kvh, kvh))

    def step(q, k, v, pool, slots, table, pos):
        out = q
        for layer in range(layers):
            out = cached_attention_ref(out, k, v, pool, layer, slots, table, torch.tensor([0, 1]), pos, 0.3, 0,
                                       uniform_queries=True)
        return out

    eager_pool = pool.clone()
    want = step(q, k, v, eager_pool, slots, table, pos)
    with torch.no_grad():
        got, code = run_and_get_code(torch.compile(step, fullgraph=True, backend="inductor"), q, k, v, pool, slots,
                                     table, pos)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(pool, eager_pool)
    loop_bounds = [int(b) for b in re.findall(r"x\d+<static_cast<int64_t>\((\d+)L\)", "".join(code))]
    assert loop_bounds and max(loop_bounds) < pool.numel() // 8


def test_batch_invariant_shared_attention_attends_row_by_row():
    """shared_cached_attention(batch_invariant=True) (a KV-sharing draft under batch_invariant):
    each row's result is bit-identical to that row attended alone (rows called one at a time, in
    order, so the ring holds the same speculated K/V), and close to the batched result."""
    from eagle_fx.ops.canonical import shared_cached_attention_ref

    q, k, v, pool, spec_kv, table, committed, n, pos = _kv_sharing_case(3, 2, 8)  # 3 queries past committed

    def call(rows, ring_kv, **flags):
        return shared_cached_attention_ref(q[:, :, rows], k[:, :, rows], v[:, :, rows], pool, 1, ring_kv,
                                           torch.tensor([1]), torch.tensor([committed]), table,
                                           torch.tensor([0, rows.stop - rows.start]), pos[None, rows], 0.3, 0, **flags)

    together_ring, alone_ring, batched_ring = spec_kv.clone(), spec_kv.clone(), spec_kv.clone()
    together = call(slice(0, n), together_ring, batch_invariant=True)
    alone = torch.cat([call(slice(i, i + 1), alone_ring, batch_invariant=True) for i in range(n)], dim=2)
    assert torch.equal(together, alone)
    torch.testing.assert_close(together_ring, alone_ring)
    torch.testing.assert_close(together, call(slice(0, n), batched_ring), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 3])
def test_tree_and_shared_device_side_attention_in_key_chunks_equal_one_read(window):
    """The tree attention and a KV-sharing draft's device-side attention read long tables in key
    chunks too (one block each here): == reading the whole table at once, ring and pool as after."""
    from eagle_fx.ops.canonical import shared_cached_attention_ref, tree_cached_attention_ref

    one_block = 2 * 2 * 4 * 2 * 8  # K/V elements of one table column: 2 sequences, blocks of 4, 2 kv heads of 8
    # a tree of 3 nodes (a root and its two children) per sequence, from logical slot tree_start
    q, k, v, pool, _, bt, qsl, _ = _case([5, 9], 3)
    tree_start, depth = torch.tensor([5, 9]), torch.tensor([0, 1, 1])
    pos = (tree_start[:, None] + depth).reshape(1, -1)
    logical = (tree_start[:, None] + torch.arange(3)).reshape(-1)
    slots = bt[torch.arange(2).repeat_interleave(3), logical // 4] * 4 + logical % 4
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).repeat(2, 1)
    args = (slots, bt, qsl, pos, mask, tree_start, 0.3, window)
    pool_once = pool.clone()
    once = tree_cached_attention_ref(q, k, v, pool_once, 1, *args)
    with attention_limits(kv_read_limit=one_block):
        chunked = tree_cached_attention_ref(q, k, v, pool, 1, *args)
    torch.testing.assert_close(chunked, once, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, pool_once)
    # a KV-sharing draft: committed keys from layer 0 of the pool, the last row of each sequence in the ring
    q, k, v, pool, _, bt, qsl, pos = _case([6, 11], 2)
    ring, committed = torch.randn(2, 3, 4, 2, 8, generator=torch.Generator().manual_seed(5)), torch.tensor([7, 12])
    args = (pool, 0, torch.tensor([2, 0]), committed, bt, qsl, pos, 0.3, window)
    ring_once = ring.clone()
    once = shared_cached_attention_ref(q, k, v, *args[:2], ring_once, *args[2:], uniform_queries=True)
    with attention_limits(kv_read_limit=one_block):
        chunked = shared_cached_attention_ref(q, k, v, *args[:2], ring, *args[2:], uniform_queries=True)
    torch.testing.assert_close(chunked, once, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ring, ring_once)
