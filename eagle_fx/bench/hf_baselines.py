"""The Hugging Face baselines of `--compare`, one prompt at a time: greedy generate, static cache +
torch.compile, and assisted generation with a small assistant model."""
from __future__ import annotations

import torch


def hf_greedy(base, eos, pad, max_new_tokens: int, static_cache_len: int | None = None, **generate_kwargs):
    """A function batch -> new tokens per prompt: HF greedy `generate`, one prompt at a time.
    static_cache_len: a fresh StaticCache of that length per prompt (one cache shape for every
    prompt, so a compiled forward is compiled once, not per prompt length)."""
    def generate_batch(batch):
        outputs = []
        for prompt in batch:
            ids = torch.tensor([prompt])
            if static_cache_len:
                from transformers import StaticCache

                generate_kwargs["past_key_values"] = StaticCache(config=base.config, max_cache_len=static_cache_len)
            with torch.no_grad():
                out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=eos, pad_token_id=pad, **generate_kwargs)
            outputs.append(out[0, len(prompt):].tolist())
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


def hf_batched_greedy(base, pad, max_new_tokens: int, static_cache_len: int | None = None):
    """A function batch -> new tokens per prompt: ONE HF greedy generate over the whole batch,
    left-padded with an attention mask, never stopping early (eos off: every prompt gets exactly
    max_new_tokens, equal work for every method). static_cache_len: a static cache of that length
    and the compiled decode step (one compile per batch size)."""
    def generate_batch(batch):
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        kwargs = {}
        if static_cache_len:
            from transformers import StaticCache

            kwargs = dict(past_key_values=StaticCache(config=base.config, max_cache_len=static_cache_len),
                          compile_config=compile_config())
        with torch.no_grad():
            out = base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=pad, **kwargs)
        return out[:, width:].tolist()
    return generate_batch


def hf_assisted(base, eos, pad, max_new_tokens: int, assistant_dir):
    """HF assisted generation with the model in assistant_dir as the assistant."""
    from transformers import AutoModelForCausalLM

    assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
    return hf_greedy(base, eos, pad, max_new_tokens, assistant_model=assistant)
