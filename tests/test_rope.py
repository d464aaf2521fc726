"""RoPE variants (eagle_fx.rope_support): equal to HF greedy past original_max_position_embeddings,
or refused at compile by name with what to do."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import eagle_fx
from eagle_fx.drafts import new_draft

ORIGINAL = 24  # original_max_position_embeddings: prompts and generations run well past it
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": ORIGINAL},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


def _base(rope: str):
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.3,
                         max_position_embeddings=ORIGINAL if rope == "dynamic" else 8 * ORIGINAL,
                         rope_parameters={**ROPES[rope], "rope_theta": 10000.0})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _hf(base, prompt, n):
    with torch.no_grad():
        out = base.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("rope", ["linear", "llama3", "yarn"])
def test_fixed_ropes_equal_hf_past_the_original_length(rope):
    """A prompt within the original length that generates past it, and one longer than it,
    batched, prefilled in chunks; then one sequence alone."""
    base = _base(rope)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (10, 2 * ORIGINAL)]
    model = eagle_fx.compile(base, new_draft(base, seed=0), max_seq_len=4 * ORIGINAL, prefill_chunk_size=16)
    refs = [_hf(base, p, 2 * ORIGINAL) for p in prompts]
    assert model.generate(prompts, max_new_tokens=2 * ORIGINAL, eos_token_id=None).sequences == refs
    # the oracle can tell rotations apart: the same prompts under plain RoPE continue otherwise
    plain = _base("linear")
    plain.model.rotary_emb.inv_freq.mul_(4.0)  # linear's factor undone: default RoPE
    assert [_hf(plain, p, 2 * ORIGINAL) for p in prompts] != refs


def test_longrope_equals_hf_while_every_position_stays_short_and_is_refused_past_it():
    """k = 3: a step computes positions up to max_seq_len - 1 + 4 (+ 1 in the draft extend)."""
    base = _base("longrope")
    draft = new_draft(base, seed=0)
    longest = ORIGINAL - 3 - 2
    with pytest.raises(ValueError, match=rf"max_seq_len=2048: .*'longrope'.*\({ORIGINAL}\).*max_seq_len <= {longest}"):
        eagle_fx.compile(base, draft)
    model = eagle_fx.compile(base, draft, max_seq_len=longest)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 11)]
    new = longest - 11  # the longer sequence ends at max_seq_len
    assert model.generate(prompts, max_new_tokens=new, eos_token_id=None).sequences == [_hf(base, p, new) for p in prompts]
    with pytest.raises(ValueError, match=f"max_seq_len <= {longest}"):
        model.replace(max_seq_len=longest + 1)
    assert model.replace(num_spec_tokens=1, max_seq_len=longest + 2).options.max_seq_len == longest + 2


def test_dynamic_rope_is_refused_by_name_before_capture():
    base = _base("dynamic")
    with pytest.raises(ValueError, match=r"rope_type 'dynamic' recomputes.*\(24\) it equals 'default'"):
        eagle_fx.compile(base, new_draft(base, seed=0))


def test_unknown_rope_type_of_a_draft_is_refused_by_name():
    base = _base("linear")
    draft = new_draft(base, seed=0)
    draft.config.rope_parameters = {"rope_type": "made_up", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=r"the draft's rope_type 'made_up' is not one eagle_fx has checked"):
        eagle_fx.compile(base, draft)
