import copy

import pytest
import torch

import eagle_fx
from conftest import hf_greedy, make_prompts, tiny_base, tiny_draft
from eagle_fx.runtime.kv_cache import new_kv_pool
from eagle_fx.capture import capture
from eagle_fx.passes import PassContext, alias_draft_kv
from tests.passes.snapshot import op_counts


def _placeholders(gm):
    return [n.target for n in gm.graph.nodes if n.op == "placeholder"]


def _layers(gm):
    return [n.args[4] for n in gm.graph.nodes if n.target == torch.ops.eagle_fx.cached_attention.default]


def test_counts_numerics_idempotent():
    base, draft = tiny_base("llama"), tiny_draft("llama", "eagle")
    gm = copy.deepcopy(capture(base, draft).draft_step)  # not aliased yet
    before = copy.deepcopy(gm)
    assert "draft_kv_pool" in _placeholders(gm) and "kv_pool" not in _placeholders(gm) and _layers(gm) == [0]
    res = alias_draft_kv.run(gm, PassContext(shared_pool_layer=4))
    assert res.num_matches == 1
    assert "draft_kv_pool" not in _placeholders(res.gm) and "kv_pool" in _placeholders(res.gm)
    assert _layers(res.gm) == [4]
    assert op_counts(res.gm)["placeholder"] == op_counts(before)["placeholder"]

    T = 5
    kw = dict(input_ids=torch.randint(0, 96, (1, T)), positions=torch.arange(T)[None], features=torch.randn(T, 64),
              logits_indices=torch.tensor([T - 1]), next_tokens=torch.zeros(1, dtype=torch.long),
              slot_mapping=torch.arange(T), block_table=torch.tensor([[0, 1]]), query_start_loc=torch.tensor([0, T]))
    own = new_kv_pool(1, 2, 4, 2, 16, torch.float32, "cpu")
    shared = new_kv_pool(5, 2, 4, 2, 16, torch.float32, "cpu")
    ref = before(**kw, draft_kv_pool=own)
    got = res.gm(**kw, kv_pool=shared)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(shared[4], own[0]) and shared[:4].abs().sum() == 0  # the draft wrote layer 4 only
    assert alias_draft_kv.run(res.gm, PassContext(shared_pool_layer=4)).num_matches == 0  # idempotent


def test_one_pool_for_base_and_draft_by_default():
    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle3"), max_batch_size=2, max_seq_len=64)
    assert model.kv_cache.kv_mode == "pool" and model.kv_cache.draft_pool is model.kv_cache.base_pool
    L = tiny_base("llama").config.num_hidden_layers
    assert model.kv_cache.base_pool.shape[0] == L + 1 and model.kv_cache.draft_layer == L
    per_block = model.kv_cache.base_pool[0].numel() * model.kv_cache.base_pool.element_size()
    assert model.kv_cache.base_pool.numel() * model.kv_cache.base_pool.element_size() == (L + 1) * per_block  # one allocation
    prompts = make_prompts(2)
    assert model.generate(prompts, max_new_tokens=12).sequences == hf_greedy("llama", prompts, 12)
    assert model.draft_kv.abs().sum() > 0


@pytest.mark.parametrize("kw", [dict(prefill_shift=True), dict(kv_share=None)])
def test_own_pool_when_shifted_or_asked(kw):
    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), max_batch_size=2, max_seq_len=64, **kw)
    assert model.kv_cache.kv_mode == "own" and model.kv_cache.draft_pool is not model.kv_cache.base_pool
    assert model.kv_cache.base_pool.shape[0] == 4 and model.kv_cache.draft_pool.shape[0] == 1


def test_own_pool_when_kv_shapes_differ():
    from eagle_fx.drafts import new_draft

    base = tiny_base("qwen2")
    draft = new_draft(base, "eagle", seed=3, num_key_value_heads=4)  # base has 2 kv heads
    model = eagle_fx.compile(base, draft, max_batch_size=1, max_seq_len=64)
    assert model.kv_cache.kv_mode == "own"
    prompts = make_prompts(1)
    assert model.generate(prompts, max_new_tokens=8).sequences == hf_greedy("qwen2", prompts, 8)


def test_bad_kv_share_value():
    with pytest.raises(ValueError, match="kv_share must be 'auto', 'pool', None or a base layer index"):
        eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), kv_share="everything")


def test_layer_alias_keeps_batch_invariant():
    """kv_share=LAYER with batch_invariant=True: the shared attention still attends row by row (the
    flag was dropped when the pass rebuilt the call from its first eleven positional arguments)."""
    from eagle_fx.passes import batch_invariant
    from eagle_fx.passes.fx_graph import op_arguments

    gm = copy.deepcopy(capture(tiny_base("llama"), tiny_draft("llama", "eagle")).draft_prefill)  # not aliased
    gm = batch_invariant.run(gm).gm
    res = alias_draft_kv.run(gm, PassContext(kv_share_layer=1, all_rows_committed=True))
    shared = [n for n in res.gm.graph.nodes if n.target == torch.ops.eagle_fx.shared_cached_attention.default]
    assert res.num_matches == len(shared) == 1
    assert op_arguments(shared[0])["batch_invariant"] is True
