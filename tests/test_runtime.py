"""Greedy eagle_fx output == Hugging Face greedy generate, token for token."""
import pytest
import torch

import eagle_fx
from conftest import ARCHS, compiled, hf_greedy, make_prompts, tiny_base, tiny_draft

MAX_NEW = 24


def _eos_for(arch):
    """A token HF's greedy output really emits mid-way, so eos stopping is exercised."""
    ref = hf_greedy(arch, make_prompts(3), MAX_NEW)
    return ref[0][6]


# a pairwise matrix: every value of each factor meets every value of each other factor at least
# once (arch x method, arch x batch, arch x k, method x batch, method x k, batch x k), 18 cases
# instead of the 72 of the full product
PAIRWISE = [("gemma3", "eagle", 1, 1), ("gemma3", "eagle", 1, 3), ("gemma3", "eagle3", 3, 5),
            ("llama", "eagle", 1, 3), ("llama", "eagle", 1, 5), ("llama", "eagle3", 3, 1),
            ("mistral", "eagle", 3, 1), ("mistral", "eagle", 3, 3), ("mistral", "eagle3", 1, 5),
            ("mistral_swa", "eagle", 1, 5), ("mistral_swa", "eagle", 3, 1), ("mistral_swa", "eagle3", 1, 3),
            ("qwen2", "eagle", 1, 3), ("qwen2", "eagle", 3, 1), ("qwen2", "eagle3", 1, 5),
            ("qwen3", "eagle", 3, 5), ("qwen3", "eagle3", 1, 1), ("qwen3", "eagle3", 1, 3)]


def test_pairwise_matrix_covers_every_pair():
    import itertools

    factors = [ARCHS, ["eagle", "eagle3"], [1, 3], [1, 3, 5]]
    for i, j in itertools.combinations(range(4), 2):
        assert {(row[i], row[j]) for row in PAIRWISE} == set(itertools.product(factors[i], factors[j]))


