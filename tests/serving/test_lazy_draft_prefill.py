"""Lazy draft prefill (Engine lazy_draft_prefill, the default when adaptive without prefix caching):
a prompt's draft prefill deferred to the draft's catch-up while the engine is not speculating.
Oracles: the draft's state when it first drafts for a request is the eager prefill's (the same
logits), every output == HF greedy, an engine that never speculates never runs the draft over a
prompt, and a prompt admitted while it speculates is prefilled for the draft at admission."""
import pytest
import torch

from eagle_fx.serving import Engine, SamplingParams
from tests.serving.test_engine import hf_greedy, model, pair  # noqa: F401 (the same bundled pair, compiled alike)


def five(pair):
    """Four short prompts and a long one (over two KV blocks: a prefix hit when repeated)."""
    return [pair[3][i] for i in (0, 1, 2, 4, 5)]


class Scripted(Engine):
    """k per step from a script (cycling); records the draft's state of each request at its first
    cycle at k > 0 (what its first drafts are drawn from). The check against plain decoding off by
    default (its plain epochs would skip the script)."""

    script = (3,)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"plain_check": False, **kwargs})

    def pick_k(self, spec, off):
        self._calls = getattr(self, "_calls", -1) + 1
        return self.script[self._calls % len(self.script)], False

    def _cycle(self, k, group, outputs):
        first = self.__dict__.setdefault("first_state", {})
        if k > 0:
            for r in group:
                if r.request_id not in first:
                    first[r.request_id] = self.draft_logits[r.slot].clone()
        super()._cycle(k, group, outputs)


