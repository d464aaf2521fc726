import os

# Triton runs on the CPU only in its interpreter; set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)


def _configs():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**COMMON),
        "qwen2": Qwen2Config(**COMMON),
        "qwen3": Qwen3Config(**COMMON),
        "mistral": MistralConfig(**COMMON, sliding_window=None),
        "mistral_swa": MistralConfig(**COMMON, sliding_window=8),
        "gemma3": Gemma3TextConfig(**COMMON, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"] * 2),
    }


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "mistral_swa", "gemma3"]


@functools.lru_cache(maxsize=None)
def tiny_base(arch: str, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_configs()[arch], attn_implementation=attn_implementation)
    return model.eval()


@functools.lru_cache(maxsize=None)
def tiny_draft(arch: str, method: str):
    from eagle_fx.drafts import new_draft

    return new_draft(tiny_base(arch), method, seed=7)


@functools.lru_cache(maxsize=None)
def compiled(arch: str, method: str):
    import eagle_fx

    return eagle_fx.compile(tiny_base(arch), tiny_draft(arch, method), num_spec_tokens=3)


def make_prompts(n: int, seed: int = 0, lengths=(5, 12, 1, 9)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, COMMON["vocab_size"], (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@functools.lru_cache(maxsize=None)
def _hf_greedy(arch: str, prompt: tuple, max_new_tokens: int, eos):
    base = tiny_base(arch)
    kw = {} if eos is None else {"eos_token_id": eos}  # not given: the model's generation_config eos
    with torch.no_grad():
        out = base.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def hf_greedy(arch, prompts, max_new_tokens, eos=None):
    """The oracle: Hugging Face greedy generate, one prompt at a time (no padding effects);
    eos=None leaves eos_token_id out, as eagle_fx's generate does by default."""
    return [_hf_greedy(arch, tuple(p), max_new_tokens, eos) for p in prompts]


@pytest.fixture
def tmp_draft_dir(tmp_path):
    return tmp_path / "draft"
