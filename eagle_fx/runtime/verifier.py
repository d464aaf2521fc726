"""Acceptance of drafted tokens against the base: greedy or rejection sampling, chains and trees.

Every function returns (accepted [B], next token [B], ...): the number of drafts accepted per
sequence and the base's token right after them (the bonus token, or the resampled one).
"""
from __future__ import annotations

import torch

from eagle_fx.runtime.sampling import greedy, race_noise, race_sample


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


def rejection_accept(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor, uniforms: torch.Tensor,
                           noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling along a chain, from drawn noise (no host read, no generator).

    draft_tokens [B, k] were sampled from q [B, k, V]; p [B, k+1, V] is the base's distribution at
    the k+1 verified positions. d_j is accepted when uniforms[:, j] * q_j(d_j) < p_j(d_j) (with
    probability min(1, p_j(d_j) / q_j(d_j)) for uniforms in [0, 1); a greedy row, p and q one-hot,
    accepts exactly the matching drafts); at the first rejection the next token is drawn from
    normalize(max(0, p_j - q_j)); when all k are accepted, the bonus token is drawn from p_{k+1};
    both draws are race_sample over noise [B, V] (Exp(1)). Returns (accepted [B], next token [B]);
    the output is distributed exactly as sampling from p token by token.
    """
    B, k = draft_tokens.shape
    idx = draft_tokens[..., None]
    pd = p[:, :k].gather(-1, idx)[..., 0]
    qd = q.gather(-1, idx)[..., 0]
    ok = uniforms * qd < pd
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=p.device)
    p_j = p[rows, accepted]
    q_j = torch.where((accepted < k)[:, None], q[rows, accepted.clamp(max=k - 1)], torch.zeros_like(p_j))
    resid = (p_j - q_j).clamp_min(0)
    empty = resid.sum(-1, keepdim=True) <= 0  # p_j == q_j: any rejection is impossible; keep p_j
    resid = torch.where(empty, p_j, resid)
    return accepted, race_sample(resid, noise)


def greedy_walk(parents: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor, depth: int):
    """Acceptance along trees under greedy decoding.

    parents/tokens [B, N]; target [B, N+1] the base's argmax at [root, nodes]. Returns
    (accepted [B], bonus [B], path [B, depth+1]): path[:, 0] = 0 (the root), path[:, j] the node
    (1-based, into [root, nodes]) accepted at depth j (the last accepted node repeats past it)."""
    B, N = parents.shape
    rows = torch.arange(B, device=parents.device)
    cur = torch.zeros(B, dtype=torch.long, device=parents.device)
    alive = torch.ones(B, dtype=torch.bool, device=parents.device)
    accepted = torch.zeros_like(cur)
    path = torch.zeros(B, depth + 1, dtype=torch.long, device=parents.device)
    for j in range(1, depth + 1):
        want = target[rows, cur]
        match = (parents == (cur - 1)[:, None]) & (tokens == want[:, None]) & alive[:, None]
        found = match.any(1)
        child = match.long().argmax(1) + 1  # the first matching child
        cur = torch.where(found, child, cur)
        accepted += found.long()
        alive &= found
        path[:, j] = cur
    return accepted, target[rows, cur], path


def sampled_walk(parents: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor, depth: int,
                 generator: torch.Generator | None):
    """Acceptance along trees under sampling (SpecInfer / EAGLE's multi-draft rejection): at each
    node, its children are tried in candidate order; child x is accepted with probability
    r(x) / sum(r), where r starts as the base's distribution there and every rejected child's token
    is zeroed out of it; when no child is accepted (or at a leaf) the next token is drawn from what
    is left of r. p [B, N+1, V]: the base's warped distribution at [root, nodes]. Returns
    (accepted, next token, path) as greedy_walk. All sequences advance together, one child rank at
    a time; the host reads one count per depth (the most children any current node has)."""
    B, N = parents.shape
    device = parents.device
    rows = torch.arange(B, device=device)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    accepted = torch.zeros(B, dtype=torch.long, device=device)
    searching = torch.ones(B, dtype=torch.bool, device=device)  # still walking down
    path = torch.zeros(B, depth + 1, dtype=torch.long, device=device)
    residual = p[rows, cur].clone()
    for j in range(1, depth + 1):
        children = (parents == (cur - 1)[:, None]) & searching[:, None]  # [B, N], candidate order
        rank = children.long().cumsum(1) - 1
        found = torch.zeros(B, dtype=torch.bool, device=device)
        child = torch.zeros(B, dtype=torch.long, device=device)
        for r in range(int(children.sum(1).max())):
            is_r = children & (rank == r)
            has = is_r.any(1) & ~found
            node = is_r.long().argmax(1)
            x = tokens[rows, node]
            mass = residual.sum(-1)
            px = residual[rows, x]
            u = torch.rand(B, generator=generator, device=device)
            take = has & (mass > 0) & (u * mass < px)
            child = torch.where(take, node + 1, child)
            found |= take
            reject = has & ~take
            residual[rows[reject], x[reject]] = 0  # rejected: x cannot be the next token
        accepted += found.long()
        cur = torch.where(found, child, cur)
        searching &= found
        path[:, j] = cur
        residual = torch.where(found[:, None], p[rows, cur], residual)  # a new node: its own distribution
    empty = residual.sum(-1, keepdim=True) <= 0  # every token with mass was a rejected child: cannot happen
    residual = torch.where(empty, p[rows, cur], residual)
    bonus = race_sample(residual, race_noise(residual.shape, generator, device))
    return accepted, bonus, path


def accept_tree(sampler, parents: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor, depth: int):
    """A tree's verify logits [A * (N+1), V] over [root, nodes] -> (accepted, next token, path)."""
    A, N = tokens.shape
    if sampler.is_greedy:
        return greedy_walk(parents, tokens, greedy(logits).view(A, N + 1), depth)
    return sampled_walk(parents, tokens, sampler.probs(logits.view(A, N + 1, -1)), depth, sampler.generator)
