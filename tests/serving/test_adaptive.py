"""Adaptive speculation's arithmetic against formulas: expected tokens per cycle, decayed acceptance,
cost interpolation, the choice of k, collapse detection."""
import itertools
import random
import statistics

import pytest

from eagle_fx.serving.adaptive import (DECAY, EXPLORATION_CYCLES, FIRST_EXPLORATION, HYSTERESIS, KEY_SHARE, MIN_SERVICE,
                                       PRIOR_ACCEPTANCE, PRIOR_WEIGHT, Acceptance, CollapseWatch, Exploration,
                                       SizeCosts, StepCosts, choose_k, expected_tokens, size_bucket)


def test_expected_tokens_is_the_mean_of_simulated_cycles():
    rates = [0.8, 0.6, 0.5]
    rng = random.Random(0)
    for k in range(4):
        total = 0
        for _ in range(40000):
            accepted = 0
            while accepted < k and rng.random() < rates[accepted]:
                accepted += 1
            total += accepted + 1
        assert expected_tokens(rates, k) == pytest.approx(total / 40000, abs=0.02)
    assert expected_tokens(rates, 3) == pytest.approx(1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.5)


def test_acceptance_counts_are_conditional_and_decayed():
    a = Acceptance(3)
    a.record(3, 1)  # position 0 accepted, position 1 tried and rejected, position 2 not tried
    assert a.tried == [1, 1, 0] and a.accepted == [1, 0, 0]
    a.record(2, 2)  # both drafted positions accepted
    assert a.tried == pytest.approx([DECAY + 1, DECAY + 1, 0]) and a.accepted == pytest.approx([DECAY + 1, 1, 0])
    prior = [0.5, 0.5, 0.5]
    rates = a.rates(prior)
    assert rates[2] == 0.5  # never tried: the prior
    assert rates[0] == pytest.approx((DECAY + 1 + 2 * 0.5) / (DECAY + 1 + 2))


