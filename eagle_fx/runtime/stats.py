"""vLLM's spec-decode counters, and an opt-in profiler of the step-graph calls.

The profiler is off by default: then no timer is read and nothing synchronises with the device.
generate(profile=True) turns it on for that call: each step-graph call is timed (after the
device's queued work on a GPU, so the figures are exact) and summed per graph and per phase.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from eagle_fx.graph_kinds import GRAPH_KINDS

CHAIN_CYCLE = "chain_cycle"  # what the profiler calls a chain cycle run as one function (phase "cycle")


def phase_of(graph: str) -> str:
    """The phase a graph's time counts in (eagle_fx.graph_kinds; the draft prefill is also counted
    on its own)."""
    return "cycle" if graph == CHAIN_CYCLE else GRAPH_KINDS[graph].phase


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters (examples/offline_inference/spec_decode.py formulas)."""

    num_spec_tokens: int  # the most drafts one verify can accept (k; a tree's depth)
    draft_tokens_per_step: int | None = None  # tokens drafted per verify (k; a tree's total_tokens)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    total_num_output_tokens: int = 0
    wall_time_s: float = 0.0
    # prefix caching: prompt tokens served from cached blocks vs computed, per model
    prefix_hit_tokens_base: int = 0
    prefix_hit_tokens_draft: int = 0
    prefill_tokens_computed_base: int = 0
    prefill_tokens_computed_draft: int = 0
    # filled only by generate(profile=True): seconds in base + draft prefill, draft steps + extends,
    # verify; the draft prefill's share; and per step graph, seconds and calls
    profiled: bool = False
    time_prefill_s: float = 0.0
    time_draft_prefill_s: float = 0.0
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_cycle_s: float = 0.0  # chain cycles run as one function: draft steps + verify + acceptance + extend
    graph_time_s: dict[str, float] = field(default_factory=dict)
    graph_calls: dict[str, int] = field(default_factory=dict)
    # structured output: cycles under grammar masks, and the host's seconds filling their masks
    grammar_cycles: int = 0
    grammar_mask_s: float = 0.0

    def __post_init__(self):
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_spec_tokens
        if self.draft_tokens_per_step is None:
            self.draft_tokens_per_step = self.num_spec_tokens

    def record(self, accepted: list[int], drafted: int | None = None) -> None:
        """One verification step: `accepted[s]` tokens accepted for each sequence that had drafts,
        `drafted` tokens drafted for each (default: draft_tokens_per_step; the serving engine's k varies)."""
        for a in accepted:
            self.num_drafts += 1
            self.num_draft_tokens += self.draft_tokens_per_step if drafted is None else drafted
            self.num_accepted_tokens += a
            for j in range(a):
                self.accepted_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def acceptance_at(self) -> list[float]:
        return [c / self.num_drafts if self.num_drafts else 0.0 for c in self.accepted_per_pos]

    def merge(self, other: "SpecDecodeStats") -> None:
        """Add `other`'s counters and times to these (wall_time_s is left alone: a caller timing
        several generate calls measures its own)."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("num_spec_tokens", "draft_tokens_per_step", "wall_time_s"):
                continue
            if f.name == "profiled":
                self.profiled = mine or theirs
            elif f.name == "accepted_per_pos":
                self.accepted_per_pos = [a + b for a, b in zip(mine, theirs)]
            elif isinstance(mine, dict):
                for key, value in theirs.items():
                    mine[key] = mine.get(key, 0) + value
            else:
                setattr(self, f.name, mine + theirs)

    def profile(self) -> dict | None:
        """Seconds in prefill, draft, verify, whole chain cycles (when a cycle runs as one function:
        its draft, verify and acceptance are not split), and everything else (host work);
        None unless generate ran with profile=True."""
        if not self.profiled:
            return None
        busy = self.time_prefill_s + self.time_draft_s + self.time_verify_s + self.time_cycle_s
        return {"prefill": self.time_prefill_s, "draft": self.time_draft_s, "verify": self.time_verify_s,
                "cycle": self.time_cycle_s, "host": max(0.0, self.wall_time_s - busy)}

    def as_dict(self) -> dict:
        return {
            "total_num_output_tokens": self.total_num_output_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_at": self.acceptance_at,
            "wall_time_s": self.wall_time_s,
            "profile_s": self.profile(),
            "draft_prefill_s": self.time_draft_prefill_s,
            "graph_time_s": dict(self.graph_time_s),
            "graph_calls": dict(self.graph_calls),
            "prefix_hit_tokens_base": self.prefix_hit_tokens_base,
            "prefix_hit_tokens_draft": self.prefix_hit_tokens_draft,
            "prefill_tokens_computed_base": self.prefill_tokens_computed_base,
            "prefill_tokens_computed_draft": self.prefill_tokens_computed_draft,
            "grammar_cycles": self.grammar_cycles,
            "grammar_mask_s": self.grammar_mask_s,
        }


class Profiler:
    """Times step-graph calls into a SpecDecodeStats when enabled; does nothing otherwise."""

    def __init__(self, stats: SpecDecodeStats, enabled: bool, device: torch.device):
        self.stats, self.enabled = stats, enabled
        self.sync = enabled and device.type == "cuda"
        self.device = device
        stats.profiled = enabled

    def start(self) -> float:
        if not self.enabled:
            return 0.0
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def stop(self, graph: str, started: float) -> None:
        """Count the time since `started` for `graph` and its phase."""
        if not self.enabled:
            return
        if self.sync:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        st = self.stats
        st.graph_time_s[graph] = st.graph_time_s.get(graph, 0.0) + seconds
        st.graph_calls[graph] = st.graph_calls.get(graph, 0) + 1
        phase = phase_of(graph)
        setattr(st, f"time_{phase}_s", getattr(st, f"time_{phase}_s") + seconds)
        if graph == "draft_prefill":
            st.time_draft_prefill_s += seconds


@dataclass
class GenerateOutput:
    sequences: list[list[int]]
    stats: SpecDecodeStats
