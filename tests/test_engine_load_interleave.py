"""bench/engine_load.step_interleaved: settings' closed loops stepped in turn, each timed by its own
steps, and no engine's measure of the time between its steps holding the others' (a fake clock,
fake engines: the oracle is the clock's arithmetic)."""
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@pytest.fixture
def engine_load(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    module = importlib.import_module("engine_load")
    clock = [0.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    return module, clock


@dataclass
class Out:
    request_id: str
    token_ids: list
    finished: bool


class FakeEngine:
    """Each step costs `step_seconds` of the clock and finishes the oldest request with its max_tokens
    tokens; like Engine, it measures the time since its last step ended as a cost of its own."""

    catch_up_seconds = 0.0

    def __init__(self, clock, step_seconds, log):
        self.clock, self.step_seconds, self.log = clock, step_seconds, log
        self.off_events, self.queue, self.gaps, self._step_ended = {}, [], [], None
        self.steps = 0

    def add_request(self, prompt, params):
        self.queue.append((f"r{len(self.queue) + self.steps}", params.max_tokens))
        return self.queue[-1][0]

    def has_unfinished(self):
        return bool(self.queue)

    def step(self):
        if self._step_ended is not None:
            self.gaps.append(self.clock[0] - self._step_ended)
        self.clock[0] += self.step_seconds
        self.steps += 1
        self.log.append(self)
        rid, n = self.queue.pop(0)
        self._step_ended = self.clock[0] if self.queue else None
        return [Out(rid, list(range(n)), True)]


class Timer:
    def clear(self):
        pass

    seconds = {"_prefill_chunk": 0.0, "_cycle": 0.0}
    cycles_by_k = {}


# the engine of each step: a turn is one step at least, then steps until the engine has run the slice
TURNS = {0.0: ["fast", "mid", "slow"] * 6,
         0.045: ["fast"] * 5 + ["mid"] * 3 + ["slow"] * 2 + ["fast"] + ["mid"] * 3 + ["slow"] * 4}


@pytest.mark.parametrize("slice_seconds", sorted(TURNS))
def test_each_setting_is_timed_by_its_own_steps(engine_load, slice_seconds):
    module, clock = engine_load
    log = []
    engines = {name: FakeEngine(clock, seconds, log) for name, seconds in
               (("slow", 0.030), ("fast", 0.010), ("mid", 0.020))}
    requests = [([1, 2], 10 + i) for i in range(6)]
    results = module.step_interleaved(engines, {name: Timer() for name in engines}, requests, 2,
                                      ["fast", "mid", "slow"], slice_seconds)
    tokens = sum(10 + i for i in range(6))
    for name, engine in engines.items():
        assert engine.steps == 6
        assert results[name]["wall_s"] == pytest.approx(6 * engine.step_seconds)
        assert results[name]["tok_s"] == pytest.approx(tokens / (6 * engine.step_seconds))
        assert results[name]["output_tokens"] == tokens
        # the others' steps between two of its own are not time it spent between its steps
        assert engine.gaps and all(gap == pytest.approx(0.0) for gap in engine.gaps)
    assert clock[0] == pytest.approx(6 * (0.030 + 0.010 + 0.020))
    names = {id(engine): name for name, engine in engines.items()}
    assert [names[id(engine)] for engine in log] == TURNS[slice_seconds]


def test_num_spec_tokens_adds_the_largest_k_and_its_ratios(engine_load):
    module, _ = engine_load
    assert module.parse_args([]).num_spec_tokens == 3
    full_arm = {3: (("adaptive full arm", "k=3"), ("adaptive", "adaptive full arm")),
                4: (("adaptive full arm", "k=4"), ("adaptive", "adaptive full arm"))}
    assert module.ratio_pairs(3) == module.RATIOS + module.EXTRA_RATIOS + full_arm[3]
    pairs = module.ratio_pairs(4)
    assert pairs[:len(module.RATIOS)] == module.RATIOS and pairs[-2:] == full_arm[4]
    assert pairs[-2 - len(module.EXTRA_RATIOS):-2] == module.EXTRA_RATIOS
    assert set(pairs) - set(module.RATIOS + module.EXTRA_RATIOS + full_arm[4]) == {("adaptive", "k=4"), ("k=4", "k=0")}
    assert module.parse_args(["--num-spec-tokens", "5"]).num_spec_tokens == 5
    with pytest.raises(SystemExit):
        module.parse_args(["--num-spec-tokens", "2"])
    assert module.parse_args(["--held-at-full"]).held_at_full and not module.parse_args([]).held_at_full
