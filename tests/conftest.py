import os

# Triton runs on the CPU only in its interpreter; set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# under pytest-xdist (README: -n 2) each worker gets one core; alone, the process takes two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)


# other families (tests/test_families.py); a wider init than HF's 0.02, so their greedy text is not one
# repeated token; ids 1/2 as bos/eos so every config's special tokens are inside the tiny vocab
FAMILY = dict(vocab_size=96, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _family_configs():
    from transformers import FalconConfig, GPT2Config, GPTNeoXConfig, OPTConfig, PhiConfig

    width = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    return {
        "gpt_neox": GPTNeoXConfig(**FAMILY, **width, intermediate_size=128, rotary_pct=0.5, initializer_range=0.3),
        "falcon": FalconConfig(**FAMILY, **width, initializer_range=0.3),  # multi-query: one kv head
        "falcon_new": FalconConfig(**FAMILY, **width, new_decoder_architecture=True, num_kv_heads=2,
                                   initializer_range=0.3),
        "gpt2": GPT2Config(vocab_size=96, n_positions=512, n_embd=64, n_layer=4, n_head=4, bos_token_id=1,
                           eos_token_id=2, pad_token_id=0, initializer_range=0.3),
        "opt": OPTConfig(**FAMILY, **width, ffn_dim=128, word_embed_proj_dim=64, init_std=0.3),
        "phi": PhiConfig(**FAMILY, **width, intermediate_size=128, partial_rotary_factor=0.5, initializer_range=0.3),
    }


FAMILIES = ["gpt_neox", "falcon", "falcon_new", "gpt2", "opt", "phi"]


def _configs():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return _family_configs() | {
        "llama": LlamaConfig(**COMMON),
        "llama1": LlamaConfig(**{**COMMON, "num_hidden_layers": 1}),  # for the tests that compile with inductor
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


class CaptureCache:
    """A session-wide cache of eagle_fx captures, at two levels, keyed by the base and draft modules
    (and their dtype and device):
    - the torch.export of the step functions (eagle_fx.capture.export_steps, ~97% of a capture's
      time), which depends on the pair and the plan's vision_language / mrope only: a test that
      compiles a pair another test exported, with other options, only runs the passes again;
    - the whole capture per CapturePlan: the same step graphs again, only the runtime (pools,
      static buffers, compiled callables) is new.
    The cache holds the modules, so their ids are never reused while it lives. Set
    EAGLE_FX_TEST_CAPTURE_CACHE=0 to capture every time."""

    def __init__(self):
        self.exports, self.graphs, self.hits, self.export_hits, self.misses = {}, {}, 0, 0, 0

    def __call__(self, base, draft, plan):
        from eagle_fx.capture import capture, export_steps

        first = next(base.parameters())
        pair = (id(base), id(draft), first.dtype, first.device, next(draft.parameters()).dtype)
        key = pair + (plan,)
        if key in self.graphs:
            self.hits += 1
            return self.graphs[key][2]
        export_key = pair + (plan.vision_language, plan.mrope)
        if export_key in self.exports:
            self.export_hits += 1
        else:
            self.misses += 1
            self.exports[export_key] = (base, draft, export_steps(base, draft, plan))
        graphs = capture(base, draft, plan, exported=self.exports[export_key][2])
        self.graphs[key] = (base, draft, graphs)
        return graphs


@pytest.fixture(scope="session", autouse=True)
def capture_cache():
    """Every eagle_fx.compile in the session goes through one CaptureCache."""
    import eagle_fx.api

    if os.environ.get("EAGLE_FX_TEST_CAPTURE_CACHE", "1") == "0":
        yield None
        return
    with pytest.MonkeyPatch.context() as mp:
        cache = CaptureCache()
        mp.setattr(eagle_fx.api, "capture", cache)
        yield cache


def pytest_collection_modifyitems(config, items):
    """Tests marked heavy (the longest ones: AOTInductor, the Triton interpreter, 20k-sample
    chi-squares) run first, so the xdist workers do not end waiting on one of them."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture
def tmp_draft_dir(tmp_path):
    return tmp_path / "draft"

