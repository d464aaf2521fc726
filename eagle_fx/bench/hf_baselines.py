"""The Hugging Face baselines of `--compare` (one prompt at a time) and of the throughput mode
(left-padded batches): greedy generate, static cache + torch.compile, and assisted generation with a
small assistant model."""
from __future__ import annotations

import torch


def hf_greedy(base, eos, pad, max_new_tokens: int, static_cache_len: int | None = None, **generate_kwargs):
    """A function batch -> new tokens per prompt: ONE HF greedy `generate` over the batch,
    left-padded with an attention mask (a batch of one prompt is that prompt alone, unpadded: how
    --compare calls it). eos None: never stop early, so every prompt gets exactly max_new_tokens
    (the throughput mode); else each output ends at its first eos. static_cache_len: a fresh
    StaticCache of that length per call (one cache shape for every prompt, so a compiled forward is
    compiled once per batch size, not per prompt length)."""
    def generate_batch(batch):
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        kwargs = dict(generate_kwargs)
        if static_cache_len:
            from transformers import StaticCache

            kwargs["past_key_values"] = StaticCache(config=base.config, max_cache_len=static_cache_len)
        with torch.no_grad():
            out = base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=eos, pad_token_id=pad, **kwargs)
        outputs = out[:, width:].tolist()
        if eos is not None:  # a batch pads the sequences that stopped early after their eos
            outputs = [row[:row.index(eos) + 1] if eos in row else row for row in outputs]
        return outputs
    return generate_batch


def compile_config():
    """transformers' CompileConfig for a static-cache generate: the decode step compiled, on CPU too."""
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True  # transformers only auto-compiles on accelerators unless asked
    return config


def hf_static_compiled(base, eos, pad, max_new_tokens: int, max_len: int):
    """HF greedy with a static cache and torch.compile of the forward (on CPU too)."""
    return hf_greedy(base, eos, pad, max_new_tokens, static_cache_len=max_len, compile_config=compile_config())


def hf_assisted(base, eos, pad, max_new_tokens: int, assistant_dir):
    """HF assisted generation with the model in assistant_dir as the assistant."""
    from transformers import AutoModelForCausalLM

    assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
    return hf_greedy(base, eos, pad, max_new_tokens, assistant_model=assistant)