def test_a_position_not_tried_keeps_its_estimate():
    """Cycles at k = 1 try position 0 only: positions 1 and 2 keep what k = 3 cycles measured (decaying
    them pulled k = 3's expected tokens to the prior's, so that k = 1 kept winning once it ran)."""
    a = Acceptance(3)
    for accepted in (3, 2, 3, 3, 1, 3, 2, 3) * 3:
        a.record(3, accepted)
    measured = a.rates()
    for accepted in (1, 0, 1, 1) * 10:
        a.record(1, accepted)
    after = a.rates()
    assert after[1:] == pytest.approx(measured[1:])
    assert after[0] == pytest.approx((a.accepted[0] + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (a.tried[0] + PRIOR_WEIGHT))
    assert after[0] < measured[0]


def test_costs_interpolate_between_measured_batch_sizes():
    costs = StepCosts()
    costs.observe(3, 1, 1.0)
    costs.observe(3, 4, 4.0)
    costs.observe(3, 8, 6.0)
    assert costs.cost(3, 2) == pytest.approx(2.0) and costs.cost(3, 6) == pytest.approx(5.0)
    assert costs.cost(3, 16) == pytest.approx(10.0)  # along the line through the two largest
    held = SizeCosts(extrapolate=False)  # (the draft's catch-up: a cost that decides whether it is tried)
    for size, seconds in ((1, 2.0), (4, 3.0)):
        held.observe(size, seconds)
    assert held.cost(2) == pytest.approx(2.0 + 1 / 3) and held.cost(400) == 3.0
    with pytest.raises(KeyError):
        costs.cost(1, 4)


def test_a_cost_is_the_median_of_its_last_measurements():
    costs = SizeCosts(window=5)
    for seconds in (1.0, 1.2, 40.0, 0.9, 1.1):  # one stall (a recompile elsewhere, a GC)
        costs.observe(4, seconds)
    assert costs.cost(4) == pytest.approx(1.1)
    for seconds in (2.0, 2.0, 2.0):  # the cost changed: three of five measurements say so
        costs.observe(4, seconds)
    assert costs.cost(4) == pytest.approx(2.0)
    assert not SizeCosts() and costs


def costs_from_scratch(history, batch, scale, window, extrapolate):
    """SizeCosts.cost by its definition, from every (size, seconds, prior) observed so far: per size,
    the median of its last `window` service measurements once there are MIN_SERVICE of them (or any,
    where the probe did not measure it), else the probe's median times scale; linear between sizes."""
    table = {}
    for size in sorted({h[0] for h in history}):
        service = [s for b, s, p in history if b == size and not p][-window:]
        probe = [s for b, s, p in history if b == size and p]
        table[size] = statistics.median(service) if service and (len(service) >= MIN_SERVICE or not probe) \
            else statistics.median(probe) * scale
    sizes = sorted(table)
    if batch <= sizes[0]:
        return table[sizes[0]]
    if batch >= sizes[-1]:
        if not extrapolate:
            return table[sizes[-1]]
        if len(sizes) == 1:
            return table[sizes[0]] * batch / sizes[0]
        lo, hi = sizes[-2], sizes[-1]
        return max(table[hi], table[hi] + (table[hi] - table[lo]) / (hi - lo) * (batch - hi))
    lo = max(b for b in sizes if b < batch)
    hi = min(b for b in sizes if b >= batch)
    return table[lo] + (table[hi] - table[lo]) / (hi - lo) * (batch - lo)


@pytest.mark.parametrize("extrapolate", [True, False])
def test_size_costs_kept_current_equal_their_definition(extrapolate):
    """SizeCosts updates a size's median when it is measured (pricing is a bisection): after any
    sequence of probe and service measurements it prices every size as recomputing from scratch does."""
    rng = random.Random(1)
    for trial in range(30):
        costs, history = SizeCosts(window=4, extrapolate=extrapolate), []
        for _ in range(rng.randint(1, 40)):
            size, seconds, prior = rng.choice([1, 2, 3, 4, 8, 16]), rng.uniform(0.5, 2.0), rng.random() < 0.3
            costs.observe(size, seconds, prior)
            history.append((size, seconds, prior))
            scale = rng.uniform(0.5, 2.0)
            for batch in (1, 2, 3, 5, 7, 12, 16, 40):
                assert costs.cost(batch, scale) == pytest.approx(
                    costs_from_scratch(history, batch, scale, 4, extrapolate)), (trial, history, batch)


def chosen_k(*args, **kwargs):
    """choose_k's k where the requests with speculation off cannot ride (it never says they do)."""
    k, ride = choose_k(*args, **kwargs)
    assert not ride
    return k


def brute_force_k(ks, cost, rates, num_off, outside=lambda batch: 0.0):
    best, best_rate = None, -1.0
    fixed = outside(len(rates) + num_off)
    for k in ks:
        if k == 0:
            rate = (len(rates) + num_off) / (cost(0, len(rates) + num_off) + fixed)
        else:
            seconds = cost(k, len(rates)) + (cost(0, num_off) if num_off else 0) + fixed
            rate = (sum(expected_tokens(r, k) for r in rates) + num_off) / seconds
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def test_choose_k_maximises_tokens_per_second():
    # a CPU-like cost: a cycle costs what its rows cost, plus a fixed part
    def cost(k, batch):
        return 1.0 + 0.05 * batch * (k + 1) + 0.3 * k

    costs = StepCosts()
    for k, b in itertools.product(range(4), [1, 2, 4, 8, 16, 32, 64]):
        costs.observe(k, b, cost(k, b))
    for batch, acceptance, off in itertools.product([1, 4, 16, 64], [0.2, 0.6, 0.9], [0, 3]):
        rates = [[acceptance] * 3] * batch
        assert chosen_k([0, 1, 2, 3], costs, rates, off, current=(-1, False)) == brute_force_k([0, 1, 2, 3], cost, rates, off)
    # what it implies: speculate when alone and well accepted, not when the batch is large
    assert chosen_k([0, 1, 2, 3], costs, [[0.9] * 3], 0, (-1, False)) == 3
    assert chosen_k([0, 1, 2, 3], costs, [[0.6] * 3] * 64, 0, (-1, False)) == 0


def test_choose_k_counts_a_step_s_seconds_outside_its_cycles():
    """A server's delivery of each output is paid per step whatever k runs: a larger k amortises it."""
    def cost(k, batch):
        return 1.0 + 0.05 * batch * (k + 1) + 0.3 * k

    def outside(batch):
        return 0.1 * batch

    costs, outside_costs = StepCosts(), SizeCosts()
    for k, b in itertools.product(range(4), [1, 2, 4, 8, 16, 32, 64]):
        costs.observe(k, b, cost(k, b))
        outside_costs.observe(b, outside(b))
    chosen = {}
    for batch, acceptance, off in itertools.product([1, 4, 16, 64], [0.2, 0.6, 0.9], [0, 3]):
        rates = [[acceptance] * 3] * batch
        chosen[batch, acceptance, off] = chosen_k([0, 1, 2, 3], costs, rates, off, (-1, False), outside_costs)
        assert chosen[batch, acceptance, off] == brute_force_k([0, 1, 2, 3], cost, rates, off, outside)
    assert chosen[64, 0.6, 0] > chosen_k([0, 1, 2, 3], costs, [[0.6] * 3] * 64, 0, (-1, False))  # k=0 without it


def test_choose_k_charges_the_drafts_catch_up_once_over_the_tokens_left():
    """After k = 0 cycles a k > 0 cycle first runs the draft's catch-up: time to finish the
    remaining tokens R at rate r is then catch_up + R / r, so the k > 0 rate is R / (catch_up + R / r)."""
    def cost(k, batch):
        return 1.0 + 0.05 * batch * (k + 1) + 0.3 * k

    costs = StepCosts()
    for k, b in itertools.product(range(4), [1, 2, 4, 8, 16, 32, 64]):
        costs.observe(k, b, cost(k, b))

    def brute(rates, catch_up, remaining):
        best, best_rate = None, -1.0
        for k in range(4):
            if k == 0:
                rate = len(rates) / cost(0, len(rates))
            else:
                rate = sum(expected_tokens(r, k) for r in rates) / cost(k, len(rates))
                rate = remaining / (catch_up + remaining / rate)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    for batch, acceptance, catch_up, remaining in itertools.product([1, 4, 16], [0.6, 0.9], [0.0, 0.5, 5.0, 50.0],
                                                                     [8, 64, 512]):
        rates = [[acceptance] * 3] * batch
        assert chosen_k([0, 1, 2, 3], costs, rates, 0, (-1, False), catch_up=catch_up, remaining=remaining) == \
            brute(rates, catch_up, remaining)
    alone = [[0.9] * 3]
    assert chosen_k([0, 1, 2, 3], costs, alone, 0, (-1, False)) == 3  # no catch-up: speculate
    assert chosen_k([0, 1, 2, 3], costs, alone, 0, (-1, False), catch_up=0.5, remaining=512) == 3  # repaid over many tokens
    assert chosen_k([0, 1, 2, 3], costs, alone, 0, (-1, False), catch_up=5.0, remaining=8) == 0  # not over the last few


def test_choose_k_keeps_the_current_k_within_the_hysteresis():
    costs = StepCosts()
    costs.observe(0, 1, 1.0)
    costs.observe(3, 1, 2.0)
    rates = [[1.0, HYSTERESIS - 1, 0.0]]  # k=3: 2 + (H-1) tokens in 2 s, (1 + (H-1)/2)/s; k=0: 1/s
    assert chosen_k([0, 3], costs, rates, 0, current=(0, False)) == 0
    assert chosen_k([0, 3], costs, rates, 0, current=(-1, False)) == 3



def test_costs_split_a_cycle_into_its_keys_share_and_the_rest():
    """A cycle at k of B rows reading X keys costs base_k(B) + slope_k(B) X: with the slope given,
    cycles observed at any X give back the formula at every other X (a slope between measured batch
    sizes interpolated, held at the ends); without one, keys cost nothing."""
    def base(k, b):
        return 1.0 + 0.05 * b * (k + 1)

    def slope(k, b):
        return 1e-4 * (1 + k) * (1 + b / 16)

    costs = StepCosts()
    for k, b in itertools.product([0, 3], [1, 4, 16]):
        costs.set_slope(k, b, slope(k, b))
        for keys in (b * 64, b * 512, b * 300):
            costs.observe(k, b, base(k, b) + slope(k, b) * keys, keys=keys)
    for k, b, keys in itertools.product([0, 3], [1, 4, 16], [0, 100, 5000]):
        assert costs.cost(k, b, keys=keys) == pytest.approx(base(k, b) + slope(k, b) * keys)
    assert costs.slope(3, 10) == pytest.approx((slope(3, 4) + slope(3, 16)) / 2)
    assert costs.slope(3, 64) == pytest.approx(slope(3, 16)) and costs.slope(3, 1) == pytest.approx(slope(3, 1))
    assert costs.slope(1, 4) == 0.0
    assert costs.measured()[0][4] == pytest.approx(base(0, 4)) and costs.slopes()[3][16] == pytest.approx(slope(3, 16))


def test_probe_costs_stand_scaled_by_service_until_service_replaces_them():
    """The startup probe's costs are off by a common factor: a cycle measured in service where the
    probe measured sets the factor (the median of the recent ratios) for every probe cost; at a
    (k, batch size) MIN_SERVICE cycles in service replace the probe's there."""
    def probe(k, b):
        return 1.0 + 0.1 * b * (k + 1)

    costs = StepCosts()
    for k, b, _ in itertools.product([0, 3], [1, 4], range(3)):
        costs.observe(k, b, probe(k, b), prior=True)
    assert costs.cost(3, 4) == pytest.approx(probe(3, 4))
    costs.observe(0, 4, 1.5 * probe(0, 4))  # service runs 1.5x the probe
    for k, b in itertools.product([0, 3], [1, 4]):
        assert costs.cost(k, b) == pytest.approx(1.5 * probe(k, b))
    assert costs.cost(3, 2) == pytest.approx(1.5 * (probe(3, 1) + (probe(3, 4) - probe(3, 1)) / 3))
    for _ in range(MIN_SERVICE):
        costs.observe(3, 4, 2.0 * probe(3, 4))  # (ratios now 1.5 and 2.0 x3: the median 2.0)
    assert costs.cost(3, 4) == pytest.approx(2.0 * probe(3, 4))
    assert costs.cost(0, 1) == pytest.approx(2.0 * probe(0, 1))
    assert costs.cost(0, 4) == pytest.approx(2.0 * probe(0, 4))  # one service cycle there: the probe's, scaled
    costs.observe(1, 8, 3.0)  # no probe at (1, 8): service stands from the first cycle
    assert costs.cost(1, 8) == 3.0


def test_the_service_scale_applies_to_the_probes_seconds_per_key_too():
    """The probe's whole cycle, base + slope x keys, is off from service by one factor: the ratio is
    taken over the whole cycle, and a cost the probe stands for at any keys is that factor times its
    whole cycle (scaling only the base overpriced the keys' share); a size measured in service
    gives back its seconds at the keys it ran, and its keys cost the scaled slope."""
    def probe_base(k, b):
        return 1e-3 * (1.0 + 0.2 * b * (k + 1))

    def probe_slope(k, b):
        return 1e-6 * (1 + k) * (1 + b / 32)

    costs = StepCosts()
    for k, b in itertools.product([0, 3], [1, 4, 16, 64]):
        costs.set_slope(k, b, probe_slope(k, b))
        for keys in (b * 64, b * 512):
            costs.observe(k, b, probe_base(k, b) + probe_slope(k, b) * keys, keys=keys, prior=True)
    factor = 0.66
    for _ in range(5):  # service: k = 3 at 16 rows, 16 x 300 keys, at 0.66x the probe's whole cycle
        costs.observe(3, 16, factor * (probe_base(3, 16) + probe_slope(3, 16) * 16 * 300), keys=16 * 300)
    assert costs.scale == pytest.approx(factor)
    for k, b, keys in itertools.product([0, 3], [1, 4, 64], [0, 4800, 30720]):
        assert costs.cost(k, b, keys=keys) == pytest.approx(factor * (probe_base(k, b) + probe_slope(k, b) * keys))
    for keys in (16 * 300, 16 * 100, 30720):
        assert costs.cost(3, 16, keys=keys) == pytest.approx(factor * (probe_base(3, 16) + probe_slope(3, 16) * keys))


def test_host_work_of_service_does_not_scale_what_a_key_costs():
    """Service adds costs per cycle and per row that the probe does not show (the engine's host work
    on a cycle's outputs, among others): cycles of few keys run at 1.24x the probe's whole cycle, and
    that factor is not what a key costs. A wide cycle (keys most of its price) is priced at its base
    in service plus the probe's seconds per key as measured, until cycles whose keys make KEY_SHARE
    of their price or more measure a factor of their own (a machine slower or faster than at the
    probe): then keys cost that factor."""
    def probe_base(k, b):
        return 1e-3 * (1.0 + 0.2 * b * (k + 1))

    def probe_slope(k, b):
        return 1e-6 * (1 + k) * (1 + b / 32)

    def host(b):
        return 1e-3 * (0.5 + 0.25 * b)  # seconds of a service cycle that no key pays

    costs = StepCosts()
    for k, b in itertools.product([0, 3], [1, 4, 16, 64]):
        costs.set_slope(k, b, probe_slope(k, b))
        for keys in (b * 64, b * 512):
            costs.observe(k, b, probe_base(k, b) + probe_slope(k, b) * keys, keys=keys, prior=True)
    for _ in range(5):  # short contexts: keys a small share of the price
        for b in (16, 64):
            keys = b * 32
            assert probe_slope(3, b) * keys < KEY_SHARE * (probe_base(3, b) + probe_slope(3, b) * keys)
            costs.observe(3, b, probe_base(3, b) + host(b) + probe_slope(3, b) * keys, keys=keys)
    assert costs.scale > 1.2 and costs.key_scale == 1.0  # (the whole cycles run 1.24x the probe)
    for b, keys in ((16, 0), (16, 16 * 512), (64, 0), (64, 64 * 512)):
        assert costs.cost(3, b, keys=keys) == pytest.approx(probe_base(3, b) + host(b) + probe_slope(3, b) * keys)
    factor = 0.7  # the machine now runs compute at 0.7x the probe's time: wide cycles show it
    for _ in range(MIN_SERVICE):
        keys = 64 * 512
        assert probe_slope(3, 64) * keys >= KEY_SHARE * (probe_base(3, 64) + probe_slope(3, 64) * keys)
        costs.observe(3, 64, factor * (probe_base(3, 64) + probe_slope(3, 64) * keys), keys=keys)
    assert costs.key_scale == pytest.approx(factor)


def test_a_k_the_probe_mispriced_is_corrected_by_its_cycles_at_sizes_the_probe_did_not_measure():
    """A probe disturbed by other work on the machine is off by a factor of its own at one k (seen: k = 1
    priced at twice its service cost at 48-64 rows, while k = 0 ran there at its price). Service runs
    that k only at sizes the batch passes through (56-63, once each: never the MIN_SERVICE cycles that
    replace the probe at a size, never the probe's own 64): k's factor, taken from those cycles against
    the probe interpolated at their sizes, prices it right at 64 (and everywhere); a k without MIN_SERVICE
    cycles of its own keeps every k's factor."""
    def true(k, b):
        return 1e-3 * (1.0 + 0.3 * b * (k + 1))

    off = {0: 1.0, 1: 2.0, 3: 1.0}  # the probe's error per k
    costs = StepCosts()
    for k, b, _ in itertools.product([0, 1, 3], [1, 2, 4, 8, 16, 32, 64], range(3)):
        costs.observe(k, b, off[k] * true(k, b), prior=True)
    for _ in range(10):  # k = 0 at 64 rows, at its price
        costs.observe(0, 64, true(0, 64))
    assert costs.scale == pytest.approx(1.0) and costs.cost(1, 64) == pytest.approx(2.0 * true(1, 64))
    for b in (56, 59, 61, 63, 57):
        costs.observe(1, b, true(1, b))
    assert costs.scale_for(1) == pytest.approx(0.5) and costs.scale == pytest.approx(1.0)
    for b in (1, 16, 48, 64):
        assert costs.cost(1, b) == pytest.approx(true(1, b))
        assert costs.cost(3, b) == pytest.approx(true(3, b)) and costs.cost(0, b) == pytest.approx(true(0, b))


def test_choose_k_prices_the_keys_each_cycle_reads():
    """Long contexts make every cycle dearer by the keys its rows read, which speculation amortises
    over more tokens: the choice is the brute force's over costs that include them, and a batch
    that runs k = 0 at short contexts speculates at long ones."""
    def base(k, b):
        return 1.0 + 0.05 * b * (k + 1) + 0.3 * k

    def slope(k, b):
        return 2e-4 * (1 + 0.3 * k)

    costs = StepCosts()
    for k, b in itertools.product(range(4), [1, 2, 4, 8, 16, 32, 64]):
        costs.set_slope(k, b, slope(k, b))
        costs.observe(k, b, base(k, b))
    for batch, acceptance, off, context in itertools.product([1, 4, 16], [0.3, 0.6, 0.9], [0, 3], [64, 512, 2048]):
        rates = [[acceptance] * 3] * batch
        keys = (batch * context, off * context, (batch + off) * context)

        def cost(k, b, context=context):
            return base(k, b) + slope(k, b) * b * context

        assert chosen_k([0, 1, 2, 3], costs, rates, off, (-1, False), keys=keys) == brute_force_k([0, 1, 2, 3], cost, rates, off)
    rates = [[0.6] * 3] * 64
    assert chosen_k([0, 1, 2, 3], costs, rates, 0, (-1, False), keys=(64 * 64, 0, 64 * 64)) == 0
    assert chosen_k([0, 1, 2, 3], costs, rates, 0, (-1, False), keys=(64 * 2048, 0, 64 * 2048)) > 0

def test_choose_k_lets_requests_with_speculation_off_ride_when_that_is_cheaper():
    """Requests with speculation off either run a k = 0 cycle of their own beside the speculating ones'
    cycle (paying a cycle's fixed cost for a few rows) or ride in it, drafting at their own low
    acceptance: the choice is the brute force's over both plans (each of which wins somewhere), and
    with many speculating and one off they ride."""
    def cpu_like(k, batch):  # a row costs in proportion to its tokens
        return 1.0 + 0.05 * batch * (k + 1) + 0.3 * k

    def gpu_like(k, batch):  # verifying more tokens per row costs little
        return 0.2 + 0.05 * batch * (1 + 0.2 * k) + 0.1 * k

    shapes, costs = {"cpu": cpu_like, "gpu": gpu_like}, {}
    for name, cost in shapes.items():
        costs[name] = StepCosts()
        for k, b in itertools.product(range(4), [1, 2, 4, 8, 16, 32, 64]):
            costs[name].observe(k, b, cost(k, b))

    def brute(cost, rates, off_rates, catch_up, ride_catch_up, remaining, ride_remaining):
        best, best_rate = None, -1.0
        total = len(rates) + len(off_rates)
        for k, ride in [(k, False) for k in range(4)] + [(k, True) for k in range(1, 4)]:
            if k == 0:
                rate = total / cost(0, total)
            else:
                if ride:
                    rate = sum(expected_tokens(r, k) for r in rates + off_rates) / cost(k, total)
                else:
                    rate = (sum(expected_tokens(r, k) for r in rates) + len(off_rates)) / (cost(k, len(rates))
                                                                                          + cost(0, len(off_rates)))
                left = ride_remaining if ride else remaining  # (each catch-up over the tokens it lets speculate)
                rate = left / ((ride_catch_up if ride else catch_up) + left / rate)
            if rate > best_rate:
                best, best_rate = (k, ride), rate
        return best

    plans = set()
    for name, batch, acceptance, num_off, off_acceptance, (catch_up, ride_catch_up), ride_remaining in \
            itertools.product(shapes, [1, 4, 16, 60], [0.6, 0.9], [1, 3], [0.0, 0.1, 0.5],
                              [(0.0, 0.0), (0.0, 2.0), (1.0, 3.0), (0.0, 50.0)], [64, 640]):
        rates, off_rates = [[acceptance] * 3] * batch, [[off_acceptance] * 3] * num_off
        plan = choose_k([0, 1, 2, 3], costs[name], rates, num_off, (-1, False), catch_up=catch_up, remaining=64,
                        off_rates=off_rates, ride_catch_up=ride_catch_up, ride_remaining=ride_remaining)
        assert plan == brute(shapes[name], rates, off_rates, catch_up, ride_catch_up, 64, ride_remaining)
        plans.add((plan[0] > 0, plan[1]))
        assert not choose_k([0, 1, 2, 3], costs[name], rates, num_off, (-1, False), off_rates=None)[1]  # cannot ride
    k, ride = choose_k([0, 1, 2, 3], costs["cpu"], [[0.9] * 3] * 60, 1, (-1, False), off_rates=[[0.1] * 3])
    assert k > 0 and ride
    assert plans == {(False, False), (True, False), (True, True)}


def test_size_buckets_are_runs_of_sizes_within_a_quarter_of_each_other():
    """Exploration counts a size bucket's decisions together: each size up to 4 alone, then runs of
    consecutive sizes whose largest is under 1.25x their smallest, every run with its own id."""
    groups: dict[int, list[int]] = {}
    for size in range(1, 513):
        groups.setdefault(size_bucket(size), []).append(size)
    runs = list(groups.values())
    assert [r for r in runs if r[0] <= 4] == [[1], [2], [3], [4]]
    for r in runs:
        assert r == list(range(r[0], r[-1] + 1)) and r[-1] < 1.25 * r[0], r
    for p in range(3, 9):  # four buckets per power of two
        assert len({size_bucket(size) for size in range(2 ** p, 2 ** (p + 1))}) == 4


def test_an_exploration_runs_all_its_cycles_when_the_batch_changes_bucket():
    """The batch at 56-64 rows (three buckets) moving every cycle, as at concurrency 64: each
    exploration runs EXPLORATION_CYCLES cycles in a row, so MIN_SERVICE of them are measured (the first
    after the switch is not). The engine's loop: continuing(size), else due(size), else k = 3 (the
    costs' choice); ran(k, size). Ended by a change of bucket, as before, every exploration here ran
    one cycle. Each starts exactly when due at its bucket: `every` decisions there since the k last ran
    there (a k never run there: every / FIRST_EXPLORATION)."""
    every = 16
    exploration, log = Exploration([0, 3], every), []
    sizes = itertools.cycle([64, 60, 57, 63, 58, 64, 56])  # buckets 64 | 60-63 | 56-59
    decisions, last_zero = {}, {}
    for _ in range(400):
        size = next(sizes)
        at = size_bucket(size)
        decisions[at] = decisions.get(at, 0) + 1
        k = exploration.continuing(size)
        if k is None:
            k = exploration.due(size, lambda k: True)
            if k is not None:  # starts: due at this bucket
                assert k == 0
                assert decisions[at] - last_zero.get(at, 1 + every // FIRST_EXPLORATION - every) == every
        k = 3 if k is None else k
        exploration.ran(k, size)
        if k == 0:
            last_zero[at] = decisions[at]
        log.append(k)
    runs = [len(list(group)) for k, group in itertools.groupby(log) if k == 0]
    assert len(runs) >= 5 and set(runs) == {EXPLORATION_CYCLES}


def test_collapse_needs_a_full_window_below_the_threshold():
    watch = CollapseWatch(window=4, threshold=0.2)
    assert not any(watch.record(0, 3) for _ in range(3))  # window not full yet
    assert watch.record(0, 3)
    watch.clear()
    assert not [watch.record(a, 3) for a in (3, 0, 0, 0)][-1]  # 3 of 12 = 0.25: not collapsed
    assert watch.record(0, 3)  # the 3 slid out: 0 of 12
