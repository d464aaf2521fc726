"""Adaptive speculation checked against plain decoding, in adjacent epochs of the engine's own running.

choose_k decides from prices: medians of a few noisy cycles per (k, batch size), and a k that is
not running keeps the prices it lost with (or won with). With true differences of 10-20% between
the ks, as on a CPU at 4 or 64 requests in flight, the noisiest price decides: adaptive lost 9-15% to
plain decoding there (README, stops 46-47), its cycles slower than either fixed k's and its draft
catch-ups on top. This measures what its choices deliver instead of what they are priced at.

The engine decodes in epochs of about `epoch_seconds` each, run by one of two arms: "adaptive"
(pick_k's choices, catch-ups included) or "plain" (every request at k = 0: no pick_k, no catch-up;
the draft falls behind and catches up when adaptive runs again). An epoch's rate is output tokens
per request-second: its tokens over the sum of each step's seconds times its running requests (a
request-second is what either arm serves, whatever the batch does meanwhile). The arm ahead (the
leader) runs; the other runs one epoch after `gap` of the leader's, and is compared with the
leader's epoch right after it (both start with a switch, and the adaptive one pays the catch-up of
the plain one's tokens). A trailing arm takes the lead once it is ahead by more than the noise of
its comparisons: over its last PAIRS comparisons (at least MIN_PAIRS), the mean of log(its rate /
the leader's) above its standard error. Its gap halves when it wins a comparison and is ahead on
their mean, and doubles otherwise, up to MAX_GAP; a change of leader sets every gap back to 1: a
settled difference, and a tie too, costs one epoch in MAX_GAP + 1 at the other arm, and a changed
one is seen within a few of the trailing arm's epochs. (Until stop 55 a trailing arm led as soon as
its comparisons' mean was above 0 and halved its gap at any win: under near-ties, the arms 1-5%
apart and an epoch's rate 10-25% noisy on a CPU, the lead changed every few epochs and a third to a
half of them ran a trailing arm; a simulation of the rule with the rates measured (README, stop 55)
put it 1-3% behind the new one at every load.)
(Set back to 1 by a single win, as until stop 48, near-equal arms' noisy comparisons kept the gap at
1-2 and a third of the epochs at the trailing arm, each adaptive one paying its catch-ups: adaptive /
plain on the same compile 0.92, 0.97, 0.97 at 4, 16, 64 in flight against 0.95, 0.98, 0.98 halved.)

Which arm is faster depends on the load (speculation wins at 1 in flight and may lose at 64): each
load (requests in the engine r when an epoch starts, by the bit length of r + 1: 1-2, 3-6, 7-14,
15-30, 31-62, 63-126, ...) keeps comparisons of its own. An epoch counts in the load it started at
(the decoding requests move by a few as requests finish and prefill: split by them, a closed loop's
epochs fell into two loads in turn and were never compared).

A third arm, "full" (every speculating request at the engine's largest k, pick_k passed over,
catch-ups as adaptive's), leads each load at first: fixed k = 3 was ahead of adaptive's own choices
at every load measured (stops 48-55: pick_k's noise and its switches of k cost it 4-8%), and ahead
of or level with plain decoding (stop 55: 1.05-1.12x k = 0 at 1-16 in flight, 1.00 at 64). The
arms a check runs, and which leads first, are its `arms` (the first leads). Each trailing arm has a
gap, and comparisons against the leader, of its own; the most overdue runs (ties: the arms' order).
A change of leader keeps the comparisons of the old leader and the new one (reversed) and drops the
third arm's, which were against the old leader. (Until stop 55 full was tried only where pick_k
chose the largest k in half its last cycles: at 16 and 64 in flight it rarely did, and full never
ran there while fixed k = 3 was 1.01-1.06x k = 0.)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

ADAPTIVE, PLAIN, FULL = "adaptive", "plain", "full"
ALL_ARMS = (ADAPTIVE, PLAIN, FULL)  # (the order of every per-arm dict)
ARMS = (FULL, PLAIN, ADAPTIVE)  # an engine's check: full leads first, plain is checked first
EPOCH_SECONDS = 0.2  # an epoch's decode seconds (a few dozen cycles at 4 rows on a CPU, a dozen at 64)
PAIRS = 6  # comparisons the leader is decided over
MIN_PAIRS = 3  # comparisons a trailing arm needs before it can take the lead
MAX_GAP = 32  # the leader's epochs between two of a trailing arm's, at most


def load_of(running: int) -> int:
    """The load a step of `running` requests counts in (see the module)."""
    return (running + 1).bit_length()


def _fresh(value):
    return {arm: value() for arm in ALL_ARMS}


def _first_gaps() -> dict:  # what a load, or a new lead, starts with (each arm's)
    return _fresh(lambda: 1)


def _no_epochs() -> dict:
    return _fresh(lambda: 0)


def _no_comparisons() -> dict:
    return _fresh(lambda: deque(maxlen=PAIRS))


def standard_error(values) -> float:
    """The standard error of the mean of `values` (sample standard deviation / sqrt(n)); inf below 2."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) >= 2 else math.inf


