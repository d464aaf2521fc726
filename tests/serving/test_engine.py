"""The serving engine against HF greedy: requests joining and leaving a running batch, chunked
prefill and prefix caching, k changing between cycles (the draft's catch-up after k = 0),
acceptance collapse, aborts, a full pool, per-request sampling and stopping rules."""
import logging

import pytest
import torch

import eagle_fx
from eagle_fx.bundled import load_pair, pair_dirs
from eagle_fx.drafts import new_draft
from eagle_fx.serving import Engine, SamplingParams
from eagle_fx.serving.adaptive import EXPLORATION_CYCLES, FIRST_EXPLORATION

TEXTS = ["Hello, how are you?", "Write a poem about the sea", "What is the capital of France? Explain in detail.",
         "hi", "Tell me about python programming language and why people like it so much",
         "Why is the sky blue? I asked my teacher and she said it is because of the way sunlight is scattered by the "
         "air, but I did not understand what that means. Can you explain it step by step, simply?"]


@pytest.fixture(scope="module")
def pair():
    tok, base, draft = load_pair(*pair_dirs())
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    return tok, base, draft, prompts


def hf_greedy(base, prompt, n):
    out = base.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model(pair):
    tok, base, draft, _ = pair
    return eagle_fx.compile(base, draft, num_spec_tokens=3, backend="eager", max_batch_size=4, max_seq_len=256,
                            prefill_chunk_size=8, prefix_caching=True)


def run(engine, schedule, until_done=True):
    """schedule: {step index: [(prompt, params), ...]} added before that step. Returns outputs by id
    (the finished RequestOutput) and the ids in order of adding."""
    finished, ids, step = {}, [], 0
    while step <= max(schedule) or engine.has_unfinished():
        for prompt, params in schedule.get(step, []):
            ids.append(engine.add_request(prompt, params))
        for out in engine.step():
            assert out.request_id not in finished, "a request finished twice"
            if out.finished:
                finished[out.request_id] = out
        step += 1
        assert step < 2000
    return finished, ids


class Logged(Engine):
    """Logs each cycle's (step, k, slots, whether each request speculates)."""

    def _decode(self, outputs):
        self.steps = getattr(self, "steps", 0) + 1
        super()._decode(outputs)

    def _cycle(self, k, group, outputs):
        self.__dict__.setdefault("log", []).append((self.steps, k, [r.slot for r in group],
                                                    [r.speculating for r in group]))
        super()._cycle(k, group, outputs)


class Scripted(Logged):
    """k per step from a script (cycling; an entry k, or (k, ride): whether requests with speculation off
    ride in the cycle): the catch-up path runs at known points (the check against plain decoding off by
    default: its plain epochs would skip the script)."""

    script = (0, 0, 3, 0, 2, 0, 0, 0, 1, 3)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"plain_check": False, **kwargs})

    def pick_k(self, spec, off):
        self._calls = getattr(self, "_calls", -1) + 1
        entry = self.script[self._calls % len(self.script)]
        return entry if isinstance(entry, tuple) else (entry, False)


