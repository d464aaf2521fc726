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
the plain one's tokens); the leader is the arm ahead over the last PAIRS comparisons (the geometric
mean of their ratios). Each time the trailing arm loses again its gap doubles, up to MAX_GAP; a
win halves it, and a change of leader sets it back to 1: a settled difference costs one epoch in
MAX_GAP + 1 at the slower arm, and a changed one is seen within a few of the trailing arm's epochs.
(Set back to 1 by a single win, as until stop 48, near-equal arms' noisy comparisons kept the gap at
1-2 and a third of the epochs at the trailing arm, each adaptive one paying its catch-ups: adaptive /
plain on the same compile 0.92, 0.97, 0.97 at 4, 16, 64 in flight against 0.95, 0.98, 0.98 halved.)

Which arm is faster depends on the load (speculation wins at 1 in flight and may lose at 64): each
load (requests in the engine r when an epoch starts, by the bit length of r + 1: 1-2, 3-6, 7-14,
15-30, 31-62, 63-126, ...) keeps comparisons of its own. An epoch counts in the load it started at
(the decoding requests move by a few as requests finish and prefill: split by them, a closed loop's
epochs fell into two loads in turn and were never compared).

A third arm, "full" (every speculating request at the engine's largest k, pick_k passed over,
catch-ups as adaptive's), is tried where adaptive's own choices say speculation pays: at a load
where pick_k chose the largest k in at least half of its last cycles (FULL_WINDOW, at least
FULL_MIN_CYCLES of them). There pick_k's own noise costs what it costs plain decoding elsewhere: at
1 in flight adaptive made 0.90-0.94x fixed k = 3 (stop 48). Each trailing arm has a gap, and
comparisons against the leader, of its own; the most overdue runs, and it takes the lead when its
comparisons' mean is above 0 (a tie goes to adaptive). A change of leader keeps the comparisons of
the old leader and the new one (reversed) and drops the third arm's, which were against the old
leader; every gap goes back to 1. Tried everywhere, its epochs (every request caught up, cycles at
k = 3) cost 3-4% at 4 and 64 in flight where k = 3 loses; conditioned, A/B on the same compile, 5
rounds (stop 48, README): adaptive / plain decoding 1.12 against 1.07 two-armed at 1 in flight,
0.955 against 0.960 at 4, 0.983 against 0.978 at 64.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

ADAPTIVE, PLAIN, FULL = "adaptive", "plain", "full"
ARMS = (ADAPTIVE, PLAIN, FULL)
EPOCH_SECONDS = 0.2  # an epoch's decode seconds (a few dozen cycles at 4 rows on a CPU, a dozen at 64)
PAIRS = 6  # comparisons the leader is decided over
MAX_GAP = 32  # the leader's epochs between two of a trailing arm's, at most
FULL_WINDOW, FULL_MIN_CYCLES = 64, 20  # adaptive's last cycles full is conditioned on, and how many at least


def load_of(running: int) -> int:
    """The load a step of `running` requests counts in (see the module)."""
    return (running + 1).bit_length()


def _fresh(value):
    return {arm: value() for arm in ARMS}


def _first_gaps() -> dict:  # what a load, or a new lead, starts with (each arm's)
    return _fresh(lambda: 1)


def _no_epochs() -> dict:
    return _fresh(lambda: 0)


def _no_comparisons() -> dict:
    return _fresh(lambda: deque(maxlen=PAIRS))


@dataclass
class Load:
    """One load's comparisons: which arm runs next (`arm`) and why."""

    arm: str = ADAPTIVE
    leader: str = ADAPTIVE
    # per trailing arm: it runs after `gaps` of the leader's epochs; the leader's epochs `since` its
    # last; its comparisons `against` the leader, log(its rate / the leader's)
    gaps: dict = field(default_factory=_first_gaps)
    since: dict = field(default_factory=_no_epochs)
    against: dict = field(default_factory=_no_comparisons)
    trailing: tuple | None = None  # (arm, rate) of a trailing arm's last epoch, until compared
    at_k_max: deque = field(default_factory=lambda: deque(maxlen=FULL_WINDOW))  # pick_k's last: the largest k?

    @property
    def gap(self) -> int:
        """The gap of the trailing arm of the two that are not full (plain's, or adaptive's when plain leads)."""
        return self.gaps[PLAIN if self.leader != PLAIN else ADAPTIVE]

    @property
    def ratios(self) -> list[float]:
        """log(adaptive / plain) over their last comparisons (none while full leads)."""
        if self.leader == FULL:
            return []
        return list(self.against[ADAPTIVE]) if self.leader == PLAIN else [-x for x in self.against[PLAIN]]

    @property
    def full_due(self) -> bool:
        """Whether full is tried here: pick_k chose the largest k in half of its last cycles."""
        n = len(self.at_k_max)
        return n >= FULL_MIN_CYCLES and 2 * sum(self.at_k_max) >= n

    def closed(self, rate: float) -> None:
        """An epoch of `arm` at `rate` ended: compare, and pick the next epoch's arm."""
        arm = self.arm
        if arm != self.leader:
            self.trailing = (arm, rate)
        elif self.trailing is not None:
            (other, other_rate), self.trailing = self.trailing, None
            against = self.against[other]
            against.append(math.log(other_rate / rate))
            total = sum(against)
            if total > 0 or (total == 0 and other == ADAPTIVE):
                self.leader, self.gaps, self.since, self.against = other, _first_gaps(), _no_epochs(), _no_comparisons()
                self.against[arm].extend(-x for x in against)  # (the old leader's, against the new one)
            elif other_rate > rate:  # a win of the trailing arm that left the lead where it was
                self.gaps[other] = max(1, self.gaps[other] // 2)
            else:
                self.gaps[other] = min(2 * self.gaps[other], MAX_GAP)
        if arm == self.leader:
            trailing = [a for a in ARMS if a != self.leader]
            for a in trailing:
                self.since[a] += 1
            due = [a for a in trailing if self.since[a] >= self.gaps[a] and (a != FULL or self.full_due)]
            if due:
                self.arm = max(due, key=lambda a: self.since[a] - self.gaps[a])  # (the most overdue; ties: ARMS' order)
                self.since[self.arm] = 0
                return
        self.arm = self.leader


class PlainCheck:
    """Which arm the engine's next step runs (`arm_for(in_flight)`), from the epochs' rates (`record`
    each step) and adaptive's choices (`chose`)."""

    def __init__(self, epoch_seconds: float = EPOCH_SECONDS):
        self.epoch_seconds = epoch_seconds
        self.loads: dict[int, Load] = {}
        self.epochs = dict.fromkeys(ARMS, 0)
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
        return self.loads.setdefault(self._at, Load()) if self._at is not None else Load()

    # the state of the current epoch's load (or the last one's)
    arm = property(lambda self: self._load.arm)
    leader = property(lambda self: self._load.leader)
    gap = property(lambda self: self._load.gap)
    ratios = property(lambda self: self._load.ratios)

    def chose(self, k_max: bool) -> None:
        """A cycle of the adaptive arm ran pick_k's choice: the engine's largest k (k_max) or not."""
        self._load.at_k_max.append(k_max)

    @property
    def ratio(self) -> float | None:
        """adaptive / plain at the current load over its last comparisons (geometric mean); None before
        any, and while full leads."""
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
