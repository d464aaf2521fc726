"""A Llama-3-sized vocabulary (128,256 tokens) on a tiny-width base with an EAGLE-3 draft whose
vocabulary is 32,000 of them (d2t): greedy and sampled decoding run, greedy == HF greedy."""
import functools

import pytest
import torch

import eagle_fx
from eagle_fx.drafts import new_draft

VOCAB, DRAFT_VOCAB = 128256, 32000


@functools.lru_cache(maxsize=None)
def _pair():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.3,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    draft = new_draft(base, "eagle3", seed=1, draft_vocab_size=DRAFT_VOCAB)
    # the draft's tokens: a spread-out subset of the target vocabulary, as a real d2t maps them
    targets = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:DRAFT_VOCAB].sort().values
    draft.d2t.copy_(targets - torch.arange(DRAFT_VOCAB))
    return base, draft


@pytest.mark.heavy
def test_128k_vocab_with_a_32k_draft_vocab_equals_hf():
    base, draft = _pair()
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, max_batch_size=2, max_seq_len=96)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 30)]
    out = model.generate(prompts, max_new_tokens=16, eos_token_id=None)
    refs = []
    for p in prompts:
        with torch.no_grad():
            refs.append(base.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(p):].tolist())
    assert out.sequences == refs
    assert max(t for s in out.sequences for t in s) >= DRAFT_VOCAB  # ids past the draft vocabulary's size
    # the draft proposes target ids through d2t, spread over the whole vocabulary
    targets = model.spec.to_target(torch.arange(DRAFT_VOCAB))
    assert torch.equal(targets, torch.arange(DRAFT_VOCAB) + draft.d2t) and int(targets.max()) > 4 * DRAFT_VOCAB
    sampled = model.generate(prompts, max_new_tokens=8, temperature=0.8, seed=0)
    assert all(len(s) == 8 and max(s) < VOCAB for s in sampled.sequences) and sampled.stats.num_draft_tokens > 0