@dataclass
class Load:
    """One load's comparisons: which arm runs next (`arm`) and why. `arms`: those it runs, the first
    leading at first (and taking ties)."""

    arms: tuple = ARMS
    arm: str = ""
    leader: str = ""
    # per trailing arm: it runs after `gaps` of the leader's epochs; the leader's epochs `since` its
    # last; its comparisons `against` the leader, log(its rate / the leader's)
    gaps: dict = field(default_factory=_first_gaps)
    since: dict = field(default_factory=_no_epochs)
    against: dict = field(default_factory=_no_comparisons)
    trailing: tuple | None = None  # (arm, rate) of a trailing arm's last epoch, until compared

    def __post_init__(self):
        self.arm = self.arm or self.arms[0]
        self.leader = self.leader or self.arms[0]

    @property
    def gap(self) -> int:
        """The gap of the trailing arm of the two that are not full (plain's, or adaptive's when plain leads)."""
        return self.gaps[PLAIN if self.leader != PLAIN else ADAPTIVE]

    @property
    def ratios(self) -> list[float]:
        """log(speculation / plain) over their last comparisons: plain's against the leading arm
        (reversed) while full or adaptive leads; while plain leads, those of the speculating arm ahead on
        their mean (of those with any)."""
        if self.leader != PLAIN:
            return [-x for x in self.against[PLAIN]]
        compared = [list(self.against[a]) for a in (FULL, ADAPTIVE) if self.against[a]]
        return max(compared, key=lambda x: sum(x) / len(x), default=[])

    def closed(self, rate: float) -> None:
        """An epoch of `arm` at `rate` ended: compare, and pick the next epoch's arm."""
        arm = self.arm
        if arm != self.leader:
            self.trailing = (arm, rate)
        elif self.trailing is not None:
            (other, other_rate), self.trailing = self.trailing, None
            against = self.against[other]
            against.append(math.log(other_rate / rate))
            mean = sum(against) / len(against)
            if len(against) >= MIN_PAIRS and mean > standard_error(against):
                self.leader, self.gaps, self.since, self.against = other, _first_gaps(), _no_epochs(), _no_comparisons()
                self.against[arm].extend(-x for x in against)  # (the old leader's, against the new one)
            elif other_rate > rate and mean > 0:  # a win of an arm ahead on the mean, the lead where it was
                self.gaps[other] = max(1, self.gaps[other] // 2)
            else:
                self.gaps[other] = min(2 * self.gaps[other], MAX_GAP)
        if arm == self.leader:
            trailing = [a for a in self.arms if a != self.leader]
            for a in trailing:
                self.since[a] += 1
            due = [a for a in trailing if self.since[a] >= self.gaps[a]]
            if due:
                # the most overdue (ties: the arms' order)
                self.arm = max(due, key=lambda a: self.since[a] - self.gaps[a])
                self.since[self.arm] = 0
                return
        self.arm = self.leader


class PlainCheck:
    """Which arm the engine's next step runs (`arm_for(in_flight)`), from the epochs' rates (`record`
    each step). arms: those compared, the first leading each load at first (default: full, plain,
    adaptive)."""

    def __init__(self, epoch_seconds: float = EPOCH_SECONDS, arms: tuple = ARMS):
        if not arms or len(set(arms)) != len(arms) or not set(arms) <= set(ALL_ARMS):
            raise ValueError(f"arms must be distinct ones of {ADAPTIVE!r}, {PLAIN!r}, {FULL!r}, got {arms!r}")
        self.epoch_seconds, self.arms = epoch_seconds, tuple(arms)
        self.loads: dict[int, Load] = {}
        self.epochs = dict.fromkeys(ALL_ARMS, 0)
        self._at: int | None = None  # the load of the epoch under way (or of the last one)
        self._open = False  # an epoch is under way
        self._tokens = self._seconds = self._request_seconds = 0.0

    def arm_for(self, in_flight: int) -> str:
        """The arm of a step with `in_flight` requests in the engine (decoding, in prefill or waiting:
        a closed loop's count, steadier than the decoding ones). An epoch counts in the load it
        started at, to its end; the trailing arm's epoch of another load is not compared."""
        if not self._open:
            at, self._open = load_of(in_flight), True
            if self._at is not None and at != self._at:
                self.loads[self._at].trailing = None
            self._at = at
        return self._load.arm

    @property
    def _load(self) -> Load:
        return self.loads.setdefault(self._at, Load(self.arms)) if self._at is not None else Load(self.arms)

    # the state of the current epoch's load (or the last one's)
    arm = property(lambda self: self._load.arm)
    leader = property(lambda self: self._load.leader)
    gap = property(lambda self: self._load.gap)
    ratios = property(lambda self: self._load.ratios)

    @property
    def ratio(self) -> float | None:
        """speculation / plain at the current load over its last comparisons (geometric mean; `ratios`
        says whose); None before any."""
        ratios = self._load.ratios
        return math.exp(sum(ratios) / len(ratios)) if ratios else None

    def record(self, tokens: int, seconds: float, running: int, in_flight: int | None = None) -> None:
        """One step of arm_for(in_flight): `tokens` committed by `running` decoding requests in
        `seconds` (in_flight: the step's requests in the engine, default `running`)."""
        self.arm_for(running if in_flight is None else in_flight)
        self._tokens += tokens
        self._seconds += seconds
        self._request_seconds += seconds * running
        if self._seconds >= self.epoch_seconds:
            load = self._load
            self.epochs[load.arm] += 1
            load.closed(self._tokens / self._request_seconds)
            self._tokens = self._seconds = self._request_seconds = 0.0
            self._open = False
