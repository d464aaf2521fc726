"""Length groups (eagle_fx.serving.length_groups): the cut of a batch into cycles of like context
lengths against brute force over every cut, and the engine's cycles under it against HF greedy."""
import itertools
import random

import pytest

from eagle_fx.serving import SamplingParams
from eagle_fx.serving.adaptive import StepCosts, choose_k
from eagle_fx.serving.length_groups import MAX_CUTS, MIN_SAVING, cut_by_width

from .test_engine import Logged, hf_greedy, model, pair, run  # noqa: F401 (fixtures)


def cycle_price(base: float, per_row: float, per_key: float):
    """A cycle of rows lo..hi-1 of ascending widths: a fixed part, a part per row and one per key read
    (every row reads the widest row's table): the shape StepCosts prices."""
    return lambda widths: lambda lo, hi: base + per_row * (hi - lo) + per_key * (hi - lo) * widths[hi - 1]


def price_of(spans, price):
    return sum(price(lo, hi) for lo, hi in spans)


def test_the_cut_in_two_is_the_cheapest_of_all_cuts_in_two():
    """max_groups=2: the spans' priced sum equals the least over every cut where the width changes,
    when that saves more than MIN_SAVING of one cycle, else one cycle (brute force, 300 random batches)."""
    rng = random.Random(0)
    for _ in range(300):
        widths = sorted(rng.choice([1, 2, 3, 5, 8, 30]) for _ in range(rng.randint(1, 20)))
        price = cycle_price(rng.uniform(0, 5), rng.uniform(0, 1), rng.uniform(0, 0.2))(widths)
        whole = price(0, len(widths))
        cuts = [c for c in range(1, len(widths)) if widths[c] != widths[c - 1]]
        best = min([whole] + [price(0, c) + price(c, len(widths)) for c in cuts])
        want = best if best < (1 - MIN_SAVING) * whole else whole
        spans = cut_by_width(widths, price, max_groups=2)
        assert price_of(spans, price) == pytest.approx(want)


def test_more_groups_are_contiguous_cut_at_width_changes_and_pay():
    rng = random.Random(1)
    for _ in range(200):
        widths = sorted(rng.choice([1, 2, 4, 7, 16, 31]) for _ in range(rng.randint(1, 40)))
        price = cycle_price(rng.uniform(0, 3), rng.uniform(0, 1), rng.uniform(0, 0.3))(widths)
        spans = cut_by_width(widths, price)
        assert spans[0][0] == 0 and spans[-1][1] == len(widths) and len(spans) <= 4
        assert all(a[1] == b[0] and widths[b[0]] != widths[b[0] - 1] for a, b in zip(spans, spans[1:]))
        whole = price(0, len(widths))
        if len(spans) > 1:  # each cut saved more than MIN_SAVING of the span it cut: the first, of the whole
            assert price_of(spans, price) < (1 - MIN_SAVING) * whole
        else:  # no cut in two saves that much
            assert all(price(0, c) + price(c, len(widths)) >= (1 - MIN_SAVING) * whole for c in range(1, len(widths)))
        # never worse than the best cut in two (the first cut is that one)
        two = cut_by_width(widths, price, max_groups=2)
        assert price_of(spans, price) <= price_of(two, price) + 1e-12


def test_the_measured_batches_cut_as_measured():
    """Prices fitted to the measured cycles (module docstring: k=3, 2 CPU cores): a base of 3 ms, 0.35 ms
    a row, 0.9 us a key of 16-token blocks. 60 rows at 100 tokens and 4 at 470: two cycles, the long
    rows apart; 3 rows at 60 and 1 at 300: one cycle."""
    price = cycle_price(3e-3, 0.35e-3, 0.9e-6 * 16)
    widths = [7] * 60 + [30] * 4
    assert cut_by_width(widths, price(widths)) == [(0, 60), (60, 64)]
    widths = [4] * 3 + [19]
    assert cut_by_width(widths, price(widths)) == [(0, 4)]


