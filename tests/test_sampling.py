"""Greedy acceptance and vLLM's spec-decode counters against hand-counted cases."""
import torch

from eagle_fx.runtime import SpecDecodeStats
from eagle_fx.runtime.verifier import greedy_accept


def test_greedy_accept_hand_cases():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 6, 7], [5, 9, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 8], [2, 6, 7, 8], [5, 6, 7, 8]])
    acc, bonus = greedy_accept(draft, target)
    assert acc.tolist() == [3, 2, 0, 1]  # a later match after a miss does not count
    assert bonus.tolist() == [8, 0, 2, 6]


def test_stats_formulas():
    s = SpecDecodeStats(num_spec_tokens=3)
    s.record([3, 0])
    s.record([1])
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 9, 4)
    assert s.mean_acceptance_length == 1 + 4 / 3
    assert s.acceptance_at == [2 / 3, 1 / 3, 1 / 3]
    empty = SpecDecodeStats(num_spec_tokens=2)
    assert empty.mean_acceptance_length == 1.0 and empty.acceptance_at == [0.0, 0.0]
