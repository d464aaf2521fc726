"""EAGLE-2 dynamic draft trees: the shape, re-ranking and the tree mask (growth: eagle_fx.runtime.proposer;
acceptance along a tree: eagle_fx.runtime.verifier).

A tree is grown from the draft's distribution after the last committed token (the root, which is
the pending token the verify starts with):

  layer 1: the top_k tokens of the root's draft distribution, scored by their log-probability;
  layer d+1 (d = 1..depth-1): the draft runs one step on the top_k best nodes of layer d (by
      cumulative log-probability, each attending to its ancestors only), and each of them gets its
      top_k tokens as children, scored parent score + log-probability;
  re-rank: of all top_k + (depth-1) * top_k**2 candidates, the total_tokens with the highest
      cumulative log-probability form the tree (ties: the earlier candidate). A child never scores
      above its parent (log-probabilities are <= 0), so every kept node's parent is kept.

The scores are log-probabilities of the draft's distribution at `score_temperature` (1.0: EAGLE-2's
scores). They only rank nodes across the tree (a node's top_k children are the same at any
temperature); a draft whose confidence understates how often its argmax is the base's (the
bundled tiny drafts: top-1 probability 0.12 on average, top-1 right 83% of the time) ranks deep
nodes too low, and a temperature < 1 calibrates it for greedy verification.

The verify runs the base on [root, nodes in candidate order] (total_tokens + 1 rows) with the tree
mask: node i sees the root, its ancestors and itself. Acceptance walks down from the root: greedy,
the child whose token is the base's argmax; sampled, each child (in order) is accepted with
probability p(x) / (remaining mass of p) and zeroed from p when rejected, and when none is accepted
the next token is drawn from what is left of p (speculative rejection with a deterministic draft,
as in SafeAILab EAGLE's evaluate_posterior). The output is distributed exactly as the base's own
sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """top_k: children per expanded node and nodes expanded per layer; depth: tree layers (the most
    drafts one verify can accept, as num_spec_tokens for a chain); total_tokens: tree nodes verified
    besides the root (the verify is total_tokens + 1 rows per sequence)."""

    top_k: int
    depth: int
    total_tokens: int
    score_temperature: float = 1.0

    @classmethod
    def of(cls, value) -> "DraftTree":
        if isinstance(value, DraftTree):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"draft_tree must be a dict(top_k=, depth=, total_tokens=) or None, got {value!r}")
        keys = {"top_k", "depth", "total_tokens"}
        if not keys <= set(value) <= keys | {"score_temperature"}:
            raise ValueError(f"draft_tree takes the keys {sorted(keys)} (and optionally score_temperature); got {sorted(value)}")
        for name in sorted(keys):
            v = value[name]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"draft_tree[{name!r}] must be a positive int, got {v!r}")
        tau = value.get("score_temperature", 1.0)
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
            raise ValueError(f"draft_tree['score_temperature'] must be a number > 0, got {tau!r}")
        tree = cls(value["top_k"], value["depth"], value["total_tokens"], float(tau))
        if tree.total_tokens > tree.num_candidates:
            raise ValueError(f"draft_tree total_tokens={tree.total_tokens} > the {tree.num_candidates} candidates "
                             f"top_k={tree.top_k}, depth={tree.depth} produce (top_k + (depth-1)*top_k**2); "
                             "lower total_tokens or raise top_k/depth")
        return tree

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def draft_slots(self) -> int:
        """Cache slots per sequence the draft's expansion steps write (top_k per step)."""
        return (self.depth - 1) * self.top_k

    @property
    def width(self) -> int:
        """Cache slots past the committed tokens one step needs (the verify's tree, or the draft's)."""
        return max(self.total_tokens + 1, self.draft_slots + 1)


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (the parent node of each node, -1 for the root's children; nodes in an order
    where parents come first) -> the verify mask [B, N+1, N+1] over [root, nodes]: row i marks the
    root, node i's ancestors and node i."""
    B, N = parents.shape
    mask = torch.eye(N + 1, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    mask[:, :, 0] = True
    rows = torch.arange(B, device=parents.device)
    for i in range(N):
        mask[:, i + 1] |= mask[rows, parents[:, i] + 1]
    return mask


def rerank(tokens: torch.Tensor, scores: torch.Tensor, parent_cand: torch.Tensor, total_tokens: int):
    """Keep the total_tokens best candidates (by score; ties: the earlier), in candidate order.

    tokens/scores/parent_cand [B, C] (parent_cand: the parent's candidate index, -1 for the root).
    Returns (tokens [B, N], parents [B, N] as node indices, -1 for the root's children)."""
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :total_tokens]
    keep = torch.sort(order, dim=1).values  # [B, N] candidate indices, parents before children
    parent = parent_cand.gather(1, keep)
    node_of = torch.searchsorted(keep, parent.clamp_min(0)).clamp(max=total_tokens - 1)  # the parent's node index
    # every kept node's parent is kept (a child never scores above its parent, and ties keep the
    # earlier candidate), so node_of finds it: no check here, which would read the device on the host
    parents = torch.where(parent < 0, torch.full_like(parent, -1), node_of)
    return tokens.gather(1, keep), parents
