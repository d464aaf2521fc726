"""Adaptive speculation checked against plain decoding, in adjacent epochs of the engine's own running.

choose_k decides from prices: medians of a few noisy cycles per (k, batch size), and a k that is
not running keeps the prices it lost with (or won with). With true differences of 10-20% between
the ks, as on a CPU at 4 or 64 requests in flight, the noisiest price decides: adaptive lost 9-15% to
plain decoding there (README, stops 46-47), its cycles slower than either fixed k's and its draft
catch-ups on top. This measures what its choices deliver instead of what they are priced at.

The engine decodes in epochs of about `epoch_seconds` each, run by one of two arms: "adaptive"
(pick_k's choices, catch-ups included) or "plain" (every request at k = 0: no pick_k, no catch-up;
the draft falls behind and catches up when adaptive runs again). An epoch's rate is output tokens
per request-second: its tokens over the sum of each step's seconds times its running requests (the
batch size moves under arrivals; a request-second is what each arm serves). The arm ahead (the
leader) runs; the other runs one epoch after `gap` of the leader's, and is compared with the
leader's epoch right after it (both start with a switch, and the adaptive one pays the catch-up of
the plain one's tokens); the leader is the arm ahead over the last PAIRS comparisons (the geometric
mean of their ratios). Each time the trailing arm loses again its gap doubles, up to MAX_GAP, and
it is back to 1 when it wins or the leader changes: a settled difference costs one epoch in
MAX_GAP + 1 at the slower arm, and a changed one is seen within a few epochs. A load that moves
(the epochs' mean batch size off by more than SIZE_CHANGE from the last comparison's) starts the
comparisons afresh; a pair whose batch sizes differ by that much is not compared.
"""
from __future__ import annotations

import math
from collections import deque

ADAPTIVE, PLAIN = "adaptive", "plain"
EPOCH_SECONDS = 0.2  # an epoch's decode seconds (a few dozen cycles at 4 rows on a CPU, a dozen at 64)
PAIRS = 6  # comparisons the leader is decided over
MAX_GAP = 32  # the leader's epochs between two of the trailing arm's, at most
SIZE_CHANGE = 1.5  # mean batch sizes this far apart are another load


class PlainCheck:
    """Which arm the engine's next step runs (`arm`), from the epochs' rates (`record` each step)."""

    def __init__(self, epoch_seconds: float = EPOCH_SECONDS):
        self.epoch_seconds = epoch_seconds
        self.arm = self.leader = ADAPTIVE
        self.gap, self.since = 1, 0  # the trailing arm runs after `gap` of the leader's epochs; `since` so far
        self.ratios: deque = deque(maxlen=PAIRS)  # log(adaptive / plain) of the last comparisons
        self.epochs = {ADAPTIVE: 0, PLAIN: 0}
        self._trailing: tuple[float, float] | None = None  # (rate, size) of the trailing arm's last epoch
        self._size: float | None = None  # the mean batch size of the last comparison
        self._tokens = self._seconds = self._request_seconds = 0.0

    @property
    def ratio(self) -> float | None:
        """adaptive / plain over the last comparisons (geometric mean); None before any."""
        return math.exp(sum(self.ratios) / len(self.ratios)) if self.ratios else None

    def record(self, tokens: int, seconds: float, size: int) -> None:
        """One step of the current arm: `tokens` committed by `size` running requests in `seconds`."""
        self._tokens += tokens
        self._seconds += seconds
        self._request_seconds += seconds * size
        if self._seconds >= self.epoch_seconds:
            self._close()

    def _close(self) -> None:
        rate, size = self._tokens / self._request_seconds, self._request_seconds / self._seconds
        self._tokens = self._seconds = self._request_seconds = 0.0
        arm, trailing = self.arm, PLAIN if self.leader == ADAPTIVE else ADAPTIVE
        self.epochs[arm] += 1
        if self._size is not None and not _alike(size, self._size):
            self.ratios.clear()  # another load: compare afresh
            self.gap, self._size = 1, None
        if arm == trailing:
            self._trailing = (rate, size)
        elif self._trailing is not None:
            (other, other_size), self._trailing = self._trailing, None
            if _alike(size, other_size):
                self._compare(rate, other, size)
        if arm == self.leader and self.since + 1 >= self.gap:
            self.arm, self.since = (PLAIN if self.leader == ADAPTIVE else ADAPTIVE), 0
        else:
            self.since += arm == self.leader
            self.arm = self.leader

    def _compare(self, leader_rate: float, trailing_rate: float, size: float) -> None:
        self._size = size
        adaptive, plain = (leader_rate, trailing_rate) if self.leader == ADAPTIVE else (trailing_rate, leader_rate)
        self.ratios.append(math.log(adaptive / plain))
        leader = ADAPTIVE if sum(self.ratios) >= 0 else PLAIN
        if leader != self.leader or trailing_rate > leader_rate:
            self.leader, self.gap = leader, 1
        else:
            self.gap = min(2 * self.gap, MAX_GAP)


def _alike(a: float, b: float) -> bool:
    return max(a, b) <= SIZE_CHANGE * min(a, b)