@pytest.mark.parametrize("engine_kind", ["fixed3", "scripted", "adaptive"])
def test_greedy_requests_joining_a_running_batch_equal_hf_greedy(pair, model, engine_kind):
    tok, base, _, prompts = pair
    n = 24
    engine = {"fixed3": lambda: Engine(model, tok, speculation=3),
              "scripted": lambda: Scripted(model, tok, ks=[0, 1, 2, 3], measure=False),
              "adaptive": lambda: Engine(model, tok, speculation="adaptive")}[engine_kind]()
    if engine_kind == "scripted":
        engine.costs.observe(0, 1, 1.0)
    # six requests, four slots: two wait; two more arrive mid-run, one of them a repeat (a prefix hit)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (n, 7, n, 13, n, 3)]
    assert len(prompts[5]) > 2 * model.options.block_size
    # (the last prompt, long, finishes first: its repeat finds its blocks)
    schedule = {0: list(zip(prompts, params)), 5: [(prompts[4], SamplingParams(max_tokens=n, ignore_eos=True))],
                30: [(prompts[5], SamplingParams(max_tokens=n, ignore_eos=True))]}
    finished, ids = run(engine, schedule)
    wanted = [p.max_tokens for p in params] + [n, n]
    everything = prompts + [prompts[4], prompts[5]]
    for rid, prompt, m in zip(ids, everything, wanted):
        assert finished[rid].token_ids == hf_greedy(base, prompt, m), rid
        assert finished[rid].finish_reason == "length"
    metrics = engine.metrics()
    assert metrics["kv_blocks_used"] == 0 and metrics["num_requests_running"] == 0
    assert metrics["generation_tokens_total"] == sum(wanted)
    assert metrics["prefix_cache_hit_tokens_total"] > 0  # the repeated prompts came after their first ones finished
    if engine_kind != "adaptive":
        assert metrics["spec_decode_num_drafts"] > 0
    else:  # the seconds between cycles, per running requests (what choose_k adds to every k's cycle)
        outside = engine.outside.measured()
        assert outside and set(outside) <= set(range(1, 5)) and min(outside.values()) >= 0
        # the probe priced a key of attention for every k and batch size (cycles at two contexts)
        slopes = engine.costs.slopes()
        assert set(slopes) == set(engine.ks) and all(set(s) == {1, 2, 4} for s in slopes.values())
    if engine_kind == "scripted":  # k > 0 after k = 0: catch-ups ran, each timed by the tokens it caught up
        catch_ups = engine.catch_ups.measured()
        assert catch_ups and min(catch_ups) >= 1 and min(catch_ups.values()) > 0
    assert sorted(engine.free_slots) == [0, 1, 2, 3]


