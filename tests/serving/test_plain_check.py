"""PlainCheck: adaptive speculation against plain decoding in adjacent epochs (eagle_fx.serving.plain_check).

Oracles: the arm schedule its rules give for rates fed to it (each epoch one record of exactly
epoch_seconds), worked out by hand below (two-armed checks, `TWO`, for the rules of one trailing
arm; the engine's three arms, full leading first, for theirs); an engine whose full arm runs the
largest k where pick_k picks another; and an engine whose speculation is slowed (a sleep in every
cycle at k > 0) decodes at k = 0 but for one epoch in MAX_GAP + 1, every output == HF greedy."""
from __future__ import annotations

import importlib
import math
import time
from pathlib import Path

import pytest

from eagle_fx.serving import Engine, SamplingParams
from eagle_fx.serving.plain_check import ADAPTIVE, FULL, MAX_GAP, MIN_PAIRS, PAIRS, PLAIN, PlainCheck, load_of
from tests.serving.test_engine import hf_greedy, model, pair  # noqa: F401 (the same bundled pair, compiled alike)

TWO = (ADAPTIVE, PLAIN)  # a two-armed check, adaptive leading first


def schedule(check: PlainCheck, rate, epochs: int, size: int = 4) -> str:
    """Run `epochs` epochs, the arm of each from the check, its rate rate(arm, epoch) tokens per
    request-second; returns the arms as a string (a: adaptive, p: plain, f: full)."""
    arms = ""
    for epoch in range(epochs):
        arm = check.arm
        arms += arm[0]
        check.record(rate(arm, epoch) * check.epoch_seconds * size, check.epoch_seconds, size)
    return arms


def test_the_slower_arm_runs_one_epoch_after_a_gap_that_doubles_each_time_it_loses():
    check = PlainCheck(epoch_seconds=1.0, arms=TWO)
    arms = schedule(check, lambda arm, _: 100.0 if arm == PLAIN else 80.0, 80)
    # adaptive first; plain after one; plain wins its comparisons with the adaptive epochs after it
    # (its gap halved: 1) and leads at the third (MIN_PAIRS, ahead by more than their standard error,
    # 0 here); adaptive then trails, after gaps 1, 2, 4, 8, 16, 32 of plain's epochs
    assert MIN_PAIRS == 3
    expected = "apapapa" + "".join("p" * gap + "a" for gap in (1, 2, 4, 8, 16, 32))
    assert arms[:len(expected)] == expected
    assert check.leader == PLAIN and check.gap == MAX_GAP
    assert check.ratio == pytest.approx(0.8)


def test_a_faster_adaptive_keeps_the_lead_and_plain_is_checked_ever_more_rarely():
    check = PlainCheck(epoch_seconds=1.0, arms=TWO)
    arms = schedule(check, lambda arm, _: 150.0 if arm == ADAPTIVE else 100.0, 70)
    # plain checked after one; adaptive wins and plain's gap doubles: the epoch compared counts in it
    assert arms[:69] == "ap" + "".join("a" * gap + "p" for gap in (2, 4, 8, 16, 32))
    assert check.ratio == pytest.approx(1.5) and check.leader == ADAPTIVE


def test_a_win_halves_the_gap_only_while_ahead_on_the_mean_and_the_lead_moves_once_ahead_beyond_its_noise():
    """Plain 100, adaptive 80: after 13 epochs plain leads and adaptive trails at gap 4, five
    comparisons of log(0.8) in its window. Then each of adaptive's epochs runs at 150 (log 1.5 =
    0.405 against -0.223): the first two wins leave it behind on the mean of its last PAIRS
    comparisons (-0.118, -0.014): its gap doubles, 8 and 16; the third puts it ahead (+0.091) but
    within the standard error of that mean (0.140): halved, 8, the lead where it was; the fourth,
    +0.196 against 0.132, moves the lead."""
    check = PlainCheck(epoch_seconds=1.0, arms=TWO)
    slower = lambda arm, _: 100.0 if arm == PLAIN else 80.0  # noqa: E731
    assert schedule(check, slower, 13) == "apapapa" + "pa" + "ppa" + "p"
    assert check.leader == PLAIN and check.gap == 4 and len(check.ratios) == 5
    faster = lambda arm, _: 150.0 if arm == ADAPTIVE else 100.0  # noqa: E731
    gaps = []
    for _ in range(4):
        while check.arm != ADAPTIVE:
            assert schedule(check, slower, 1) == "p"
        assert schedule(check, faster, 2) == "ap"  # an adaptive epoch, compared with the plain one after it
        gaps.append(check.gap if check.leader == PLAIN else None)
    assert gaps == [8, 16, 8, None] and PAIRS == 6
    assert check.leader == ADAPTIVE and check.gap == 1


