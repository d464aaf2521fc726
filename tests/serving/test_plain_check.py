"""PlainCheck: adaptive speculation against plain decoding in adjacent epochs (eagle_fx.serving.plain_check).

Oracles: the arm schedule its rules give for rates fed to it (each epoch one record of exactly
epoch_seconds), worked out by hand below; an engine whose full arm runs the largest k where pick_k
picks another; and an engine whose adaptive arm is slowed (a sleep in
every cycle at k > 0) decodes at k = 0 but for one epoch in MAX_GAP + 1, every output == HF greedy."""
from __future__ import annotations

import math
import time

import pytest

from eagle_fx.serving import Engine, SamplingParams
from eagle_fx.serving.plain_check import (ADAPTIVE, FULL, FULL_MIN_CYCLES, FULL_WINDOW, MAX_GAP, PAIRS, PLAIN,
                                          PlainCheck, load_of)
from tests.serving.test_engine import hf_greedy, model, pair  # noqa: F401 (the same bundled pair, compiled alike)


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
    check = PlainCheck(epoch_seconds=1.0)
    arms = schedule(check, lambda arm, _: 100.0 if arm == PLAIN else 80.0, 80)
    # adaptive first; plain after one; plain wins the comparison with the adaptive epoch after it and
    # leads; adaptive then trails, after gaps 1, 2, 4, 8, 16, 32 of plain's epochs
    expected = "apa" + "".join("p" * gap + "a" for gap in (1, 2, 4, 8, 16, 32))
    assert arms[:len(expected)] == expected
    assert check.leader == PLAIN and check.gap == MAX_GAP
    assert check.ratio == pytest.approx(0.8)


def test_a_faster_adaptive_keeps_the_lead_and_plain_is_checked_ever_more_rarely():
    check = PlainCheck(epoch_seconds=1.0)
    arms = schedule(check, lambda arm, _: 150.0 if arm == ADAPTIVE else 100.0, 70)
    # plain checked after one; adaptive wins and plain's gap doubles: the epoch compared counts in it
    assert arms[:69] == "ap" + "".join("a" * gap + "p" for gap in (2, 4, 8, 16, 32))
    assert check.ratio == pytest.approx(1.5) and check.leader == ADAPTIVE