def test_collapsed_acceptance_turns_speculation_off_and_output_stays_exact(pair, caplog):
    tok, base, _, prompts = pair
    torch.manual_seed(0)
    wrong_draft = new_draft(base, "eagle")  # untrained: its guesses are nearly never the base's
    model = eagle_fx.compile(base, wrong_draft, num_spec_tokens=3, backend="eager", max_batch_size=2, max_seq_len=256)
    engine = Scripted(model, tok, collapse_window=4, probe_after=10, measure=False)
    engine.script = (3,)  # always speculate, unless collapsed
    with caplog.at_level(logging.WARNING, logger="eagle_fx.serving"):
        finished, ids = run(engine, {0: [(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts[:2]]})
    metrics = engine.metrics()
    assert metrics["speculation_off_events_total"]["acceptance_collapse"] >= 2
    assert sum("speculation off" in r.message for r in caplog.records) == 1  # warned once
    assert metrics["spec_decode_num_drafts"] < 2 * 40  # cycles without drafts ran
    for rid, prompt in zip(ids, prompts[:2]):
        assert finished[rid].token_ids == hf_greedy(base, prompt, 40)


class WrongDrafts:
    """Test-only forced drafts: a wrong token at every draft position of the requests of one prompt
    (its acceptance collapses), the draft's own (-1) for every other request."""

    def __init__(self, prompt, reference, vocab_size):
        self.prompt, self.full, self.vocab_size = list(prompt), list(prompt) + list(reference), vocab_size

    def __call__(self, contexts, k):
        return [[(self.full[min(len(ctx) + j, len(self.full) - 1)] + 1) % self.vocab_size
                 if list(ctx[:len(self.prompt)]) == self.prompt else -1 for j in range(k)] for ctx in contexts]


@pytest.mark.parametrize("script", [((3, False),), ((3, True),), ((3, False), (3, False), (3, True))],
                         ids=["own-cycle", "rides", "both"])
def test_a_collapsed_request_rides_in_the_batch_s_cycle_or_runs_its_own(pair, model, script):
    """A request whose acceptance collapsed runs at k = 0 beside the others' k = 3 cycle, or rides in
    it (drafting, not speculated for: it stays off until its probe and collapses once); switching
    between the two catches its draft up. Every output == HF greedy."""
    tok, base, _, prompts = pair
    n = 40
    reference = hf_greedy(base, prompts[1], n)
    wrong = model.replace(forced_drafts=WrongDrafts(prompts[1], reference, base.config.vocab_size))
    engine = Scripted(wrong, tok, ks=[0, 3], collapse_window=4, probe_after=1000, measure=False)
    engine.script = script
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    finished, ids = run(engine, {0: [(p, params) for p in prompts[:3]]})
    for rid, prompt in zip(ids, prompts[:3]):
        assert finished[rid].token_ids == hf_greedy(base, prompt, n)
    assert engine.metrics()["speculation_off_events_total"]["acceptance_collapse"] == 1
    collapsed_slot = next(slots[off.index(False)] for _, _, slots, off in engine.log if False in off)
    steps_of_two_cycles = {step for step, *_ in engine.log if [s for s, *_ in engine.log].count(step) == 2}
    own = [k for step, k, slots, _ in engine.log if slots == [collapsed_slot] and step in steps_of_two_cycles]
    rode = [k for _, k, slots, off in engine.log if collapsed_slot in slots and len(slots) > 1 and False in off]
    assert all(k == 3 for k in rode)
    assert bool(own) == (script != ((3, True),)) and bool(rode) == (script != ((3, False),))
    assert engine.metrics()["kv_blocks_used"] == 0


def test_adaptive_explores_a_k_it_does_not_run_for_a_few_cycles(pair, model):
    """A k not run at the batch size for explore_every cycles runs EXPLORATION_CYCLES cycles in a row
    (the first after the switch, not measured, and MIN_SERVICE measured: what replaces the probe's cost
    there), then the cheaper k again. Costs are frozen so that k = 3 always
    prices best: every k = 0 cycle at two running requests is an exploration's (the check against plain
    decoding off: its plain epochs run k = 0 too)."""
    tok, base, _, prompts = pair
    engine = Logged(model, tok, ks=[0, 3], measure=False, explore_every=12, plain_check=False)
    for k, seconds in ((0, 1.0), (3, 1.1)):
        for size in (1, 2):
            engine.costs.observe(k, size, seconds * size)
    engine.costs.observe = lambda *args, **kwargs: None
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    finished, ids = run(engine, {0: [(p, params) for p in prompts[:2]]})
    for rid, prompt in zip(ids, prompts[:2]):
        assert finished[rid].token_ids == hf_greedy(base, prompt, 90)
    at_two = "".join(str(k) for _, k, slots, _ in engine.log if len(slots) == 2)
    explorations = [run_ for run_ in at_two.split("3") if run_]
    assert explorations and all(run_ == "0" * EXPLORATION_CYCLES for run_ in explorations), at_two


def test_adaptive_measures_a_cycle_only_when_its_k_ran_in_the_step_before(pair, model):
    """The first cycle at a k after a step without one (a switch of k, or a step of prefill alone)
    costs 20-30% more on a CPU (its weights and code out of cache): measured into choose_k's costs,
    it priced a k by its switch, so an exploration lost to whichever k ran before it. Oracle: the
    scripted ks (catch-ups and switches among 0..3); a cycle is measured iff its k ran in the step
    before, and counted as a switch cycle (/metrics) iff not; every output == HF greedy."""
    tok, base, _, prompts = pair
    engine = Scripted(model, tok, ks=[0, 1, 2, 3], measure=False)
    observed = []
    engine.costs.observe = lambda k, size, seconds, keys=0, prior=False: observed.append((k, size))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    finished, ids = run(engine, {0: [(p, params) for p in prompts[:2]]})
    for rid, prompt in zip(ids, prompts[:2]):
        assert finished[rid].token_ids == hf_greedy(base, prompt, 40)
    ks_by_step: dict[int, list] = {}
    for step, k, slots, _ in engine.log:
        ks_by_step.setdefault(step, []).append((k, len(slots)))
    assert sorted(ks_by_step) == list(range(1, len(ks_by_step) + 1))  # (no step without a cycle between)
    expected = [(k, size) for step, cycles in sorted(ks_by_step.items()) for k, size in cycles
                if k in {k_ for k_, _ in ks_by_step.get(step - 1, [])}]
    assert expected and len(expected) < len(engine.log) and observed == expected
    # the others are /metrics' switch cycles, with their seconds and their price: nothing measured (observe
    # is a recorder here), each is priced at its own seconds; the schedule's k = 0 cycles leave the draft
    # to catch up
    metrics = engine.metrics()
    assert metrics["switch_cycles_total"] == engine.switch_cycles == len(engine.log) - len(expected)
    assert metrics["switch_seconds_total"] == metrics["switch_priced_seconds_total"] > 0
    assert metrics["draft_catch_up_seconds_total"] > 0


def test_adaptive_counts_the_cycles_before_an_exploration_at_its_batch_size(pair, model):
    """explore_every counts cycles at the batch size (its bucket: sizes 1 and 2 here are their own):
    a size the batch returns to now and then is explored after explore_every cycles there, not at
    every return (counting every cycle did that: at concurrency 16, where the batch moves between a
    dozen sizes, a fifth of the cycles were explorations), and a k never run at a size after
    explore_every / FIRST_EXPLORATION. Oracle: under frozen costs that price k = 3 best every k = 0
    cycle is an exploration's, which runs EXPLORATION_CYCLES cycles in a row (at whatever sizes the batch
    takes meanwhile); each starts at a size exactly explore_every - 1 cycles at k = 3 there after the
    last k = 0 there (the first: explore_every / FIRST_EXPLORATION after the first cycle there)."""
    tok, base, _, prompts = pair
    every = 16
    engine = Logged(model, tok, ks=[0, 3], measure=False, explore_every=every, plain_check=False)
    for k, seconds in ((0, 1.0), (3, 1.1)):
        for size in (1, 2):
            engine.costs.observe(k, size, seconds * size)
    engine.costs.observe = lambda *args, **kwargs: None
    long, short = SamplingParams(max_tokens=240, ignore_eos=True), SamplingParams(max_tokens=20, ignore_eos=True)
    schedule = {0: [(prompts[0], long)], **{step: [(prompts[1 + step // 14 % 3], short)] for step in range(14, 90, 14)}}
    finished, ids = run(engine, schedule)
    for rid, (prompt, params) in zip(ids, [item for step in sorted(schedule) for item in schedule[step]]):
        assert finished[rid].token_ids == hf_greedy(base, prompt, params.max_tokens)
    explored_after_a_return, since, need, stretches, left, last_step = False, {}, {}, {}, 0, {}
    for step, k, slots, _ in engine.log:  # since: k = 3 cycles at the size since the last k = 0 there
        size = len(slots)
        since.setdefault(size, 0)
        need.setdefault(size, every // FIRST_EXPLORATION)
        stretches[size] = stretches.get(size, 0) + (last_step.get(size) != step - 1)
        last_step[size] = step
        if k == 0:
            if not left:  # an exploration starts: exactly when due at this size
                assert since[size] == need[size], (size, engine.log)
                explored_after_a_return |= stretches[size] > 1 and need[size] == every - 1
                left = EXPLORATION_CYCLES
            left -= 1
            since[size], need[size] = 0, every - 1
        else:
            assert not left, engine.log  # an exploration runs its cycles in a row
            since[size] += 1
        assert since[size] <= need[size], (size, engine.log)  # (never later than due)
    assert explored_after_a_return  # the case the count is about happened
    assert engine.metrics()["cycles_by_k"] == {str(k): [k_ for _, k_, _, _ in engine.log].count(k) for k in (0, 3)}


def test_abort_frees_blocks_and_slots_at_once(pair, model):
    tok, base, _, prompts = pair
    engine = Engine(model, tok, speculation=3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]  # 4 run, 2 wait
    for _ in range(4):
        engine.step()
    used = engine.metrics()["kv_blocks_used"]
    assert engine.abort(ids[0]) and engine.abort(ids[5])  # a running one and a waiting one
    assert not engine.abort(ids[0]) and not engine.abort("nope")
    assert engine.metrics()["kv_blocks_used"] < used
    finished, _ = run(engine, {0: []})
    assert finished[ids[0]].finish_reason == "abort" and finished[ids[5]].finish_reason == "abort"
    assert finished[ids[5]].token_ids == []
    for rid, prompt in zip(ids[1:5], prompts[1:5]):
        assert finished[rid].token_ids == hf_greedy(base, prompt, 30)
    assert engine.metrics()["kv_blocks_used"] == 0 and engine.metrics()["request_success_total"]["abort"] == 2


def test_a_full_pool_makes_requests_wait_first_come_first_served(pair):
    tok, base, draft, prompts = pair
    model = eagle_fx.compile(base, draft, num_spec_tokens=3, backend="eager", max_batch_size=4, max_seq_len=128,
                             num_blocks=5)
    engine = Engine(model, tok, speculation=3)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(prompts[4], SamplingParams(max_tokens=60))
    params = SamplingParams(max_tokens=20, ignore_eos=True)  # 2 blocks each (with the lookahead): 2 fit at a time
    ids = [engine.add_request(p, params) for p in prompts[:4]]
    engine.step()
    assert engine.num_waiting == 2 and engine.num_running == 2
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert set(order) == set(ids)
    assert engine.metrics()["kv_blocks_used"] == 0


def test_per_request_sampling_settings_seeds_and_stops(pair, model):
    tok, base, _, prompts = pair
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    hot = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    alone = run(Engine(model, tok, speculation=3), {0: [(prompts[1], hot)]})
    mixed = run(Engine(model, tok, speculation=3), {0: [(prompts[0], greedy), (prompts[1], hot), (prompts[2], hot)]})
    assert mixed[0][mixed[1][1]].token_ids == alone[0][alone[1][0]].token_ids  # same seed, other company: same draw
    assert mixed[0][mixed[1][0]].token_ids == hf_greedy(base, prompts[0], 16)  # greedy beside sampling rows
    reference = hf_greedy(base, prompts[3], 16)
    stop_id = reference[5]
    out = run(Engine(model, tok, speculation=3), {0: [(prompts[3], SamplingParams(max_tokens=16, stop_token_ids=[stop_id],
                                                                                ignore_eos=True))]})
    tokens = out[0][out[1][0]].token_ids
    assert tokens == reference[:reference.index(stop_id) + 1] and out[0][out[1][0]].finish_reason == "stop"
    full_text = tok.decode(reference, skip_special_tokens=True)
    stop = full_text[len(full_text) // 2:len(full_text) // 2 + 3]
    out = run(Engine(model, tok, speculation=3), {0: [(prompts[3], SamplingParams(max_tokens=16, stop=[stop],
                                                                                ignore_eos=True))]})
    result = out[0][out[1][0]]
    assert result.finish_reason == "stop" and result.text == full_text[:full_text.index(stop)]


def test_streamed_deltas_add_up_to_the_text_and_hold_back_a_partial_stop(pair, model):
    tok, base, _, prompts = pair
    reference = tok.decode(hf_greedy(base, prompts[2], 20), skip_special_tokens=True)
    stop = reference[-4:-1]
    engine = Engine(model, tok, speculation=3)
    rid = engine.add_request(prompts[2], SamplingParams(max_tokens=20, stop=[stop], ignore_eos=True))
    deltas = []
    while engine.has_unfinished():
        deltas += [o.delta for o in engine.step() if o.request_id == rid]
    assert "".join(deltas) == reference[:reference.index(stop)]


def test_bad_requests_are_value_errors_before_anything_runs(pair, model):
    tok, _, _, prompts = pair
    engine = Engine(model, None, speculation=3)
    for bad, match in [(([], None), "empty"), (([10**6], None), "outside the vocab"),
                       ((prompts[0], SamplingParams(max_tokens=300)), "max_seq_len"),
                       ((prompts[0], SamplingParams(stop=["x"])), "tokenizer")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(*bad)
    for field, value in [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("stop", [""]),
                         ("seed", "a")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="speculation"):
        Engine(model, speculation=5)
    assert not engine.has_unfinished()
