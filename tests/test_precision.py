"""The precision rules (README, "Precision"): fp32 greedy == HF greedy (tests/test_runtime.py);
bf16 with batch_invariant=True: speculative greedy == eagle_fx's own non-speculative greedy decode,
bit for bit, whatever the batching and chunking, with acceptance within 2% of fp32's."""
import argparse

import pytest
import torch

import eagle_fx
from eagle_fx.bundled import BUNDLED

NUM_PROMPTS, NEW = 16, 48


def _pair(dtype):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(BUNDLED / "base", dtype=dtype).eval()
    return base, eagle_fx.load_draft(BUNDLED / "eagle", base)


def _prompts():
    from transformers import AutoTokenizer

    from eagle_fx.bench.prompts import load_prompts

    args = argparse.Namespace(dataset_name="sharegpt", dataset_path=None, num_prompts=NUM_PROMPTS, max_prompt_len=96,
                              seed=0)
    return load_prompts(args, AutoTokenizer.from_pretrained(BUNDLED / "base"), 0)


@pytest.mark.heavy
def test_bf16_speculation_equals_own_plain_decode_bit_for_bit():
    prompts = _prompts()
    base, draft = _pair(torch.bfloat16)
    model = eagle_fx.compile(base, draft, batch_invariant=True, max_batch_size=8, max_seq_len=256)
    spec = model.generate(prompts, max_new_tokens=NEW, eos_token_id=None)
    plain = model.replace(num_spec_tokens=0).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
    assert spec.sequences == plain.sequences
    # other batch waves, chunked prefill and k: the same tokens (batch invariance)
    other = model.replace(max_batch_size=3, prefill_chunk_size=16, num_spec_tokens=2)
    assert other.generate(prompts, max_new_tokens=NEW, eos_token_id=None).sequences == spec.sequences
    # acceptance as in fp32 (the draft proposes as well in bf16)
    fp32 = eagle_fx.compile(*_pair(torch.float32), max_batch_size=8, max_seq_len=256)
    tau32 = fp32.generate(prompts, max_new_tokens=NEW, eos_token_id=None).stats.mean_acceptance_length
    tau16 = spec.stats.mean_acceptance_length
    assert abs(tau16 - tau32) <= 0.02 * tau32, (tau16, tau32)