@pytest.mark.parametrize("arch,method,batch,k", PAIRWISE)
def test_greedy_matches_hf(arch, method, batch, k):
    prompts = make_prompts(3)[1:2] if batch == 1 else make_prompts(3)
    eos = _eos_for(arch)
    model = compiled(arch, method).replace(num_spec_tokens=k)
    out = model.generate(prompts, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert out.sequences == hf_greedy(arch, prompts, MAX_NEW, eos)
    assert any(s[-1] == eos for s in out.sequences) or batch == 1


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_shifted_reference_scheme_matches_hf(arch, method):
    import eagle_fx
    from conftest import tiny_draft

    prompts = make_prompts(3)
    model = eagle_fx.compile(tiny_base(arch), tiny_draft(arch, method), num_spec_tokens=3, prefill_shift=True)
    assert model.generate(prompts, max_new_tokens=MAX_NEW).sequences == hf_greedy(arch, prompts, MAX_NEW)


class CopyReference:
    """Test-only forced drafts (forced_drafts=): the base's own greedy continuation, every `every`th
    draft token wrong."""

    def __init__(self, prompts, refs, every=0):
        self.full = {tuple(p): p + r for p, r in zip(prompts, refs)}
        self.every = every
        self.calls = 0

    def __call__(self, contexts, k):
        fulls = [next(f for p, f in self.full.items() if list(ctx[:len(p)]) == list(p) and len(f) >= len(ctx))
                 for ctx in contexts]
        out = [[0] * k for _ in contexts]
        for j in range(k):  # position by position, as the draft proposes them
            for i, (ctx, full) in enumerate(zip(contexts, fulls)):
                idx = len(ctx) + j
                self.calls += 1
                right = full[idx] if idx < len(full) else 0
                wrong = self.every and self.calls % self.every == 0
                out[i][j] = (right + 1) % 96 if wrong else right
        return out


@pytest.mark.parametrize("every", [0, 4])
@pytest.mark.parametrize("arch,method,k", [("llama", "eagle", 3), ("llama", "eagle3", 5), ("mistral_swa", "eagle", 5),
                                           ("gemma3", "eagle3", 3), ("qwen2", "eagle", 1), ("qwen3", "eagle3", 3)])
def test_forced_accept_path(arch, method, k, every):
    prompts = make_prompts(3)
    refs = hf_greedy(arch, prompts, MAX_NEW)
    model = compiled(arch, method).replace(num_spec_tokens=k, forced_drafts=CopyReference(prompts, refs, every))
    out = model.generate(prompts, max_new_tokens=MAX_NEW)
    assert out.sequences == refs
    st = out.stats
    if every == 0:
        # every proposal is right, except those past the reference's end in the last step
        assert st.num_accepted_tokens >= st.num_draft_tokens - 3 * k
        assert st.mean_acceptance_length > 1 + k * 0.6
    else:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.parametrize("wrong_at", [None, 1])
def test_counters_against_a_hand_counted_run(wrong_at):
    """vLLM's counters against a run whose acceptance is known by construction: forced drafts are the
    base's own continuation, except draft `wrong_at` of every cycle (None: none wrong). k=3, two
    prompts, max_new_tokens = 1 + 5 cycles x (accepted + 1): each sequence runs exactly 5 cycles."""
    k, cycles = 3, 5
    accepted = k if wrong_at is None else wrong_at
    max_new = 1 + cycles * (accepted + 1)
    prompts = make_prompts(2)
    refs = hf_greedy("llama", prompts, max_new + k)
    full = {tuple(p): p + r for p, r in zip(prompts, refs)}

    def forced(contexts, k):
        rows = []
        for ctx in contexts:
            seq = next(f for p, f in full.items() if list(ctx[:len(p)]) == list(p))
            rows.append([(seq[len(ctx) + j] + 1) % 96 if j == wrong_at else seq[len(ctx) + j] for j in range(k)])
        return rows

    model = compiled("llama", "eagle").replace(num_spec_tokens=k, max_batch_size=2, forced_drafts=forced)
    out = model.generate(prompts, max_new_tokens=max_new, eos_token_id=None)
    assert out.sequences == [r[:max_new] for r in refs]
    st = out.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (2 * cycles, 2 * cycles * k,
                                                                           2 * cycles * accepted)
    assert st.accepted_per_pos == [2 * cycles if j < accepted else 0 for j in range(k)]
    assert st.acceptance_at == [1.0 if j < accepted else 0.0 for j in range(k)]
    assert st.mean_acceptance_length == 1 + accepted
    assert st.total_num_output_tokens == 2 * max_new


def test_waves_when_more_prompts_than_batch():
    prompts = make_prompts(5, seed=3)
    model = compiled("llama", "eagle").replace(max_batch_size=2)
    assert model.generate(prompts, max_new_tokens=10).sequences == hf_greedy("llama", prompts, 10)


def test_block_boundaries_and_tiny_blocks():
    prompts = make_prompts(3, seed=5, lengths=(15, 16, 17))
    model = compiled("mistral_swa", "eagle3").replace(block_size=4)
    assert model.generate(prompts, max_new_tokens=20).sequences == hf_greedy("mistral_swa", prompts, 20)


@pytest.mark.heavy
def test_inductor_backend_matches_hf():
    import eagle_fx
    from conftest import tiny_draft

    from torch._dynamo.utils import counters

    # a one-layer base: the compiled cycle (k-1 draft steps, verify, extend) is compiled twice (one
    # sequence, and any number), the longest compile of the suite (GEMMs not autotuned: a third of the time;
    # the autotuned code is the same graph with other matmul kernels, run by the README's main job)
    model = eagle_fx.compile(tiny_base("llama1"), tiny_draft("llama1", "eagle"), num_spec_tokens=3, backend="inductor",
                             max_batch_size=3, max_seq_len=160, gemm_autotune=False)
    assert model.chain_cycle is not None and model.chain_cycle.compile  # the cycle is one compiled graph
    compiled = dict(counters["stats"])  # after the warm-up: every graph compiled
    # mixed prompt lengths (1 to 70 tokens: block tables 1 to 8 blocks wide), 1 to 3 sequences per wave
    prompts = make_prompts(5, lengths=(5, 70, 1, 33, 12))
    assert model.generate(prompts, max_new_tokens=12).sequences == hf_greedy("llama1", prompts, 12)
    assert model.generate(prompts[1:2], max_new_tokens=40).sequences == hf_greedy("llama1", prompts[1:2], 40)
    assert dict(counters["stats"]) == compiled  # no recompilation (dynamo's counters flat)
    timed = model.generate(prompts[:3], max_new_tokens=12, profile=True).stats  # the compiled cycle timed as one
    assert timed.num_drafts / 3 <= timed.graph_calls["chain_cycle"] <= timed.num_drafts  # 1 to 3 sequences a cycle
    assert "draft_step" not in timed.graph_calls and timed.time_cycle_s > 0


def test_model_usable_after_pool_exhausted():
    from eagle_fx.runtime.kv_cache import PoolExhausted

    model = compiled("llama", "eagle").replace(max_batch_size=1, max_seq_len=64)
    model.kv_cache.allocator.allocate(model.kv_cache.allocator.num_free - 1)  # leave one block: not enough for a request
    with pytest.raises(PoolExhausted, match="KV pool exhausted"):
        model.generate([[1, 2, 3]], max_new_tokens=30)
    assert model.kv_cache.allocator.num_free == 1


@pytest.mark.parametrize("arch,method,chunk", [("llama", "eagle", None), ("qwen3", "eagle3", 4)])
def test_without_speculation_matches_hf(arch, method, chunk):
    """num_spec_tokens=0: the base alone on the same graphs (the bench's plain-decode baseline):
    HF greedy, one token per cycle, and no draft graph is ever called."""
    model = compiled(arch, method).replace(num_spec_tokens=0, max_batch_size=2, prefill_chunk_size=chunk)
    called = []
    model.executor.add_observer(lambda graph, inputs, out: called.append(graph))
    prompts = make_prompts(3, lengths=(5, 12, 1))
    out = model.generate(prompts, max_new_tokens=10)
    assert out.sequences == hf_greedy(arch, prompts, 10)
    assert out.stats.num_draft_tokens == 0 and out.stats.num_drafts == 3 * 9  # 9 cycles after each prefill token
    assert called and not [graph for graph in called if graph.startswith("draft")]


def test_without_speculation_refused_where_it_cannot_run():
    model = compiled("llama", "eagle")
    with pytest.raises(ValueError, match="num_spec_tokens=0 .* without a draft tree"):
        eagle_fx.compile(tiny_base("llama"), tiny_draft("llama", "eagle"), num_spec_tokens=0,
                         draft_tree=dict(top_k=2, depth=2, total_tokens=3))
    with pytest.raises(ValueError, match="num_spec_tokens must be an int >= 0"):
        model.replace(num_spec_tokens=-1)


def test_two_threads_on_one_model_both_get_hf_greedy():
    """generate holds no per-call state on the model: two threads on one model both decode right
    (the second waits for the first: the KV pools are the model's)."""
    import threading

    model = compiled("llama", "eagle").replace(max_batch_size=2)
    jobs = {"a": make_prompts(2, seed=11), "b": make_prompts(3, seed=12)}
    results, errors = {}, []

    def run(name):
        try:
            results[name] = model.generate(jobs[name], max_new_tokens=16, temperature=0.0).sequences
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == {name: hf_greedy("llama", p, 16) for name, p in jobs.items()}


def test_generate_inside_generate_is_a_clear_error():
    def nested(contexts, k):  # a callback that calls generate on the model that runs it
        model.generate([[1, 2]], max_new_tokens=2)
        return [[-1] * k for _ in contexts]

    model = compiled("llama", "eagle").replace(max_batch_size=1, forced_drafts=nested)
    with pytest.raises(RuntimeError, match="inside a running generate"):
        model.generate([[1, 2, 3]], max_new_tokens=4)
    # the model is usable afterwards (one token: prefill only, the callback does not run)
    assert model.generate([[1, 2, 3]], max_new_tokens=1).sequences == hf_greedy("llama", [[1, 2, 3]], 1)


def test_reset_clears_pools_and_prefix_cache_in_place():
    model = compiled("llama", "eagle").replace(max_batch_size=2, prefix_caching=True)
    pools = model.kv_cache.base_pool
    prompts = make_prompts(2, seed=4, lengths=(40, 37))
    first = model.generate(prompts, max_new_tokens=8)
    assert model.kv_cache.allocator.num_cached > 0 and pools.abs().sum() > 0
    model.reset()
    assert model.kv_cache.base_pool is pools and pools.abs().sum() == 0  # same tensor, emptied
    assert model.kv_cache.allocator.num_cached == 0
    again = model.generate(prompts, max_new_tokens=8)
    assert again.stats.prefix_hit_tokens_base == 0  # nothing left to hit
    assert again.sequences == first.sequences == hf_greedy("llama", prompts, 8)


def test_profiler_is_opt_in():
    model = compiled("llama", "eagle").replace(num_spec_tokens=3)
    prompts = make_prompts(2)
    plain = model.generate(prompts, max_new_tokens=12).stats
    assert not plain.profiled and plain.profile() is None and plain.graph_calls == {}
    assert plain.time_verify_s == plain.time_draft_s == plain.time_prefill_s == 0.0
    # the eager backend runs the cycle over the executor: each step graph timed, k - 1 draft steps per verify
    timed = model.generate(prompts, max_new_tokens=12, profile=True)
    assert timed.sequences == hf_greedy("llama", prompts, 12)
    steps = timed.stats
    assert steps.profiled and set(steps.profile()) == {"prefill", "draft", "verify", "cycle", "host"}
    assert steps.graph_calls["base"] >= 1 and steps.time_cycle_s == 0.0
    assert steps.graph_calls["draft_step"] == 2 * steps.graph_calls["verify"] and "chain_cycle" not in steps.graph_calls
    assert steps.time_verify_s == pytest.approx(steps.graph_time_s["verify"])