def run(engine, prompts, n, later=()):
    """The prompts at step 0 (more than the engine's slots: some wait), `later` ones at step 6."""
    ids, finished, step = [], {}, 0
    while step <= 6 or engine.has_unfinished():
        for p in (prompts if step == 0 else later if step == 6 else ()):
            ids.append(engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        step += 1
    return ids, finished


@pytest.mark.parametrize("script", [(3,), (0, 0, 3, 1, 0)], ids=["always", "switching"])
def test_the_draft_after_its_catch_up_is_the_draft_after_its_prefill(pair, model, script):
    tok, base, _, _ = pair
    prompts = five(pair)
    n = 20
    states, outputs = {}, {}
    for lazy in (False, True):
        model.kv_cache.reset()
        engine = Scripted(model, tok, ks=[0, 1, 3], measure=False, lazy_draft_prefill=lazy)
        engine.script = script
        engine.costs.observe(0, 1, 1.0)
        # the long prompt alone; then every prompt (five, four slots: one waits), the long one a prefix hit
        first_ids, first_finished = run(engine, prompts[4:], n)
        ids, finished = run(engine, prompts, n, later=prompts[:1])
        ids, finished = first_ids + ids, {**first_finished, **finished}
        states[lazy] = [engine.first_state[i] for i in ids]
        outputs[lazy] = [finished[i] for i in ids]
        assert engine.metrics()["kv_blocks_used"] == 0
        assert engine.metrics()["prefix_cache_hit_tokens_total"] > 0
        if lazy:
            assert engine.catch_up_seconds > 0
    for eager_state, lazy_state in zip(states[False], states[True]):
        torch.testing.assert_close(lazy_state, eager_state, rtol=1e-4, atol=1e-4)
    everything = prompts[4:] + prompts + prompts[:1]
    assert len(outputs[True]) == len(everything)
    for prompt, eager_out, lazy_out in zip(everything, outputs[False], outputs[True]):
        assert lazy_out == eager_out == hf_greedy(base, prompt, n)


def test_an_engine_that_never_speculates_never_prefills_the_draft(pair, model):
    tok, base, _, _ = pair
    prompts, computed = five(pair)[:4], {}
    for lazy in (False, True):
        model.kv_cache.reset()
        engine = Scripted(model, tok, ks=[0, 3], measure=False, lazy_draft_prefill=lazy)
        engine.script = (0,)
        engine.costs.observe(0, 1, 1.0)
        ids, finished = run(engine, prompts, 8)
        for rid, prompt in zip(ids, prompts):
            assert finished[rid] == hf_greedy(base, prompt, 8)
        computed[lazy] = engine.stats.prefill_tokens_computed_draft
        assert engine.metrics()["kv_blocks_used"] == 0
    assert computed[False] == sum(len(p) for p in prompts) and computed[True] == 0


def test_a_prompt_admitted_while_the_engine_speculates_has_its_draft_prefill_at_admission(pair, model):
    """Lazy draft prefill defers a prompt's draft prefill only while the engine is not speculating:
    the first prompt (admitted before any decode) is caught up before its first cycle at k = 3, the
    one admitted while cycles run at k = 3 is prefilled for the draft at admission, as at a fixed k,
    and never caught up."""
    tok, base, _, _ = pair
    first, later = five(pair)[:2]
    model.kv_cache.reset()
    engine = Scripted(model, tok, ks=[0, 3], measure=False, lazy_draft_prefill=True)
    caught_up, catch_up = [], engine._catch_up

    def recording(group):
        caught_up.extend(r.prompt for r in group)
        catch_up(group)

    engine._catch_up = recording
    ids, finished = run(engine, [first], 24, later=[later])
    for rid, prompt in zip(ids, (first, later)):
        assert finished[rid] == hf_greedy(base, prompt, 24)
    assert caught_up == [first]
    assert engine.stats.prefill_tokens_computed_draft == len(later)
    assert engine.metrics()["kv_blocks_used"] == 0


def test_a_prompt_longer_than_the_ring_is_prefilled_for_the_draft_at_once(pair, model):
    tok, base, _, _ = pair
    short, long = sorted(five(pair)[2:4], key=len)
    model.kv_cache.reset()
    # (by default off where prefix caching is on: a block is cached only with the draft's K/V)
    assert not Scripted(model, tok, ks=[0, 3], measure=False).lazy_draft_prefill
    engine = Scripted(model, tok, ks=[0, 3], measure=False, resume_window=len(long), lazy_draft_prefill=True)
    engine.script = (0, 3)
    engine.costs.observe(0, 1, 1.0)
    ids, finished = run(engine, [short], 12, later=[long])  # (admitted apart: a group is lazy when all fit)
    for rid, prompt in zip(ids, (short, long)):
        assert finished[rid] == hf_greedy(base, prompt, 12)
    # the short prompt deferred, the long one (it and its pending token past the ring) prefilled
    assert engine.stats.prefill_tokens_computed_draft == len(long)


def test_a_catch_up_is_priced_over_the_tokens_of_the_requests_it_catches_up(pair, model, monkeypatch):
    """pick_k hands choose_k, as what a catch-up is repaid over, the output tokens left to the
    requests behind the draft (ride_remaining: with the off requests behind too), not every running
    request's: in steady traffic each request's catch-up is repaid by its own tokens."""
    import eagle_fx.serving.engine as engine_module

    tok, prompts = pair[0], five(pair)
    model.kv_cache.reset()
    # (no check: its full arm, leading at first, would run k = 3 without asking pick_k)
    engine = Engine(model, tok, "adaptive", measure=False, lazy_draft_prefill=True, plain_check=False)
    for k in engine.ks:
        engine.costs.observe(k, 1, 1.0)
    for p, n in zip(prompts[:3], (40, 50, 60)):
        engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
    seen = []
    monkeypatch.setattr(engine_module, "choose_k", lambda *args: seen.append(args) or (0, False))
    while len(engine.running) < 3:  # (at k = 0: the prompts' draft prefill stays deferred)
        engine.step()
    a, b, c = engine.running
    assert all(r.draft_upto < r.committed for r in (a, b, c))
    b.draft_upto = b.committed  # (as if its draft had caught up)
    seen.clear()
    engine.pick_k([a, b], [c])

    def left(*requests):
        return sum(r.params.max_tokens - len(r.output) for r in requests)
    assert (seen[0][7], seen[0][12]) == (left(a), left(a, c))  # remaining, ride_remaining
    while engine.has_unfinished():
        engine.step()


def test_a_fixed_k0_engine_on_a_pair_never_prefills_the_draft(pair, model):
    """Engine(model, 0) on a pair (the k = 0 a server of the pair runs): no draft prefill, outputs ==
    HF greedy; with prefix caching (the module's model: a block is cached with the draft's K/V) the
    draft is prefilled as before."""
    import eagle_fx

    tok, base, draft, _ = pair
    prompts = five(pair)  # (five, four slots: one waits)
    uncached = eagle_fx.compile(base, draft, num_spec_tokens=3, backend="eager", max_batch_size=4, max_seq_len=256,
                                prefill_chunk_size=8)
    computed = {}
    for m in (uncached, model):
        m.kv_cache.reset()
        engine = Engine(m, tok, 0)
        assert engine.draft_free == (m is uncached)
        ids, finished = run(engine, prompts, 8)
        for rid, prompt in zip(ids, prompts):
            assert finished[rid] == hf_greedy(base, prompt, 8)
        assert engine.metrics()["kv_blocks_used"] == 0
        computed[m is uncached] = engine.stats.prefill_tokens_computed_draft
    assert computed[True] == 0 and computed[False] > 0
