"""Token selection and speculative acceptance."""
from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def greedy_accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain verification under greedy decoding.

    draft_tokens [B, k] are the proposals d_1..d_k; target_tokens [B, k+1] the base's argmax at the
    k+1 verified positions. Returns (accepted [B], bonus [B]): the length of the longest prefix with
    d_i == target_{i-1}, and the base's token right after it.
    """
    k = draft_tokens.shape[1]
    accepted = (draft_tokens == target_tokens[:, :k]).long().cumprod(dim=1).sum(dim=1)
    bonus = target_tokens.gather(1, accepted[:, None])[:, 0]
    return accepted, bonus
