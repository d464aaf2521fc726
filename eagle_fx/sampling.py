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


def warp(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities after temperature, then top-k, then top-p (nucleus), in Hugging Face's order and
    conventions (top-p keeps the smallest set whose mass reaches top_p, at least one token)."""
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1)  # ascending
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [N, V]."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def rejection_accept(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling along a chain (Leviathan et al.; Chen et al.).

    draft_tokens [B, k] were sampled from q [B, k, V]; p [B, k+1, V] is the base's distribution at
    the k+1 verified positions. d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the
    first rejection the next token is drawn from normalize(max(0, p_j - q_j)); when all k are
    accepted, the bonus token is drawn from p_{k+1}. Returns (accepted [B], next token [B]); the
    output is distributed exactly as sampling from p token by token.
    """
    B, k = draft_tokens.shape
    idx = draft_tokens[..., None]
    pd = p[:, :k].gather(-1, idx)[..., 0]
    qd = q.gather(-1, idx)[..., 0]
    u = torch.rand(B, k, generator=generator, device=p.device)
    ok = u * qd <= pd
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=p.device)
    p_j = p[rows, accepted]
    q_j = torch.where((accepted < k)[:, None], q[rows, accepted.clamp(max=k - 1)], torch.zeros_like(p_j))
    resid = (p_j - q_j).clamp_min(0)
    empty = resid.sum(-1, keepdim=True) <= 0  # p_j == q_j: any rejection is impossible; keep p_j
    resid = torch.where(empty, p_j, resid)
    return accepted, sample(resid / resid.sum(-1, keepdim=True), generator)