def test_a_change_of_which_arm_is_faster_is_seen_within_a_few_epochs_of_its_check():
    """Plain faster for 40 epochs, then adaptive 1.5x faster: at plain's next check of adaptive
    (its gap then 16) adaptive wins; its gap doubles while its window's mean is still behind, halves
    once ahead, and the lead moves once the mean is ahead by more than its standard error (the
    fourth win: previous test)."""
    check = PlainCheck(epoch_seconds=1.0, arms=TWO)

    def rate(arm, epoch):
        if epoch < 40:
            return 100.0 if arm == PLAIN else 80.0
        return 150.0 if arm == ADAPTIVE else 100.0
    arms = schedule(check, rate, 160)
    first_after = arms.index("a", 40)
    assert check.leader == ADAPTIVE
    # the lead moved after gaps of 32, 32 and 16 and a few alternations
    assert arms.index("aa", 40) - first_after < 3 * MAX_GAP + 2 * PAIRS
    assert arms[-20:].count("p") <= 2


def test_each_load_keeps_its_own_comparisons():
    """An epoch starting at 64 requests in flight counts in another load than 4 (comparisons of its
    own, from scratch); back at 4, its comparisons are where they were. An epoch counts in the load it
    started at, whatever the requests do meanwhile. 1 and 2 in flight are one load, and so are 3 and 4."""
    check = PlainCheck(epoch_seconds=1.0, arms=TWO)
    arms = schedule(check, lambda arm, _: 100.0 if arm == PLAIN else 80.0, 50)
    assert check.gap == MAX_GAP and check.leader == PLAIN
    assert check.arm_for(64) == ADAPTIVE and check.gap == 1 and not check.ratios
    check.record(80.0 * 64, 1.0, 64)
    assert check.arm_for(64) == PLAIN  # (64's alternation: plain after one adaptive epoch)
    check.record(100.0 * 0.5 * 60, 0.5, 60, in_flight=64)  # half an epoch at 64 in flight ...
    check.record(100.0 * 0.5 * 4, 0.5, 4, in_flight=4)  # ... and half at 4: one epoch of 64's
    assert check.arm_for(64) == ADAPTIVE  # 64's, compared with the plain one before it:
    check.record(80.0 * 64, 1.0, 64)  # (one comparison, fewer than MIN_PAIRS: the lead stays)
    assert check.leader == ADAPTIVE and check.ratio == pytest.approx(0.8) and check.gap == 1
    assert check.arm_for(4) == PLAIN and check.gap == MAX_GAP and check.ratio == pytest.approx(0.8)
    assert check.epochs == {ADAPTIVE: arms.count("a") + 2, PLAIN: arms.count("p") + 1, FULL: 0}
    assert [load_of(r) for r in (1, 2, 3, 4, 15, 16, 63, 64)] == [2, 2, 3, 3, 5, 5, 7, 7]


def test_an_epoch_is_its_tokens_per_request_second_whatever_its_steps():
    check = PlainCheck(epoch_seconds=1.0, arms=TWO)
    for size in (3, 4, 4, 4, 3):  # 0.2 s steps of 3-4 requests at 10 tokens per request-second
        check.record(10.0 * 0.2 * size, 0.2, size)
    assert check.arm == PLAIN and check.epochs == {ADAPTIVE: 1, PLAIN: 0, FULL: 0}
    for size in (4, 4, 4, 4, 4):  # plain at 12.5 per request-second
        check.record(12.5 * 0.2 * size, 0.2, size)
    for size in (4, 4, 4, 4, 4):  # adaptive again at 10: compared with the plain epoch
        check.record(10.0 * 0.2 * size, 0.2, size)
    assert check.ratio == pytest.approx(0.8) and check.leader == ADAPTIVE
    assert math.isclose(sum(check.ratios), math.log(0.8))


