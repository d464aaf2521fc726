"""A 32k-token prompt on the bundled base: eagle_fx == HF greedy with whole and chunked prefill."""
import functools

import pytest
import torch

import eagle_fx
from eagle_fx.bundled import BUNDLED

LENGTH, NEW = 32768, 6


@functools.lru_cache(maxsize=None)
def _base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(BUNDLED / "base", dtype=torch.float32).eval()


@pytest.mark.heavy
def test_32k_prompt_equals_hf_whole_and_chunked():
    base = _base()
    assert LENGTH > 8 * base.config.max_position_embeddings  # far past the length it was trained on
    prompt = torch.randint(3, base.config.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = base.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, LENGTH:].tolist()
    draft = eagle_fx.load_draft(BUNDLED / "eagle", base)
    model = eagle_fx.compile(base, draft, max_batch_size=1, max_seq_len=LENGTH + NEW)
    assert model.generate([prompt], max_new_tokens=NEW, eos_token_id=None).sequences == [ref]
    # two chunks, the boundary inside a block: the second's 1000 queries attend over ~32k cached keys
    # (a smaller chunk size repeats that per chunk, at a cost this suite does not need to pay)
    chunked = model.replace(prefill_chunk_size=LENGTH - 1000)
    assert chunked.generate([prompt], max_new_tokens=NEW, eos_token_id=None).sequences == [ref]
