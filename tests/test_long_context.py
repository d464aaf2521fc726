"""A long prompt on the bundled pair: eagle_fx == HF greedy with whole and chunked prefill, with the
attention's tile and chunk limits lowered (eagle_fx.ops.limits) so a 700-token prompt takes the
same bounded-memory paths a 32k-token one takes with the defaults: the prefill in query tiles x key
chunks (online softmax over blocks read a chunk at a time), the chunked prefill's second chunk over
the first's cached keys in tiles, and every decode and verify step's device-side attention over
its block table in key chunks. (The 32k-token run itself is the bench's long-context check.)"""
import functools

import torch

import eagle_fx
from eagle_fx.bundled import BUNDLED
from eagle_fx.ops.canonical import attention_limits

LENGTH, NEW = 700, 6
# 4 heads x 64 rows x 128 keys per tile's chunk; 128 keys (K and V, 2 kv heads of 64) per device-side chunk
LIMITS = dict(query_tile=64, score_limit=4 * 64 * 128, kv_read_limit=2 * 128 * 2 * 64, compiled_key_chunk=128)


@functools.lru_cache(maxsize=None)
def _base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(BUNDLED / "base", dtype=torch.float32).eval()


def test_long_prompt_through_tiles_and_key_chunks_equals_hf_whole_and_chunked():
    base = _base()
    config = base.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)  # LIMITS' sums
    assert 4 * LENGTH * LENGTH > 4 * LIMITS["score_limit"]  # the whole prefill's scores: several tiles
    prompt = torch.randint(3, config.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = base.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, LENGTH:].tolist()
    draft = eagle_fx.load_draft(BUNDLED / "eagle", base)
    model = eagle_fx.compile(base, draft, max_batch_size=1, max_seq_len=LENGTH + NEW)
    with attention_limits(**LIMITS):
        assert model.generate([prompt], max_new_tokens=NEW, eos_token_id=None).sequences == [ref]
        # two chunks, the boundary inside a block: the second's 100 queries attend over ~700 cached keys
        chunked = model.replace(prefill_chunk_size=LENGTH - 100)
        assert chunked.generate([prompt], max_new_tokens=NEW, eos_token_id=None).sequences == [ref]