def test_full_leads_each_load_at_first_plain_checked_first_then_adaptive_each_with_its_own_gap():
    """The engine's check (full, plain, adaptive): full leads; plain is checked first (the arms'
    order breaks the tie of two due), adaptive next; each loses and doubles its own gap. At another
    load the same, from scratch."""
    check = PlainCheck(epoch_seconds=1.0)
    rates = {FULL: 100.0, PLAIN: 80.0, ADAPTIVE: 90.0}
    arms = schedule(check, lambda arm, _: rates[arm], 200)
    assert arms.startswith("fpfa" + "fpfa" + "ff" + "fp")
    load = check.loads[load_of(4)]
    assert check.leader == FULL and load.gaps == {ADAPTIVE: MAX_GAP, PLAIN: MAX_GAP, FULL: 1}
    assert arms[-100:].count("f") >= 100 - 2 * 100 // MAX_GAP - 2
    assert check.ratio == pytest.approx(100 / 80)  # (full, leading, over plain)
    assert schedule(check, lambda arm, _: rates[arm], 4, size=64) == "fpfa"
    with pytest.raises(ValueError, match="arms"):
        PlainCheck(arms=(FULL, FULL))


def test_a_faster_plain_takes_the_lead_from_full_after_min_pairs_comparisons():
    """full 100, plain 120, adaptive 90: plain wins each comparison (its gap halved: 1) and leads
    at its third (MIN_PAIRS); full's comparisons (reversed) kept, adaptive's (against full) dropped and started
    afresh against plain; every gap back to 1. Then full slower still, adaptive faster: adaptive
    leads again after MIN_PAIRS wins of its own."""
    check = PlainCheck(epoch_seconds=1.0)
    rates = {FULL: 100.0, PLAIN: 120.0, ADAPTIVE: 90.0}
    arms = schedule(check, lambda arm, _: rates[arm], 11)
    # plain, adaptive (loses: gap 2), plain, plain again (due with adaptive: the arms' order), and at
    # plain's third comparison (the 9th epoch) the lead moves; then full and adaptive trail plain
    assert arms == "fpfa" + "fpfp" + "f" + "pf"
    load = check.loads[load_of(4)]
    assert check.leader == PLAIN and load.gaps == {ADAPTIVE: 1, PLAIN: 1, FULL: 1}
    assert list(load.against[FULL]) == pytest.approx([math.log(100 / 120)] * MIN_PAIRS)
    assert not load.against[ADAPTIVE]
    arms = schedule(check, lambda arm, _: rates[arm], 200)
    assert check.leader == PLAIN and load.gaps == {ADAPTIVE: MAX_GAP, PLAIN: 1, FULL: MAX_GAP}
    assert check.ratio == pytest.approx(100 / 120)  # (plain leading: full, the speculating arm closer to it)
    rates[ADAPTIVE] = 150.0
    schedule(check, lambda arm, _: rates[arm], 2 * MAX_GAP + 2 * PAIRS + 2 * MAX_GAP)
    assert check.leader == ADAPTIVE


def test_the_bench_simulation_scores_a_schedule_by_its_epochs_true_rates(monkeypatch):
    """bench/plain_check_sim.py without noise: the schedule "fpfa" (first test above), the full epoch
    after the plain one paying the switch: (1.0 + 0.8 + 0.95 + 0.9) / 4; a check whose arms are all
    as fast, 1.0."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    sim = importlib.import_module("plain_check_sim")
    from eagle_fx.serving import plain_check
    rates = {FULL: 1.0, PLAIN: 0.8, ADAPTIVE: 0.9}
    assert sim.efficiency(plain_check, rates, 0.0, 4, 0.05, seed=0) == pytest.approx((1.0 + 0.8 + 0.95 + 0.9) / 4)
    assert sim.efficiency(plain_check, dict.fromkeys(rates, 2.0), 0.0, 50, 0.0, seed=0) == pytest.approx(1.0)


def arms_moved_by_hand(model, tok, seconds_per_row: dict) -> Engine:
    """An adaptive engine on `model` (its cache emptied) over the ks of `seconds_per_row`, each k's
    cycle priced at that many seconds per row for 1 and 2 rows; its check's epochs never end (the
    test sets the arms)."""
    model.kv_cache.reset()
    engine = Engine(model, tok, "adaptive", ks=sorted(seconds_per_row), measure=False, lazy_draft_prefill=True)
    engine.plain_check = PlainCheck(float("inf"), arms=(ADAPTIVE, PLAIN, FULL))  # (adaptive first)
    for k, seconds in seconds_per_row.items():
        for size in (1, 2):
            engine.costs.observe(k, size, seconds * size)
    return engine


def two_requests_until(engine: Engine, prompts, max_tokens: int, k: int):
    """Two of `prompts` (max_tokens each, no eos) added and stepped until a cycle at k ran. Returns
    their ids, {request id: its tokens} of those finished, and a step that keeps that dict."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    finished = {}

    def step():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
    while not engine.cycles_by_k[k]:
        step()
    return ids, finished, step


