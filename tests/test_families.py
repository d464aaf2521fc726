"""Hugging Face families beyond Llama's: a fresh draft, compile and generate == HF greedy; and the
families eagle_fx refuses, refused at compile with the reason."""
import pytest
import torch

import eagle_fx
from conftest import FAMILIES, FAMILY, hf_greedy, make_prompts, tiny_base, tiny_draft
from eagle_fx.families import kv_shape
from test_runtime import CopyReference

MAX_NEW = 20


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_generates_hf_greedy(arch):
    """Chunked prefill over a batch of 3, the draft's own proposals, then every proposal forced
    right and every 4th wrong (multi-token verifies): all == HF greedy."""
    prompts = make_prompts(3, seed=5, lengths=(7, 12, 3))
    refs = hf_greedy(arch, prompts, MAX_NEW)
    assert len({t for r in refs for t in r}) > 5  # not a one-token text: the oracle can tell positions apart
    model = eagle_fx.compile(tiny_base(arch), tiny_draft(arch, "eagle"), num_spec_tokens=3, prefill_chunk_size=5)
    assert model.generate(prompts, max_new_tokens=MAX_NEW).sequences == refs
    forced = model.replace(forced_drafts=CopyReference(prompts, refs, every=4))
    out = forced.generate(prompts, max_new_tokens=MAX_NEW)
    assert out.sequences == refs
    assert 0 < out.stats.num_accepted_tokens < out.stats.num_draft_tokens


@pytest.mark.parametrize("arch,heads", [("falcon", (1, 16)), ("falcon_new", (4, 16)), ("gpt2", (4, 16)),
                                        ("opt", (4, 16)), ("llama", (2, 16))])
def test_kv_shape_is_the_shape_of_the_cached_keys(arch, heads):
    """Read from the config as the model's K/V tensors are shaped (classic Falcon: multi-query; new
    Falcon: K/V broadcast to every head before the cache)."""
    base = tiny_base(arch)
    assert kv_shape(base.config) == heads
    with torch.no_grad():
        past = base(torch.tensor([[3, 4, 5]]), use_cache=True).past_key_values
    assert tuple(past.layers[0].keys.shape[1::2]) == heads


def _refused(config, match):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    from eagle_fx.drafts import new_draft

    draft = new_draft(base, seed=0)
    with pytest.raises(ValueError, match=match):
        eagle_fx.compile(base, draft)


def test_alibi_bases_are_refused_by_name():
    from transformers import BloomConfig, FalconConfig

    _refused(FalconConfig(**FAMILY, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                          multi_query=False), r"falcon\) adds an ALiBi position bias")
    _refused(BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4), r"bloom\) adds an ALiBi")


def test_soft_capped_gemma2_is_refused_by_name():
    from transformers import Gemma2Config

    config = Gemma2Config(**FAMILY, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=8)
    _refused(config, r"gemma2\) soft-caps its attention logits \(attn_logit_softcapping=50.0\)")