def test_a_single_win_of_the_trailing_arm_halves_its_gap():
    """Plain faster, adaptive trailing at gap 32; one adaptive epoch faster than the plain one after
    it: the lead stays with plain (the mean over PAIRS comparisons) and the gap is halved, not set
    back to 1; the next loss doubles it again."""
    check = PlainCheck(epoch_seconds=1.0)
    slower = lambda arm, _: 100.0 if arm == PLAIN else 80.0  # noqa: E731
    schedule(check, slower, 70)
    assert check.leader == PLAIN and check.gap == MAX_GAP
    while check.arm != ADAPTIVE:
        schedule(check, slower, 1)
    assert schedule(check, lambda arm, _: 120.0 if arm == ADAPTIVE else 100.0, 2) == "ap"  # its win, compared
    assert check.leader == PLAIN and check.gap == MAX_GAP // 2
    arms = schedule(check, slower, MAX_GAP // 2 + 1)  # its next run (the plain epoch compared counts), a loss
    assert arms == "p" * (MAX_GAP // 2 - 1) + "ap"
    assert check.leader == PLAIN and check.gap == MAX_GAP


def test_a_change_of_which_arm_is_faster_is_seen_within_a_few_epochs_of_its_check():
    """Plain faster for 40 epochs, then adaptive 1.5x faster: at plain's next check of adaptive
    (its gap then 16) adaptive wins, its gap halves at each win and, over PAIRS comparisons, the
    lead moves."""
    check = PlainCheck(epoch_seconds=1.0)

    def rate(arm, epoch):
        if epoch < 40:
            return 100.0 if arm == PLAIN else 80.0
        return 150.0 if arm == ADAPTIVE else 100.0
    arms = schedule(check, rate, 160)
    first_after = arms.index("a", 40)
    assert check.leader == ADAPTIVE
    # the lead moved within the halved gaps (16 + 8 + 4 + ... < MAX_GAP) and a few alternations
    assert arms.index("aa", 40) - first_after < MAX_GAP + 2 * PAIRS
    assert arms[-20:].count("p") <= 2


def test_each_load_keeps_its_own_comparisons():
    """An epoch starting at 64 requests in flight counts in another load than 4 (comparisons of its
    own, from scratch); back at 4, its comparisons are where they were. An epoch counts in the load it
    started at, whatever the requests do meanwhile. 1 and 2 in flight are one load, and so are 3 and 4."""
    check = PlainCheck(epoch_seconds=1.0)
    arms = schedule(check, lambda arm, _: 100.0 if arm == PLAIN else 80.0, 40)
    assert check.gap == MAX_GAP and check.leader == PLAIN
    assert check.arm_for(64) == ADAPTIVE and check.gap == 1 and not check.ratios
    check.record(80.0 * 64, 1.0, 64)
    assert check.arm_for(64) == PLAIN  # (64's alternation: plain after one adaptive epoch)
    check.record(100.0 * 0.5 * 60, 0.5, 60, in_flight=64)  # half an epoch at 64 in flight ...
    check.record(100.0 * 0.5 * 4, 0.5, 4, in_flight=4)  # ... and half at 4: one epoch of 64's
    assert check.arm_for(64) == ADAPTIVE  # 64's, compared with the plain one before it:
    check.record(80.0 * 64, 1.0, 64)
    assert check.leader == PLAIN and check.ratio == pytest.approx(0.8) and check.gap == 1
    assert check.arm_for(4) == PLAIN and check.gap == MAX_GAP and check.ratio == pytest.approx(0.8)
    assert check.epochs == {ADAPTIVE: arms.count("a") + 2, PLAIN: arms.count("p") + 1, FULL: 0}
    assert [load_of(r) for r in (1, 2, 3, 4, 15, 16, 63, 64)] == [2, 2, 3, 3, 5, 5, 7, 7]


def test_an_epoch_is_its_tokens_per_request_second_whatever_its_steps():
    check = PlainCheck(epoch_seconds=1.0)
    for size in (3, 4, 4, 4, 3):  # 0.2 s steps of 3-4 requests at 10 tokens per request-second
        check.record(10.0 * 0.2 * size, 0.2, size)
    assert check.arm == PLAIN and check.epochs == {ADAPTIVE: 1, PLAIN: 0, FULL: 0}
    for size in (4, 4, 4, 4, 4):  # plain at 12.5 per request-second
        check.record(12.5 * 0.2 * size, 0.2, size)
    for size in (4, 4, 4, 4, 4):  # adaptive again at 10: compared with the plain epoch
        check.record(10.0 * 0.2 * size, 0.2, size)
    assert check.ratio == pytest.approx(0.8) and check.leader == PLAIN
    assert math.isclose(sum(check.ratios), math.log(0.8))


def test_full_is_tried_only_where_adaptive_chose_the_largest_k_in_half_its_last_cycles():
    check = PlainCheck(epoch_seconds=1.0)
    check.arm_for(4)
    load = check.loads[load_of(4)]
    for _ in range(FULL_MIN_CYCLES - 1):
        check.chose(True)
    assert not load.full_due  # (too few cycles)
    check.chose(True)
    assert load.full_due
    for _ in range(FULL_MIN_CYCLES):
        check.chose(False)
    assert load.full_due  # 20 of 40
    check.chose(False)
    assert not load.full_due  # 20 of 41
    for _ in range(FULL_WINDOW):
        check.chose(True)
    assert load.full_due and len(load.at_k_max) == FULL_WINDOW  # (the last FULL_WINDOW only)
    check.record(100.0 * 4, 1.0, 4)  # (an epoch at 4 ends; the next starts at 64: a load of its own)
    assert check.arm_for(64) == ADAPTIVE and not check.loads[load_of(64)].full_due and load.full_due
    # never chosen: the two arms' schedule, full never run
    arms = schedule(PlainCheck(epoch_seconds=1.0), lambda arm, _: {ADAPTIVE: 100.0, PLAIN: 80.0, FULL: 500.0}[arm], 60)
    assert "f" not in arms and arms.startswith("ap" + "aap" + "aaaap")


def test_full_takes_the_lead_when_faster_and_each_trailing_arm_keeps_its_own_gap():
    """adaptive 100, plain 80, full 120 tokens per request-second, adaptive's choices at the largest
    k: plain is checked first (ties go in the arms' order: adaptive, plain, full) and loses (its gap
    2); full, due next, wins and leads, every gap back to 1 and adaptive's comparisons (reversed)
    kept; adaptive then plain are checked, each losing and doubling its own gap."""
    check = PlainCheck(epoch_seconds=1.0)
    check.arm_for(4)
    for _ in range(FULL_MIN_CYCLES):
        check.chose(True)
    rates = {ADAPTIVE: 100.0, PLAIN: 80.0, FULL: 120.0}
    arms = schedule(check, lambda arm, _: rates[arm], 16)
    assert arms == "apaf" + "afaf" + "pfaf" + "pfff"
    load = check.loads[load_of(4)]
    assert check.leader == FULL and load.gaps[ADAPTIVE] == 4 and load.gaps[PLAIN] == 4
    assert list(load.against[ADAPTIVE]) == pytest.approx([math.log(100 / 120)] * 3)
    assert list(load.against[PLAIN]) == pytest.approx([math.log(80 / 120)] * 2)
    assert check.ratio is None  # (adaptive / plain is not what the lead is decided over now)
    arms = schedule(check, lambda arm, _: rates[arm], 200)
    assert check.leader == FULL and load.gaps == {ADAPTIVE: MAX_GAP, PLAIN: MAX_GAP, FULL: 1}
    assert arms[-100:].count("f") >= 100 - 2 * 100 // MAX_GAP - 2
    # full slower from here: adaptive's next check wins and, over its comparisons, takes the lead back
    rates[FULL] = 60.0
    schedule(check, lambda arm, _: rates[arm], 2 * MAX_GAP + 2 * PAIRS)
    assert check.leader == ADAPTIVE


def arms_moved_by_hand(model, tok, seconds_per_row: dict) -> Engine:
    """An adaptive engine on `model` (its cache emptied) over the ks of `seconds_per_row`, each k's
    cycle priced at that many seconds per row for 1 and 2 rows; its check's epochs never end (the
    test sets the arms)."""
    model.kv_cache.reset()
    engine = Engine(model, tok, "adaptive", ks=sorted(seconds_per_row), measure=False, lazy_draft_prefill=True)
    engine.plain_check.epoch_seconds = float("inf")
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
    assert engine.chosen == (1, False) and not any(load.at_k_max)
    load.arm, before = FULL, dict(engine.cycles_by_k)
    for _ in range(4):
        step()
        assert engine.current_k == 3 and engine.chosen == (1, False)
    assert engine.cycles_by_k[3] >= before[3] + 4 and engine.cycles_by_k[1] == before[1]
    assert len(load.at_k_max) == before[1]  # (full's cycles are not adaptive's choices)
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
