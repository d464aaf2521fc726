"""Greedy eagle_fx output == Hugging Face greedy generate, token for token."""
import pytest
import torch

from conftest import ARCHS, compiled, hf_greedy, make_prompts, tiny_base
from eagle_fx.runtime import ChainProposer

MAX_NEW = 24


def _eos_for(arch):
    """A token HF's greedy output really emits mid-way, so eos stopping is exercised."""
    ref = hf_greedy(arch, make_prompts(3), MAX_NEW)
    return ref[0][6]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(arch, method, batch, k):
    prompts = make_prompts(3)[1:2] if batch == 1 else make_prompts(3)
    eos = _eos_for(arch)
    model = compiled(arch, method).replace(num_spec_tokens=k)
    out = model.generate(prompts, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert out.sequences == hf_greedy(arch, prompts, MAX_NEW, eos)
    assert any(s[-1] == eos for s in out.sequences) or batch == 1
    st = out.stats
    assert st.num_draft_tokens == k * st.num_drafts
    assert st.total_num_output_tokens == sum(len(s) for s in out.sequences)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_shifted_reference_scheme_matches_hf(arch, method):
    import eagle_fx
    from conftest import tiny_draft

    prompts = make_prompts(3)
    model = eagle_fx.compile(tiny_base(arch), tiny_draft(arch, method), num_spec_tokens=3, prefill_shift=True)
    assert model.generate(prompts, max_new_tokens=MAX_NEW).sequences == hf_greedy(arch, prompts, MAX_NEW)


class CopyReference:
    """Test-only proposal hook: propose the base's own greedy continuation, wrong every `every`th time."""

    def __init__(self, prompts, refs, every=0):
        self.full = {tuple(p): p + r for p, r in zip(prompts, refs)}
        self.every = every
        self.calls = 0

    def __call__(self, contexts, j, proposal):
        out = proposal.clone()
        for i, ctx in enumerate(contexts):
            full = next(f for p, f in self.full.items() if list(ctx[:len(p)]) == list(p) and len(f) >= len(ctx))
            idx = len(ctx) + j
            self.calls += 1
            right = full[idx] if idx < len(full) else 0
            wrong = self.every and self.calls % self.every == 0
            out[i] = (right + 1) % 96 if wrong else right
        return out


@pytest.mark.parametrize("every", [0, 4])
@pytest.mark.parametrize("arch,method,k", [("llama", "eagle", 3), ("llama", "eagle3", 5), ("mistral_swa", "eagle", 5),
                                           ("gemma3", "eagle3", 3), ("qwen2", "eagle", 1), ("qwen3", "eagle3", 3)])
def test_forced_accept_path(arch, method, k, every):
    prompts = make_prompts(3)
    refs = hf_greedy(arch, prompts, MAX_NEW)
    model = compiled(arch, method).replace(num_spec_tokens=k, proposer=ChainProposer(CopyReference(prompts, refs, every)))
    out = model.generate(prompts, max_new_tokens=MAX_NEW)
    assert out.sequences == refs
    st = out.stats
    if every == 0:
        # every proposal is right, except those past the reference's end in the last step
        assert st.num_accepted_tokens >= st.num_draft_tokens - 3 * k
        assert st.mean_acceptance_length > 1 + k * 0.6
    else:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert st.acceptance_at == sorted(st.acceptance_at, reverse=True)


def test_waves_when_more_prompts_than_batch():
    prompts = make_prompts(5, seed=3)
    model = compiled("llama", "eagle").replace(max_batch_size=2)
    assert model.generate(prompts, max_new_tokens=10).sequences == hf_greedy("llama", prompts, 10)


def test_block_boundaries_and_tiny_blocks():
    prompts = make_prompts(3, seed=5, lengths=(15, 16, 17))
    model = compiled("mistral_swa", "eagle3").replace(block_size=4)
    assert model.generate(prompts, max_new_tokens=20).sequences == hf_greedy("mistral_swa", prompts, 20)


def test_inductor_backend_matches_hf():
    import eagle_fx
    from conftest import tiny_draft

    model = eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), num_spec_tokens=3, backend="inductor")
    prompts = make_prompts(3)
    assert model.generate(prompts, max_new_tokens=12).sequences == hf_greedy("llama", prompts, 12)


def test_model_usable_after_pool_exhausted():
    from eagle_fx.runtime.kv_cache import PoolExhausted

    model = compiled("llama", "eagle").replace(max_batch_size=1, max_seq_len=64)
    model.kv_cache.allocator.allocate(model.kv_cache.allocator.num_free - 1)  # leave one block: not enough for a request
    with pytest.raises(PoolExhausted, match="KV pool exhausted"):
        model.generate([[1, 2, 3]], max_new_tokens=30)
    assert model.kv_cache.allocator.num_free == 1
