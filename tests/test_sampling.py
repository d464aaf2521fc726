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


def test_per_row_warping_equals_hf_warpers_row_by_row():
    """warp with per-row tensors == Hugging Face's TemperatureLogitsWarper, TopKLogitsWarper and
    TopPLogitsWarper applied to each row with that row's settings; a temperature-0 row is one-hot at
    the argmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from eagle_fx.runtime.sampling import Warping

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g) * 3
    settings = [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.5, 7, 0.6), (0.0, 3, 0.5)]
    warping = Warping(torch.tensor([t for t, _, _ in settings]), torch.tensor([k for _, k, _ in settings]),
                      torch.tensor([p for _, _, p in settings]))
    got = warping.probs(logits)
    for row, (t, k, p) in enumerate(settings):
        x = logits[row:row + 1]
        if t == 0:
            want = torch.zeros(40).index_fill_(0, x.argmax(-1), 1.0)
        else:
            x = TemperatureLogitsWarper(t)(None, x)
            if k:
                x = TopKLogitsWarper(k)(None, x)
            if p < 1:
                x = TopPLogitsWarper(p)(None, x)
            want = x.softmax(-1)[0]
        torch.testing.assert_close(got[row], want)
    assert (got[1] > 0).sum() == 5 and (got[3] > 0).sum() <= 7  # the cuts did cut: the oracle can fail
    # [B, rows, V] logits take row b's settings for every one of its rows
    torch.testing.assert_close(warping.probs(logits[:, None].expand(5, 3, 40))[:, 2], got)


def test_rejection_accept_on_greedy_rows_is_greedy_accept():
    """A temperature-0 row in the sampling path (p and q one-hot) accepts exactly the drafts greedy
    acceptance accepts, whatever the uniforms (0 included), and its next token is the base's argmax."""
    from eagle_fx.runtime.sampling import race_sample
    from eagle_fx.runtime.verifier import rejection_accept

    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 6, 7], [5, 9, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 8], [2, 6, 7, 8], [5, 6, 7, 8]])
    p = torch.nn.functional.one_hot(target, 10).float()
    q = torch.nn.functional.one_hot(draft, 10).float()
    uniforms = torch.tensor([[0.0, 0.5, 0.99]] * 4)
    noise = torch.empty(4, 10).exponential_(generator=torch.Generator().manual_seed(1))
    accepted, next_token = rejection_accept(draft, q, p, uniforms, noise)
    want_accepted, want_next = greedy_accept(draft, target)
    assert accepted.tolist() == want_accepted.tolist() == [3, 2, 0, 1]
    assert next_token.tolist() == want_next.tolist()
    assert race_sample(p[:, 0], noise).tolist() == target[:, 0].tolist()