def test_with_more_width_changes_than_max_cuts_the_largest_steps_are_candidates():
    """40 distinct widths of short rows and 4 rows four times wider: only MAX_CUTS places are priced (the
    largest steps of width), the step to the long rows among them, and the cut in two lands there (as
    brute force over every place says)."""
    widths = list(range(1, 41)) + [160] * 4
    price = cycle_price(3.0, 0.3, 0.05)(widths)
    calls = []
    spans = cut_by_width(widths, lambda lo, hi: calls.append((lo, hi)) or price(lo, hi), max_groups=2)
    brute = min(range(1, len(widths)), key=lambda c: price(0, c) + price(c, len(widths)))
    assert spans == [(0, brute), (brute, len(widths))] and brute == 40
    assert len({c for lo, hi in calls for c in (lo, hi)} - {0, len(widths)}) == MAX_CUTS


def test_choose_k_prices_a_k_by_its_length_groups_when_given():
    """priced(k, which) replaces one cycle's price: k = 3 priced as one cycle loses to k = 0, priced
    as its (cheaper) groups it wins."""
    costs = StepCosts()
    for size in (1, 4):
        costs.observe(0, size, 1.0 * size)
        costs.observe(3, size, 3.0 * size)
    rates = [[0.8] * 3] * 4
    assert choose_k([0, 3], costs, rates, 0, (-1, False)) == (0, False)
    assert choose_k([0, 3], costs, rates, 0, (-1, False),
                    priced=lambda k, which: {0: 4.0, 3: 5.0}[k]) == (3, False)


class Lengths(Logged):
    """Logs the committed lengths of each cycle's rows too."""

    def _cycle(self, k, group, outputs):
        self.__dict__.setdefault("lengths", []).append((getattr(self, "steps", 0), [r.committed for r in group]))
        super()._cycle(k, group, outputs)


def test_the_engine_runs_length_groups_as_cycles_of_their_own_and_every_output_is_hf_greedy(pair, model):
    """Frozen prices where keys dominate: each step's batch runs as cycles of ascending lengths, some
    step as several; every output == HF greedy; split_by_length=False runs one cycle per step. The
    same for adaptive speculation (k = 3 priced cheaper per token than k = 0; it prices each k by the
    cycles it would run). A fixed-k engine that splits probes its k's costs at start (its seconds
    per key included)."""
    tok, base, _, prompts = pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    batch = [(prompts[i], params) for i in (5, 3, 0, 2)]  # a long prompt, then short ones
    for speculation, split in ((3, True), (3, False), ("adaptive", True)):
        engine = Lengths(model, tok, speculation=speculation, ks=[0, 3] if speculation == "adaptive" else None,
                         measure=False, split_by_length=split)
        for k, cost in ((3, 1e-3), (0, 2e-3)):
            for size in (1, 2, 4):
                engine.costs.set_slope(k, size, cost)
                engine.costs.observe(k, size, cost * size, prior=True)
        engine.costs.observe = lambda *args, **kwargs: None
        finished, ids = run(engine, {0: batch})
        for rid, (prompt, _) in zip(ids, batch):
            assert finished[rid].token_ids == hf_greedy(base, prompt, 40)
        by_step = {step: [lengths for s, lengths in engine.lengths if s == step] for step, _ in engine.lengths}
        if split:
            assert any(len(cycles) > 1 for cycles in by_step.values())
            for cycles in by_step.values():
                assert all(lengths == sorted(lengths) for lengths in cycles)
                if speculation == 3:  # (one group of requests: its cycles in ascending lengths)
                    flat = list(itertools.chain(*cycles))
                    assert flat == sorted(flat)
        else:
            assert all(len(cycles) == 1 for cycles in by_step.values())
    assert Logged(model, tok, speculation=3, split_by_length=True).costs.has_slope(3)
    assert not Logged(model, tok, speculation=3).costs.has_slope(3)  # (off by default: no probe at a fixed k)
