"""Decode cycles by context length: the running batch cut into groups of like committed lengths, each
decoded by a cycle of its own, where the cycles' measured prices say that is cheaper.

A cycle's attention reads, for every row, the keys of a table as wide as its longest row's (the
uniform attention: one gather and one masked SDPA over all rows, nothing read on the host), so one
long sequence in a batch of short ones makes every row read its width. Measured (engine alone,
bundled pair, inductor, k=3, 2 CPU cores; one cycle against the batch's two length groups as cycles
of their own): 64 rows, 60 at 100 committed tokens and 4 at 470: 115.3 ms against 36.8 + 6.5; 64
rows, 48 at 100 and 16 at 470: 104.9 against 25.8 + 16.6; 16 rows, 14 at 100 and 2 at 470: 16.0
against 7.5 + 3.1; 4 rows, 3 at 60 and 1 at 300: 3.6 against 2.8 + 1.9 (a cycle's fixed cost
outweighs the keys: one cycle). In a closed loop of held-out ShareGPT prompts (4 to 464 tokens) the
rows' tables held 2.6x (16 rows) and 5.1x (64 rows) the keys of their own contexts.

The cut: rows sorted by committed length, cut only where the table width changes (at most at the
MAX_CUTS largest steps of width); the best cut in
two by the priced sum (StepCosts: a base per batch size plus seconds per key read), then the best
cut of any part, up to MAX_GROUPS groups, each cut taken only when it saves more than MIN_SAVING of
the cycle it replaces (prices are medians of noisy cycles). Lossless: a request's tokens do not
depend on the rows it shares a cycle with (every cycle is the model's chain cycle)."""
from __future__ import annotations

from typing import Callable

from eagle_fx.runtime.scheduler import decode_width
from eagle_fx.serving.cost_probe import cycle_keys

MAX_GROUPS = 4  # cycles a step's batch is cut into, at most
MAX_CUTS = 12  # places a batch may be cut at, at most (where the width steps up most)
MIN_SAVING = 0.10  # a cut is taken when the parts' prices sum below (1 - this) x the whole's


def cut_by_width(widths: list[int], price: Callable[[int, int], float],
                 max_groups: int = MAX_GROUPS) -> list[tuple[int, int]]:
    """widths: the rows' table widths, ascending; price(lo, hi): seconds of one cycle of rows lo..hi-1
    (their table as wide as widths[hi - 1]). Returns the groups as (lo, hi) spans, in order."""
    prices: dict[tuple[int, int], float] = {}

    def priced(lo: int, hi: int) -> float:
        if (lo, hi) not in prices:
            prices[lo, hi] = price(lo, hi)
        return prices[lo, hi]

    changes = [cut for cut in range(1, len(widths)) if widths[cut] != widths[cut - 1]]
    if len(changes) > MAX_CUTS:  # (every price costs host time before each step: the largest steps of width)
        changes = sorted(sorted(changes, key=lambda cut: widths[cut - 1] - widths[cut])[:MAX_CUTS])
    spans = [(0, len(widths))]
    while len(spans) < max_groups:
        best = None  # (seconds saved, which span, where it is cut)
        for i, (lo, hi) in enumerate(spans):
            whole = priced(lo, hi)
            for cut in changes:
                if not lo < cut < hi:
                    continue
                saved = whole - priced(lo, cut) - priced(cut, hi)
                if saved > MIN_SAVING * whole and (best is None or saved > best[0]):
                    best = (saved, i, cut)
        if best is None:
            break
        _, i, cut = best
        lo, hi = spans[i]
        spans[i:i + 1] = [(lo, cut), (cut, hi)]
    return spans


def length_groups(engine, k: int, requests: list) -> list[list]:
    """`requests` (running, decoded together at k) as the groups whose cycles at k price least: one
    group unless the engine splits by length and has costs of k's cycles (the startup probe's, with
    its seconds per key), and the rows' table widths differ."""
    model, costs = engine.model, engine.costs
    if not engine.split_by_length or len(requests) < 2 or model.static_steps or not costs.has_slope(k):
        return [requests]
    requests = sorted(requests, key=lambda r: r.committed)
    widths = [decode_width(model, r.committed) for r in requests]
    if widths[0] == widths[-1]:
        return [requests]
    block_size = model.options.block_size
    spans = cut_by_width(widths, lambda lo, hi: costs.cost(k, hi - lo, keys=(hi - lo) * widths[hi - 1] * block_size))
    return [requests[lo:hi] for lo, hi in spans]


def choice_prices(engine, spec: list, off: list):
    """choose_k's `priced`: the seconds at k of the speculating requests, the others or all of them as
    the cycles they would run (each cut by the largest k's prices, the same cut for every k); None when
    the engine does not split by length (choose_k then prices one cycle each)."""
    if not engine.split_by_length:
        return None
    def cut(requests):
        return length_groups(engine, engine.ks[-1], requests)

    every = cut(spec + off)
    cuts = [cut(spec) if off else every, cut(off), every]
    return lambda k, which: sum(engine.costs.cost(k, len(g), keys=cycle_keys(engine.model, [r.committed for r in g]))
                                for g in cuts[which] if g)
