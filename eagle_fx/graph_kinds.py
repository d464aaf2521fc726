"""The step graphs eagle_fx captures, and what each one is: the one table every other module reads.

    graph            model   rows per sequence        feature input          stats phase  shape
    base             base    ragged (prefill)         none                   prefill      chain
    verify           base    uniform (k+1)            none                   verify       chain
    draft_prefill    draft   ragged (prefill)         the base's feature     prefill      chain
    draft_extend     draft   uniform (k+1, padded)    the base's feature     draft        chain
    draft_step       draft   uniform (1)              the draft's hidden     draft        chain
    verify_tree      base    uniform (tree + root)    none                   verify       tree
    draft_tree_step  draft   uniform (top_k)          the draft's hidden     draft        tree

Uniform rows: every sequence of a call has the same number of rows, so the graph's attention runs
device-side only (mark_uniform_queries, or tree attention by construction). The feature input is
the width of the `features` / `carry_features` inputs: none, the base's feature (the draft's fc
input, PairSpec.feature_dim) or the draft's own hidden state (fed back by a draft step).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FeatureInput(StrEnum):
    """What a graph's `features` input holds (its width: PairSpec.feature_width)."""

    NONE = "none"
    BASE_FEATURE = "base_feature"  # the base's feature (EAGLE-1: last hidden state; EAGLE-3: aux layers)
    DRAFT_HIDDEN = "draft_hidden"  # the draft's own output hidden state


@dataclass(frozen=True)
class GraphKind:
    """One step graph's properties.

    name: the graph's name (StepGraphs attribute, callables key, exported file stem).
    reads_base: runs the base's layers (its pool is the base's); else the draft's.
    uniform_rows: every sequence of a call has the same number of rows (device-side attention).
    feature_input: what its `features` input holds.
    phase: the SpecDecodeStats phase its time counts in (prefill | draft | verify).
    tree: one of the EAGLE-2 draft-tree graphs (a copy of `tree_copy_of` with tree attention).
    all_logits: its calls want logits at every row (a verify), not at each sequence's last one.
    """

    name: str
    reads_base: bool
    uniform_rows: bool
    feature_input: FeatureInput
    phase: str
    tree: bool = False
    tree_copy_of: str | None = None
    all_logits: bool = False


GRAPH_KINDS: dict[str, GraphKind] = {kind.name: kind for kind in (
    GraphKind("base", reads_base=True, uniform_rows=False, feature_input=FeatureInput.NONE, phase="prefill"),
    GraphKind("verify", reads_base=True, uniform_rows=True, feature_input=FeatureInput.NONE, phase="verify",
              all_logits=True),
    GraphKind("draft_prefill", reads_base=False, uniform_rows=False, feature_input=FeatureInput.BASE_FEATURE,
              phase="prefill"),
    GraphKind("draft_extend", reads_base=False, uniform_rows=True, feature_input=FeatureInput.BASE_FEATURE,
              phase="draft"),
    GraphKind("draft_step", reads_base=False, uniform_rows=True, feature_input=FeatureInput.DRAFT_HIDDEN,
              phase="draft"),
    GraphKind("verify_tree", reads_base=True, uniform_rows=True, feature_input=FeatureInput.NONE, phase="verify",
              tree=True, tree_copy_of="base", all_logits=True),
    GraphKind("draft_tree_step", reads_base=False, uniform_rows=True, feature_input=FeatureInput.DRAFT_HIDDEN,
              phase="draft", tree=True, tree_copy_of="draft_step"),
)}

CHAIN_GRAPHS = tuple(name for name, kind in GRAPH_KINDS.items() if not kind.tree)  # every capture has these
TREE_GRAPHS = tuple(name for name, kind in GRAPH_KINDS.items() if kind.tree)  # with draft_tree only
# the draft graphs exported from a DraftStep module (the tree step is a copy of draft_step)
DRAFT_GRAPHS = tuple(name for name in CHAIN_GRAPHS if not GRAPH_KINDS[name].reads_base)
