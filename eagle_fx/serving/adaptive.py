"""Adaptive speculation: which k the next cycle runs, from measured step costs and each request's
recent acceptance; and acceptance-collapse detection per request.

Expected tokens of one cycle at k for a request whose conditional acceptance at draft position i
(given positions < i accepted) is a_i:  E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i  (a greedy chain's
acceptance at position j does not depend on k). The batch's rate at k is sum_r E_r(k) / cost(k, B);
the k with the largest rate runs (k = 0: plain decoding, E = 1). Costs are the measured seconds of
one cycle (draft steps + verify + extend, host read included, and in service the engine's
bookkeeping of the cycle's outputs, which differs by k) per (k, batch size) and the keys its
attention reads (rows x table width: a cycle of long contexts costs several times one of short
ones on a CPU): measured at warm-up over powers of two, at two contexts, and kept current with every
cycle (the median of the last few, so a stall does not stick; the warm-up's stand, scaled by how
service compares with them, until cycles in service replace them); between measured sizes they are
interpolated linearly. A step also costs seconds outside its cycles that grow with its requests
and not with k (the engine loop's own work, a server's delivery of each output): measured between
cycles, they are added to every k's cycle, which is what lets a larger k amortise them. After
cycles at k = 0 the draft must catch up before the next k > 0 cycle (one draft-prefill call over
the tokens it missed): that call's measured cost, per tokens behind (held at the largest measured
past it), is charged to k > 0 once over the output tokens the running requests have left, so the
engine neither flips to speculation for a step that cannot repay it nor counts it as a cost
outside the cycles (which would favour a larger k).

Acceptance per request is kept as decayed counts per draft position (its recent trials weigh more; a
position not tried keeps its estimate), with the engine's own decayed counts over every request as
the prior of a new request (before any: PRIOR_ACCEPTANCE).
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.6  # a draft position's acceptance before anything is measured
DECAY = 0.9  # per cycle, of the acceptance counts (about the last 10 cycles weigh)
PRIOR_WEIGHT = 2.0  # how many cycles the engine-wide prior counts as, for one request
HYSTERESIS = 1.03  # another k must be this much faster than the current one to switch
MIN_SERVICE = 3  # cycles measured in service that replace the startup probe's cost at a (k, batch size)
FIRST_EXPLORATION = 8  # a k never run in a size bucket is explored after explore_every / this decisions there
EXPLORATION_CYCLES = MIN_SERVICE + 1  # an exploration's cycles: the first after the switch settles (not measured)
KEY_SHARE = 0.5  # a cycle whose keys are this share of its probe price or more measures what a key costs in service


def size_bucket(size: int) -> int:
    """The batch sizes exploration counts together: each size up to 4, then four buckets per power
    of two (16-19, 20-23, 24-27, 28-31, ...: sizes within 25% of each other, whose costs the
    interpolation of measured sizes serves alike)."""
    if size <= 4:
        return size
    bits = size.bit_length()
    return (bits << 2) | ((size >> (bits - 3)) & 3)


@dataclass
class Acceptance:
    """Decayed counts per draft position: tried[i] (position i drafted with positions < i accepted)
    and accepted[i]."""

    num_positions: int
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.tried = self.tried or [0.0] * self.num_positions
        self.accepted = self.accepted or [0.0] * self.num_positions

    def record(self, k: int, accepted: int) -> None:
        """One cycle of k drafts of which `accepted` passed. Only the positions it tried decay: a
        position not tried (past a rejection, or past a smaller k) keeps its estimate, where decaying
        it pulled the estimate to the prior in a few cycles, so that running k = 1 for a while priced
        k = 3 below what it was measured at and kept it from being chosen."""
        for i in range(min(k, accepted + 1)):  # positions 0..accepted were tried; the first `accepted` passed
            self.tried[i] = self.tried[i] * DECAY + 1.0
            self.accepted[i] = self.accepted[i] * DECAY + float(i < accepted)

    def rates(self, prior: list[float] | None = None) -> list[float]:
        """Conditional acceptance per position, pulled toward `prior` (PRIOR_WEIGHT cycles' worth)."""
        prior = prior or [PRIOR_ACCEPTANCE] * self.num_positions
        return [(a + PRIOR_WEIGHT * p) / (t + PRIOR_WEIGHT) for a, t, p in zip(self.accepted, self.tried, prior)]


def expected_tokens(rates: list[float], k: int) -> float:
    """1 + sum_{j<=k} prod_{i<=j} rates[i-1]: tokens one cycle of k drafts commits, on average."""
    total, run = 1.0, 1.0
    for a in rates[:k]:
        run *= a
        total += run
    return total


class SizeCosts:
    """Seconds of something per batch size: the median of its last `window` measurements (one stall,
    a page fault or a GC, does not move it), interpolated between measured sizes. Measurements taken
    before serving (prior=True: the startup probe's) stand for a size, times the caller's `scale`,
    until MIN_SERVICE measured in service replace them. extrapolate=False: past the largest measured
    size, its cost (an estimate that only grows when measured: what a cost that decides whether the
    thing is tried at all needs, lest a wrong line keep it from ever being measured).

    The medians are kept current by observe (a size's, when it is measured), so that cost is a
    bisection: the engine prices every candidate k before each cycle."""

    def __init__(self, window: int = 5, extrapolate: bool = True):
        self.window, self.extrapolate = window, extrapolate
        self._recent: dict[int, deque] = {}
        self._prior: dict[int, list[float]] = {}
        self._sizes: list[int] = []  # every measured size, sorted
        self._service: dict[int, float] = {}  # a size's median in service, where it stands for the size
        self._prior_median: dict[int, float] = {}
        self._prior_sizes: list[int] = []  # the sizes the probe measured, sorted

    def observe(self, batch: int, seconds: float, prior: bool = False) -> None:
        if batch not in self._recent and batch not in self._prior:
            bisect.insort(self._sizes, batch)
        if prior:
            if batch not in self._prior:
                bisect.insort(self._prior_sizes, batch)
            self._prior.setdefault(batch, []).append(seconds)
            self._prior_median[batch] = statistics.median(self._prior[batch])
        else:
            self._recent.setdefault(batch, deque(maxlen=self.window)).append(seconds)
        recent = self._recent.get(batch, ())
        if recent and (len(recent) >= MIN_SERVICE or batch not in self._prior):
            self._service[batch] = statistics.median(recent)
        else:
            self._service.pop(batch, None)

    def __bool__(self) -> bool:
        return bool(self._sizes)

    def prior(self, batch: int) -> float | None:
        """The probe's cost at this size: its median where it measured, else interpolated linearly
        between the nearest sizes it measured (held at the nearest outside them); None if it measured
        nothing."""
        if not self._prior_sizes:
            return None
        return _interpolated(self._prior_sizes, self._prior_median.__getitem__, batch, extrapolate=False)

    def _value(self, batch: int, scale: float) -> float:
        service = self._service.get(batch)
        return service if service is not None else self._prior_median[batch] * scale

    def measured(self, scale: float = 1.0) -> dict[int, float]:
        return {b: self._value(b, scale) for b in self._sizes}

    def cost(self, batch: int, scale: float = 1.0) -> float:
        """Interpolated linearly between the nearest measured sizes; past the largest, along the
        line through the two largest (never below the largest's cost), or the largest's cost
        (extrapolate=False); below the smallest, its cost."""
        if not self._sizes:
            raise KeyError("nothing measured")
        return _interpolated(self._sizes, lambda b: self._value(b, scale), batch, self.extrapolate)


def _interpolated(sizes: list[int], value, batch: int, extrapolate: bool) -> float:
    """value(b) at the sorted measured `sizes`, interpolated linearly at `batch`; below the smallest,
    its value; past the largest, along the line through the two largest (never below the largest's
    value), or the largest's value (extrapolate=False)."""
    if batch <= sizes[0]:
        return value(sizes[0])
    if batch >= sizes[-1]:
        top = value(sizes[-1])
        if not extrapolate:
            return top
        if len(sizes) == 1:
            return top * batch / sizes[0]
        lo, hi = sizes[-2], sizes[-1]
        return max(top, top + (top - value(lo)) / (hi - lo) * (batch - hi))
    at = bisect.bisect_left(sizes, batch)
    lo, hi = sizes[at - 1], sizes[at]
    low = value(lo)
    return low + (value(hi) - low) / (hi - lo) * (batch - lo)


class StepCosts:
    """Seconds of one cycle per (k, batch size, keys): a cycle's attention reads every key of its
    block table for each of its rows (keys = rows x table width in tokens, per layer), so a cycle at
    k of B rows costs base_k(B) + slope_k(B) * keys. slope_k(B) (seconds per key) is measured once,
    before serving, from cycles at two contexts (eagle_fx.serving.cost_probe); base_k(B) (a SizeCosts
    per k) is what each measured cycle costs less its keys' share, kept current in service. Without
    a slope for k (nothing measured at two contexts), keys cost nothing and base_k is the cycle.
    Both are the probe's numbers at first, and the probe is off from service by a factor
    (scale_for(k): the median of k's recent service / probe ratios once MIN_SERVICE of its cycles
    are measured, before that `scale`, every k's): a probe base stands times the factor until
    service replaces it. A key costs key_scale x slope: key_scale is the median service / probe ratio
    of the last cycles whose keys make KEY_SHARE of their probe price or more (once MIN_SERVICE of
    them; 1 before), not the whole cycles' factor. The slope unscaled overpriced keys where the machine
    ran faster than at the probe (at 64 rows, service at 0.66x the probe: a k = 3 cycle of 30720 keys
    priced 82.6 ms took 58.4); scaled by the whole cycles' factor, it overpriced them where service
    costs more than the probe on cycles whose keys are few (seen: 1.2-1.8x at 13-37 rows, key-dominated
    cycles at 1.0-1.1x; the engine's host work on a cycle's outputs, which the probe does not run, is
    about 1.5 ms of a 12 ms cycle at 16 rows, the rest not measured apart), and a 64-row cycle of
    32-block tables was priced 129 ms and took 61. Undisturbed, the
    probe is off by about one factor for every k; a probe disturbed by other work on the machine is
    off by a factor per k and per size (seen: service at 0.43x the probe, k = 1 priced at twice its
    service cost at 48-64 rows), and a batch that only passes through a size never holds it for
    the MIN_SERVICE cycles that replace the probe there: k's own factor, from its cycles at any
    size, corrects it there."""

    def __init__(self, window: int = 5):
        self.window = window
        self._by_k: dict[int, SizeCosts] = {}
        self._slopes: dict[int, SizeCosts] = {}
        self._ratios: deque = deque(maxlen=32)  # service / probe cost of recent cycles, every k's
        self._ratios_by_k: dict[int, deque] = {}  # the same, per k
        self._scales: dict[int, float] = {}  # per k: the median of its ratios, once MIN_SERVICE
        self.scale = 1.0  # what the probe's costs are multiplied by (every k's): the median of _ratios
        self._key_ratios: deque = deque(maxlen=32)  # the ratios of cycles whose keys are KEY_SHARE of their price
        # what the probe's seconds per key are multiplied by (every k's): the median of _key_ratios once
        # MIN_SERVICE, 1 before (see the class)
        self.key_scale = 1.0

    def scale_for(self, k: int) -> float:
        """What the probe's costs at k are multiplied by: the median of k's last ratios of service to
        probe, once MIN_SERVICE; before that every k's (`scale`)."""
        return self._scales.get(k, self.scale)

    def has_slope(self, k: int) -> bool:
        """Whether the probe measured k's seconds per key (cycles at two contexts)."""
        return k in self._slopes

    def set_slope(self, k: int, batch: int, seconds_per_key: float) -> None:
        self._slopes.setdefault(k, SizeCosts(self.window, extrapolate=False)).observe(batch, max(seconds_per_key, 0.0))

    def slope(self, k: int, batch: int) -> float:
        """The probe's seconds per key of a cycle at k of `batch` rows (a cycle's cost counts key_scale x
        this): interpolated between measured sizes, held at the nearest one outside them; 0 when none
        is measured."""
        slopes = self._slopes.get(k)
        return slopes.cost(batch) if slopes else 0.0

    def observe(self, k: int, batch: int, seconds: float, keys: int = 0, prior: bool = False) -> None:
        """One cycle's seconds. prior=True: the startup probe's. A cycle in service at k, when the
        probe measured k, also updates the ratio of service to probe costs (this cycle's seconds over
        the probe's whole cycle at its size and keys, base + slope x keys, its base interpolated
        between the sizes it measured), every k's and k's own, which scale every probe cost not yet
        replaced (the probe runs short bursts of cycles on dummy tokens, outside the engine's
        bookkeeping: its costs are off); and, when its keys make KEY_SHARE of that price or more,
        the ratio that scales the probe's seconds per key everywhere (key_scale)."""
        sizes = self._by_k.setdefault(k, SizeCosts(self.window))
        slope, before = self.slope(k, batch), sizes.prior(batch)
        if not prior and before is not None and before + slope * keys > 0:
            ratio, own = seconds / (before + slope * keys), self._ratios_by_k.setdefault(k, deque(maxlen=32))
            self._ratios.append(ratio)
            own.append(ratio)
            self.scale = statistics.median(self._ratios)
            if len(own) >= MIN_SERVICE:
                self._scales[k] = statistics.median(own)
            if slope * keys >= KEY_SHARE * (before + slope * keys):
                self._key_ratios.append(ratio)
                if len(self._key_ratios) >= MIN_SERVICE:
                    self.key_scale = statistics.median(self._key_ratios)
        sizes.observe(batch, seconds - (1.0 if prior else self.key_scale) * slope * keys, prior)

    def measured(self) -> dict[int, dict[int, float]]:
        """base_k(B) per k and batch size (the cycle's seconds at no keys)."""
        return {k: sizes.measured(self.scale_for(k)) for k, sizes in sorted(self._by_k.items())}

    def slopes(self) -> dict[int, dict[int, float]]:
        return {k: sizes.measured() for k, sizes in sorted(self._slopes.items())}

    def cost(self, k: int, batch: int, default: float | None = None, keys: int = 0) -> float:
        """Seconds of a cycle at k of `batch` requests reading `keys` keys per layer; nothing
        measured for k: `default`, if given."""
        if k not in self._by_k:
            if default is not None:
                return default
            raise KeyError(f"no cost measured for k={k}")
        return max(self._by_k[k].cost(batch, self.scale_for(k)) + self.key_scale * self.slope(k, batch) * keys, 0.0)


class Exploration:
    """Which k re-measures when: a k not run at the batch's size bucket (size_bucket) for `every`
    decisions there (a k never run there: for every / FIRST_EXPLORATION) runs EXPLORATION_CYCLES
    cycles in a row, so that a noisy or stale cost does not keep it out for good. The engine measures
    a cycle only when its k also ran in the step before: the first cycle after a switch costs 20-30%
    more on a CPU (its weights and code out of cache), and measured, it priced an exploration's k
    partly by that switch, so whichever k ran before kept winning; of an exploration's cycles the first
    settles and MIN_SERVICE are measured. Decisions are counted per bucket. An exploration goes on when
    the batch changes bucket meanwhile (its cycles there are measured at their own sizes and correct the
    k's probe factor, StepCosts.scale_for): ended by the change, as it was, one at 48-64 rows, where the
    batch moves between buckets every few cycles, ran only its unmeasured first cycle, learnt nothing,
    and counted as the k's run there for `every` more decisions."""

    def __init__(self, ks: list[int], every: int):
        self.ks, self.every = ks, every
        self._decisions: dict[int, int] = {}  # per bucket
        self._last_run: dict[tuple[int, int], int] = {}  # (k, bucket): the bucket's decisions when k last ran there
        self._current: tuple[int, int] | None = None  # (k, cycles left) of one under way

    def continuing(self, size: int) -> int | None:
        """Count a decision at `size`; the k of the exploration under way, if one is (at any bucket)."""
        at = size_bucket(size)
        self._decisions[at] = self._decisions.get(at, 0) + 1
        if self._current is None:
            return None
        k, left = self._current
        self._current = (k, left - 1) if left > 1 else None
        return k

    def due(self, size: int, eligible) -> int | None:
        """After continuing(size): the first k not run at the bucket for `every` decisions for which
        eligible(k), its exploration started; None if none."""
        at = size_bucket(size)
        seen = self._decisions[at]
        first = seen - self.every + self.every // FIRST_EXPLORATION  # a k never run here: as if it last ran then
        last = {k: self._last_run.setdefault((k, at), first) for k in self.ks}
        for k in self.ks:
            if seen - last[k] >= self.every and eligible(k):
                self._current = (k, EXPLORATION_CYCLES - 1)
                return k
        return None

    def ran(self, k: int, size: int) -> None:
        at = size_bucket(size)
        self._last_run[(k, at)] = self._decisions.get(at, 0)


def speculation_ks(model, speculation: str | int, ks: list[int] | None) -> list[int]:
    """The ks an engine's cycles may run: speculation="adaptive" (ks, default 0, 1 and the model's k;
    0 always among them) or a fixed k; [0] for a model without a draft. Bad settings: a ValueError."""
    k_max = model.num_spec_tokens
    if speculation == "adaptive":
        if model.static_steps:
            raise ValueError("adaptive speculation changes k per cycle; static steps fix it (backend='triton'): "
                             "pass speculation=k")
        if model.options.prefill_shift:
            raise ValueError("adaptive speculation needs the unshifted draft prefill (prefill_shift=False, the "
                             "default): the draft catches up after k = 0 cycles with it")
        # default: 0, 1 and k (each k is a compiled cycle, two with inductor: minutes of compile on a CPU)
        ks = sorted(set(ks if ks is not None else {0, min(1, k_max), k_max}))
        if not ks or ks[0] < 0 or ks[-1] > k_max:
            raise ValueError(f"ks must be within 0..{k_max} (the model's num_spec_tokens), got {ks!r}")
        if 0 not in ks:
            ks = [0] + ks
    elif isinstance(speculation, int) and not isinstance(speculation, bool) and 0 <= speculation <= k_max:
        ks = [speculation]
    else:
        raise ValueError(f"speculation must be 'adaptive' or an int k in 0..{k_max} (the model's num_spec_tokens), "
                         f"got {speculation!r}")
    if not model.speculates:
        ks = [0]
    return ks


def choose_k(ks: list[int], costs: StepCosts, spec_rates: list[list[float]], num_off: int, current: tuple[int, bool],
             outside: SizeCosts | None = None, catch_up: float = 0.0, remaining: float = 1.0,
             keys: tuple[int, int, int] = (0, 0, 0), off_rates: list[list[float]] | None = None,
             ride_catch_up: float = 0.0, priced=None, ride_remaining: float | None = None) -> tuple[int, bool]:
    """(k, ride): the k for the speculating requests (their acceptance rates `spec_rates`), and whether
    the `num_off` requests with speculation off ride in their cycle (drafting too, at their own recent
    acceptance `off_rates`; None: they cannot) rather than run a k=0 cycle of their own beside it (a
    cycle's fixed cost paid for one or two requests: with many speculating, riding is cheaper). k = 0
    runs every request in one plain cycle. outside: a step's seconds outside its cycles per running
    requests (the engine's own work per request, and a server's delivery of each output), paid whatever
    k runs, so it counts per step, as the cycle does. catch_up: seconds of the draft's catch-up a k > 0
    cycle must run first (requests that ran k = 0 cycles or whose prompt's draft prefill was deferred:
    eagle_fx.serving.draft_catch_up; ride_catch_up: the same when the off requests ride), paid once for
    the `remaining` output tokens the requests it catches up have left (ride_remaining: with the off
    requests; default remaining), the tokens it lets be speculated: seconds per token 1 / r + catch_up /
    remaining, as each request's catch-up over its own tokens comes to in steady traffic. The
    current choice is kept unless another is HYSTERESIS faster. keys: the keys per layer that the
    speculating requests' cycle, the others' cycle and one cycle of all of them read (StepCosts).
    priced(k, which): the seconds at k of the speculating requests (which = 0), the others (1) or all
    (2), when they run as several cycles (eagle_fx.serving.length_groups); default one cycle each."""
    total = len(spec_rates) + num_off
    sizes = (len(spec_rates), num_off, total)
    ride_remaining = remaining if ride_remaining is None else ride_remaining
    priced = priced or (lambda k, which: costs.cost(k, sizes[which], keys=keys[which]))
    fixed = outside.cost(total) if outside else 0.0

    def rate(k: int, ride: bool) -> float:
        if k == 0 or not spec_rates:
            return total / (priced(0, 2) + fixed)
        if ride:
            seconds = priced(k, 2) + fixed
            tokens = sum(expected_tokens(r, k) for r in spec_rates + off_rates)
        else:
            seconds = priced(k, 0) + fixed + (priced(0, 1) if num_off else 0.0)
            tokens = sum(expected_tokens(r, k) for r in spec_rates) + num_off
        tokens_per_second = tokens / seconds
        if ride:
            return tokens_per_second / (1.0 + ride_catch_up * tokens_per_second / max(ride_remaining, 1.0))
        return tokens_per_second / (1.0 + catch_up * tokens_per_second / max(remaining, 1.0))

    plans = [(k, False) for k in ks] + [(k, True) for k in ks if k > 0 and num_off and off_rates is not None]
    rates = {plan: rate(*plan) for plan in plans}
    best = max(rates, key=rates.get)
    if current in rates and rates[best] < HYSTERESIS * rates[current]:
        return current
    return best


@dataclass
class CollapseWatch:
    """One request's recent acceptance: `window` cycles of (accepted, drafted). Collapsed when the
    window is full and accepted / drafted < threshold."""

    window: int
    threshold: float
    recent: deque = field(default_factory=deque)

    def record(self, accepted: int, drafted: int) -> bool:
        """Add a cycle; True when acceptance has collapsed."""
        self.recent.append((accepted, drafted))
        if len(self.recent) > self.window:
            self.recent.popleft()
        if len(self.recent) < self.window:
            return False
        drafted_total = sum(d for _, d in self.recent)
        return drafted_total > 0 and sum(a for a, _ in self.recent) / drafted_total < self.threshold

    def clear(self) -> None:
        self.recent.clear()
