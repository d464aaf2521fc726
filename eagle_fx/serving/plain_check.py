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
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

ADAPTIVE, PLAIN = "adaptive", "plain"
EPOCH_SECONDS = 0.2  # an epoch's decode seconds (a few dozen cycles at 4 rows on a CPU, a dozen at 64)
PAIRS = 6  # comparisons the leader is decided over
MAX_GAP = 32  # the leader's epochs between two of the trailing arm's, at most


def load_of(running: int) -> int:
    """The load a step of `running` requests counts in (see the module)."""
    return (running + 1).bit_length()


@dataclass
class Load:
    """One load's comparisons: which arm runs next (`arm`) and why."""

    arm: str = ADAPTIVE
    leader: str = ADAPTIVE
    gap: int = 1  # the trailing arm runs after `gap` of the leader's epochs
    since: int = 0  # the leader's epochs since the trailing arm's last
    ratios: deque = field(default_factory=lambda: deque(maxlen=PAIRS))  # log(adaptive / plain)
    trailing: float | None = None  # the trailing arm's last epoch's rate, until compared

    def closed(self, rate: float) -> None:
        """An epoch of `arm` at `rate` ended: compare, and pick the next epoch's arm."""
        arm = self.arm
        if arm != self.leader:
            self.trailing = rate
        elif self.trailing is not None:
            other, self.trailing = self.trailing, None
            adaptive, plain = (rate, other) if arm == ADAPTIVE else (other, rate)
            self.ratios.append(math.log(adaptive / plain))
            leader = ADAPTIVE if sum(self.ratios) >= 0 else PLAIN
            if leader != self.leader:
                self.leader, self.gap = leader, 1
            elif other > rate:  # a win of the trailing arm that left the lead where it was
                self.gap = max(1, self.gap // 2)
            else:
                self.gap = min(2 * self.gap, MAX_GAP)
        if arm == self.leader and self.since + 1 >= self.gap:
            self.arm, self.since = (PLAIN if self.leader == ADAPTIVE else ADAPTIVE), 0
        else:
            self.since += arm == self.leader
            self.arm = self.leader


class PlainCheck:
    """Which arm the engine's next step runs (`arm_for(in_flight)`), from the epochs' rates (`record`
    each step)."""

    def __init__(self, epoch_seconds: float = EPOCH_SECONDS):
        self.epoch_seconds = epoch_seconds
        self.loads: dict[int, Load] = {}
        self.epochs = {ADAPTIVE: 0, PLAIN: 0}
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

    @property
    def ratio(self) -> float | None:
        """adaptive / plain at the current load over its last comparisons (geometric mean); None before any."""
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
