"""Paged pool bookkeeping, chunked prefill and prefix caching: outputs == HF, hits and KV as designed."""
import pytest
import torch

import eagle_fx
from conftest import hf_greedy, make_prompts, tiny_base, tiny_draft
from eagle_fx.runtime.kv_cache import BlockAllocator, PoolExhausted, block_hashes


def test_allocator_refcounts_and_lru_eviction():
    a = BlockAllocator(4, block_size=2)
    x = a.allocate(2)
    for i, (b, h) in enumerate(zip(x, block_hashes([1, 2, 3, 4], 2))):
        assert a.register(b, h, [1, 2, 3, 4][2 * i:2 * i + 2])
    a.release(x)
    assert a.num_free == 4 and a.num_cached == 2
    assert a.match([1, 2, 3, 4, 5, 6], 3) == x  # the chain [1,2],[3,4] is found
    assert a.match([9, 9], 1) == []
    a.release(x)
    assert not a.register(3, block_hashes([1, 2], 2)[0], (1, 2))  # that hash is held by another block
    y = a.allocate(3)  # 2 never-used blocks, then the least recently released cached one
    assert x[0] in y and x[1] not in y and a.num_cached == 1
    with pytest.raises(PoolExhausted, match="KV pool exhausted: 2 blocks wanted, 1 of 4 free; raise num_blocks"):
        a.allocate(2)
    with pytest.raises(RuntimeError, match="released more often than it was taken"):
        a.release([x[1]])
    assert block_hashes([1, 2, 3], 2) == block_hashes([1, 2, 7], 2) != block_hashes([1, 3, 3], 2)


def test_a_hash_hit_is_confirmed_token_by_token():
    a = BlockAllocator(2, block_size=2)
    b = a.allocate(1)
    a.register(b[0], block_hashes([5, 6], 2)[0], (7, 8))  # pretend a hash collision
    a.release(b)
    assert a.match([5, 6, 1], 1) == []


def _model(method="eagle", **kw):
    return eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", method), num_spec_tokens=3, **kw)


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_chunked_prefill_kv_bit_identical(method, shift):
    prompt = make_prompts(1, seed=11, lengths=(37,))
    model = _model(method, prefill_shift=shift, batch_invariant=True, max_batch_size=1, max_seq_len=64)
    ref = model.replace(prefill_chunk_size=None)
    ref_out = ref.generate(prompt, max_new_tokens=1).sequences
    for chunk in (1, 7, 16, 37):
        m = model.replace(prefill_chunk_size=chunk)
        out = m.generate(prompt, max_new_tokens=1).sequences
        assert out == ref_out
        assert torch.equal(m.kv_cache.draft_pool, ref.kv_cache.draft_pool), f"draft KV differs at chunk {chunk}"
        assert torch.equal(m.kv_cache.base_pool, ref.kv_cache.base_pool)
    assert ref.kv_cache.draft_pool.abs().sum() > 0


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("chunk", [None, 5])
def test_chunked_generate_matches_hf(shift, chunk):
    prompts = make_prompts(3, seed=2, lengths=(23, 9, 14))
    model = _model("eagle3", prefill_shift=shift, prefill_chunk_size=chunk)
    assert model.generate(prompts, max_new_tokens=16).sequences == hf_greedy("llama", prompts, 16)


def _turns():
    turn1 = make_prompts(1, seed=21, lengths=(40,))[0]
    answer = hf_greedy("llama", [turn1], 20)[0]
    turn2 = turn1 + answer + make_prompts(1, seed=22, lengths=(9,))[0]
    return turn1, turn2


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_multiturn_prefix_hits(method):
    turn1, turn2 = _turns()
    hits = {}
    for shift in (False, True):
        model = _model(method, prefill_shift=shift, prefix_caching=True, block_size=8, prefill_chunk_size=6)
        assert model.generate([turn1], max_new_tokens=20).sequences == hf_greedy("llama", [turn1], 20)
        out = model.generate([turn2], max_new_tokens=12)
        assert out.sequences == hf_greedy("llama", [turn2], 12)
        st = out.stats
        assert st.prefix_hit_tokens_base + st.prefill_tokens_computed_base == len(turn2)
        hits[shift] = (st.prefix_hit_tokens_base, st.prefix_hit_tokens_draft)
    # unshifted: turn 1 + its answer (60 tokens) are 7 full blocks of 8, all reused by base and draft
    assert hits[False] == (56, 56)
    # shifted: the last matched block's draft slot depends on the next token, so it is recomputed
    assert hits[True][1] < hits[False][1] and hits[True][1] == 48


def test_unshifted_draft_recomputes_none_of_a_cached_prompt():
    prompt = make_prompts(1, seed=4, lengths=(33,))[0]
    model = _model(prefix_caching=True, block_size=8)
    model.generate([prompt], max_new_tokens=4)
    st = model.generate([prompt], max_new_tokens=4).stats
    assert st.prefix_hit_tokens_draft == 32 and st.prefill_tokens_computed_draft == 1


def test_eviction_under_a_tiny_pool_keeps_outputs_right():
    prompts = make_prompts(6, seed=9, lengths=(20, 27, 20, 13))
    model = _model(prefix_caching=True, block_size=4, max_batch_size=1, max_seq_len=48, num_blocks=12)
    for p in prompts + prompts[:2]:
        assert model.generate([p], max_new_tokens=12).sequences == hf_greedy("llama", [p], 12)
        assert model.kv_cache.allocator.num_free == 12  # everything released; cached blocks stay evictable
    assert 0 < model.kv_cache.allocator.num_cached <= 12


def test_pool_too_small_for_one_request():
    model = _model(prefix_caching=True, block_size=4, max_batch_size=1, max_seq_len=48, num_blocks=12)
    with pytest.raises(PoolExhausted, match="one request needs 13 blocks but the KV pool has 12"):
        model.generate([list(range(1, 40))], max_new_tokens=9)
    assert model.generate([[1, 2, 3]], max_new_tokens=4).sequences == hf_greedy("llama", [[1, 2, 3]], 4)


def test_bootstrap_feature_changes_draft_kv_not_output():
    prompts = make_prompts(2, seed=6)
    zero = _model(max_batch_size=2, max_seq_len=64)
    other = zero.replace(bootstrap=torch.full((64,), 0.5))
    a, b = zero.generate(prompts, max_new_tokens=8), other.generate(prompts, max_new_tokens=8)
    assert a.sequences == b.sequences == hf_greedy("llama", prompts, 8)
    assert not torch.equal(zero.kv_cache.draft_pool, other.kv_cache.draft_pool)
