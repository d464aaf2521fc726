"""StepSignature: what each input of a step graph is, written once.

Every step graph works on one packed row of tokens (all sequences of the call back to back). Its
inputs fall in a few roles, and everything that builds, pads or exports inputs reads the role
instead of keeping a list of names of its own:

  token     one entry per packed token (the token axis is `axis`): input_ids, positions, features,
            slot_mapping, rope_positions, tree_mask
  seq       one entry per sequence of the call: block_table, spec_rows, committed_len, next_tokens,
            carry_features, tree_start
  logits    one entry per row whose logits are wanted: logits_indices
  offsets   sequence boundaries, one more than sequences: query_start_loc
  pool      persistent cache tensors the graph reads and writes: kv_pool, draft_kv_pool, spec_kv
  wave      per-wave tables shared by every call of a wave: mm_embeds

The executor (which inputs to pass), the static buffers (how to pad), `example_inputs` (warm-up and
export) and export's dynamic shapes all read these tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_fx.graph_kinds import GRAPH_KINDS


@dataclass(frozen=True)
class InputRole:
    role: str  # token | seq | logits | offsets | pool | wave
    axis: int = 0  # the axis that grows with tokens / sequences / rows
    dynamic: tuple[int, ...] = ()  # axes that are dynamic in an exported graph (default: (axis,))

    def dynamic_axes(self) -> tuple[int, ...]:
        return self.dynamic or (self.axis,)


INPUTS: dict[str, InputRole] = {
    "input_ids": InputRole("token", 1),
    "positions": InputRole("token", 1),
    "features": InputRole("token", 0),
    "slot_mapping": InputRole("token", 0),
    "rope_positions": InputRole("token", 2),
    "tree_mask": InputRole("token", 0, (0, 1)),
    "block_table": InputRole("seq", 0, (0, 1)),
    "spec_rows": InputRole("seq"),
    "committed_len": InputRole("seq"),
    "next_tokens": InputRole("seq"),
    "carry_features": InputRole("seq"),
    "tree_start": InputRole("seq"),
    "logits_indices": InputRole("logits"),
    "query_start_loc": InputRole("offsets"),
    "kv_pool": InputRole("pool", 2),
    "draft_kv_pool": InputRole("pool", 2),
    "spec_kv": InputRole("pool", 1, (1, 2)),
    "mm_embeds": InputRole("wave"),
}


@dataclass(frozen=True)
class StepSignature:
    """The inputs one step graph declares, in order, with their roles."""

    graph: str
    inputs: tuple[str, ...]

    def __post_init__(self):
        if self.graph not in GRAPH_KINDS:
            raise ValueError(f"step graph {self.graph!r} is not one of eagle_fx's graphs {tuple(GRAPH_KINDS)}")
        unknown = [n for n in self.inputs if n not in INPUTS]
        if unknown:
            raise ValueError(f"step graph {self.graph!r} takes input(s) {unknown} that eagle_fx has no role for")

    @classmethod
    def of_graph(cls, name: str, gm: torch.fx.GraphModule) -> "StepSignature":
        return cls(name, tuple(n.target for n in gm.graph.nodes if n.op == "placeholder"))

    def names(self, role: str) -> tuple[str, ...]:
        return tuple(n for n in self.inputs if INPUTS[n].role == role)

    def takes(self, name: str) -> bool:
        return name in self.inputs

    def select(self, values: dict) -> dict:
        """The declared inputs from `values` (which may hold more), in declaration order."""
        missing = [n for n in self.inputs if n not in values]
        if missing:
            raise KeyError(f"step graph {self.graph!r}: no value for input(s) {missing}")
        return {n: values[n] for n in self.inputs}

    def dynamic_shapes(self) -> dict:
        """torch.export dynamic shapes: every token, sequence, row and pool-size axis dynamic."""
        auto = torch.export.Dim.AUTO
        return {n: {axis: auto for axis in INPUTS[n].dynamic_axes()} for n in self.inputs}

    @property
    def uniform_rows(self) -> bool:
        """Every sequence of a call has the same number of rows (the decode-step graphs)."""
        return GRAPH_KINDS[self.graph].uniform_rows

    @property
    def is_base(self) -> bool:
        """The graph runs the base's layers (eagle_fx.graph_kinds)."""
        return GRAPH_KINDS[self.graph].reads_base
