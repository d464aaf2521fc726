"""kv_share=LAYER: a draft that reads a base layer's K/V.

Oracles: HF greedy for the output; the training-time attention (eagle_fx.train.unroll with the
base's own K/V from HF's cache) for every draft hidden state the runtime computes; byte formulas
for the pools; each refusal with its message."""
import pytest
import torch

import eagle_fx
from conftest import hf_greedy, make_prompts, tiny_base
from eagle_fx.drafts import new_draft
from eagle_fx.train import base_features, unroll
from test_runtime import CopyReference

MAX_NEW = 20


def sharing_draft(arch, method="eagle", layer=-1, seed=11):
    return new_draft(tiny_base(arch), method, seed=seed, kv_share=layer)


@pytest.mark.parametrize("arch,method,layer", [("llama", "eagle", -1), ("qwen3", "eagle3", 1), ("gemma3", "eagle", 3),
                                               ("mistral_swa", "eagle3", 0)])
def test_greedy_matches_hf(arch, method, layer):
    model = eagle_fx.compile(tiny_base(arch), sharing_draft(arch, method, layer), max_batch_size=3, max_seq_len=128)
    assert model.kv_cache.kv_mode == "layer" and model.kv_cache.draft_layer == layer % 4
    prompts = make_prompts(3)
    out = model.generate(prompts, max_new_tokens=MAX_NEW)
    assert out.sequences == hf_greedy(arch, prompts, MAX_NEW)
    chunked = model.replace(prefill_chunk_size=4, prefix_caching=True, max_batch_size=2)
    long = make_prompts(2, seed=4, lengths=(20, 18))
    twice = long + [p + [5, 6] for p in long]  # wave 2 starts with wave 1's first block
    out = chunked.generate(twice, max_new_tokens=MAX_NEW)
    assert out.sequences == hf_greedy(arch, twice, MAX_NEW)
    assert out.stats.prefix_hit_tokens_draft > 0  # the sharing draft's cached prefix is the base's


class Recorder:
    """Wraps a model's step-graph calls and keeps every draft call's inputs and hidden output."""

    def __init__(self, model):
        self.calls = []
        model.executor.add_observer(self)

    def __call__(self, name, inputs, out):
        if name in ("draft_extend", "draft_step"):
            last = inputs["query_start_loc"][1:] - 1
            self.calls.append((inputs["spec_rows"].tolist(), inputs["committed_len"].tolist(),
                               inputs["positions"][0, last].tolist(), out[1].clone()))


@pytest.mark.parametrize("method,k,every", [("eagle", 3, 0), ("eagle3", 4, 0), ("eagle", 3, 3)])
def test_draft_states_match_training_attention(method, k, every):
    """Every draft hidden state at inference (bonus rows after any acceptance, chained steps)
    equals the training-time computation over the same tokens: base K/V for committed positions,
    the draft's own for speculated ones."""
    arch = "llama"
    base, draft = tiny_base(arch), sharing_draft(arch, method)
    prompts = make_prompts(3)
    refs = hf_greedy(arch, prompts, MAX_NEW)
    model = eagle_fx.compile(base, draft, num_spec_tokens=k, max_batch_size=3, max_seq_len=128).replace(
        forced_drafts=CopyReference(prompts, refs, every))
    rec = Recorder(model)
    assert model.generate(prompts, max_new_tokens=MAX_NEW).sequences == refs

    checked = 0
    with torch.no_grad():
        for s, (p, r) in enumerate(zip(prompts, refs)):
            ids = torch.tensor([p + r])
            feats, _, base_kv = base_features(base, draft, ids)
            outs = dict(unroll(draft, ids, draft.project(feats[:, :-1]), base_kv, steps=k))
            for rows, committed, positions, hidden in rec.calls:
                if s not in rows:
                    continue
                i = rows.index(s)
                m, j = committed[i], positions[i] - committed[i]
                if every and j > 0:
                    continue  # after a forced wrong proposal the chain holds tokens the reference lacks
                if m - 1 >= outs[j].shape[1]:
                    continue
                torch.testing.assert_close(hidden[i], outs[j][0, m - 1], rtol=1e-4, atol=1e-5)
                checked += 1
    assert checked >= 10


def test_kv_bytes():
    arch = "llama"
    base = tiny_base(arch)
    L, kvh, d, elt = 4, 2, 16, 4
    kw = dict(num_spec_tokens=3, max_batch_size=2, max_seq_len=64, block_size=16)
    shared = eagle_fx.compile(base, sharing_draft(arch), **kw)
    pooled = eagle_fx.compile(base, new_draft(base, "eagle", seed=1), **kw)
    nb, bs = shared.kv_cache.allocator.num_blocks, 16
    per_layer = 2 * nb * bs * kvh * d * elt
    assert shared.kv_bytes() == {"base": L * per_layer, "draft": 2 * 2 * 3 * kvh * d * elt, "draft_per_token": 0}
    assert pooled.kv_bytes() == {"base": L * per_layer, "draft": per_layer, "draft_per_token": 2 * kvh * d * elt}
    assert shared.kv_cache.base_pool.shape[0] == L and pooled.kv_cache.base_pool.shape[0] == L + 1


def test_auto_follows_the_draft_and_pool_opts_out():
    base = tiny_base("llama")
    draft = sharing_draft("llama", layer=2)
    assert eagle_fx.compile(base, draft, max_batch_size=1, max_seq_len=64).kv_cache.kv_mode == "layer"
    assert eagle_fx.compile(base, draft, max_batch_size=1, max_seq_len=64, kv_share="pool").kv_cache.kv_mode == "pool"
    plain = new_draft(base, "eagle", seed=1)
    assert eagle_fx.compile(base, plain, max_batch_size=1, max_seq_len=64).kv_cache.kv_mode == "pool"


def test_errors():
    base = tiny_base("llama")
    draft = sharing_draft("llama")
    with pytest.raises(ValueError, match="needs the unshifted draft prefill"):
        eagle_fx.compile(base, draft, prefill_shift=True)
    with pytest.raises(ValueError, match=r"the base has 4 layers; use a layer index in \[-4, 3\]"):
        eagle_fx.compile(base, draft, kv_share=4)
    with pytest.raises(ValueError, match="kv_share must be 'auto', 'pool', None or a base layer index"):
        eagle_fx.compile(base, draft, kv_share=True)
    wide = new_draft(base, "eagle", seed=1, num_key_value_heads=4)
    with pytest.raises(ValueError, match="the draft has 4 kv heads x head dim 16, base layer 3 has 2 x 16"):
        eagle_fx.compile(base, wide, kv_share=-1)
    rope = new_draft(base, "eagle", seed=1, rope_theta=5000.0)
    with pytest.raises(ValueError, match="RoPE mismatch"):
        eagle_fx.compile(base, rope, kv_share=-1)
    gemma = tiny_base("gemma3")  # layers alternate sliding (theta 1e4) and full (theta 1e6) attention
    with pytest.raises(ValueError, match="RoPE mismatch"):
        eagle_fx.compile(gemma, new_draft(gemma, "eagle", seed=1, kv_share=0), kv_share=1)
    # still usable after the refusals
    prompts = make_prompts(1)
    assert eagle_fx.compile(base, draft, max_seq_len=64).generate(prompts, max_new_tokens=6).sequences == \
        hf_greedy("llama", prompts, 6)