def test_the_engines_full_arm_runs_the_largest_k_where_pick_k_picks_another(pair, model):
    """Prices make k = 1 pick_k's choice; in epochs of the full arm every cycle runs k = 3 (catch-ups
    as needed), pick_k not asked and its last choice kept; adaptive's cycles count as not the largest
    k. Outputs == HF greedy across the arms."""
    tok, base, _, prompts = pair
    engine = arms_moved_by_hand(model, tok, {0: 1.0, 1: 0.6, 3: 1.5})
    engine.costs.observe = lambda *args, **kwargs: None
    ids, finished, step = two_requests_until(engine, prompts, 48, 1)
    load = engine.plain_check.loads[load_of(2)]
    assert engine.chosen == (1, False)
    load.arm, before = FULL, dict(engine.cycles_by_k)
    for _ in range(4):
        step()
        assert engine.current_k == 3 and engine.chosen == (1, False)
    assert engine.cycles_by_k[3] >= before[3] + 4 and engine.cycles_by_k[1] == before[1]
    load.arm = ADAPTIVE
    while engine.has_unfinished():
        step()
    for rid, prompt in zip(ids, prompts[:2]):
        assert finished[rid] == hf_greedy(base, prompt, 48)
    assert engine.metrics()["kv_blocks_used"] == 0


def test_the_engine_decodes_at_k0_when_its_speculation_is_slower(pair, model):
    """Every cycle at k > 0 slowed by a sleep: the check leads with plain, so that all but the first
    epochs and one in MAX_GAP + 1 later run at k = 0 (no pick_k, no catch-up), and the outputs stay
    HF's greedy ones across the arms' switches and the draft's catch-ups."""
    tok, base, _, prompts = pair
    model.kv_cache.reset()
    engine = Engine(model, tok, "adaptive", ks=[0, 3], measure=False, lazy_draft_prefill=True)
    engine.plain_check.epoch_seconds = 0.05
    for k, seconds in ((0, 1.0), (3, 1.1)):  # priced so that k = 3 is always pick_k's choice
        for size in (1, 2, 3):
            engine.costs.observe(k, size, seconds * size)
    engine.costs.observe = lambda *args, **kwargs: None
    slow = engine.cycles[3]

    def slowed(*args, **kwargs):
        time.sleep(0.02)
        return slow(*args, **kwargs)
    engine.cycles[3] = slowed
    arms = []
    params = SamplingParams(max_tokens=160, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts[:3]]
    finished = {}
    while engine.has_unfinished():
        arms.append(engine.plain_check.arm)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
    for rid, prompt in zip(ids, prompts[:3]):
        assert finished[rid] == hf_greedy(base, prompt, 160)
    check, three = engine.plain_check, engine.plain_check.loads[load_of(3)]  # (three in flight all along)
    assert three.leader == PLAIN and sum(three.ratios) < 0
    assert engine.cycles_by_k[0] > 3 * engine.cycles_by_k[3]
    assert engine.metrics()["plain_check_epochs_total"] == check.epochs and check.epochs[PLAIN] > check.epochs[ADAPTIVE]
    assert engine.off_events["plain_check"] >= 1 and engine.metrics()["kv_blocks_used"] == 0


def test_adaptive_resumes_its_own_choice_after_a_plain_epoch(pair, model, monkeypatch):
    """pick_k's hysteresis keeps the plan adaptive chose last, not the k = 0 of the plain epoch in
    between: from k = 0, with the requests behind the draft, the catch-up it must price kept adaptive
    at k = 0 after every plain epoch (at 1 in flight, 1304 of its 2276 cycles against 323 without
    the check). Oracle: choose_k's `current` argument; outputs == HF greedy."""
    import eagle_fx.serving.engine as engine_module

    tok, base, _, prompts = pair
    engine = arms_moved_by_hand(model, tok, {0: 1.0, 3: 1.1})
    seen, choose = [], engine_module.choose_k
    monkeypatch.setattr(engine_module, "choose_k", lambda *args: seen.append(args[4]) or choose(*args))
    ids, finished, step = two_requests_until(engine, prompts, 40, 3)
    load = engine.plain_check.loads[load_of(2)]
    load.arm = PLAIN
    for _ in range(3):
        step()
        assert engine.current_k == 0
    load.arm, seen[:] = ADAPTIVE, []
    step()
    assert seen[0] == (3, False)
    while engine.has_unfinished():
        step()
    for rid, prompt in zip(ids, prompts[:2]):
        assert finished[rid] == hf_greedy(base, prompt, 40)
