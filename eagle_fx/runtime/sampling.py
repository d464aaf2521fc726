"""Token selection: greedy, or sampling from a warped distribution with a per-call generator.

Sampling settings belong to one generate call (a `Sampler`), never to the model, so two calls with
different settings do not interfere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


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


def race_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [..., V] from noise [..., V] of i.i.d. Exp(1) draws: the argmax of
    p / E, which is distributed as p (the exponential race; no host read, no generator inside)."""
    return (probs / noise.clamp_min(1e-30)).argmax(dim=-1)


@dataclass
class Sampler:
    """One generate call's token selection. temperature 0: greedy (generator None)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @classmethod
    def for_call(cls, temperature, top_p, top_k, seed, device) -> "Sampler":
        """Validated settings; a generator seeded with `seed` (or a random seed) when sampling."""
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise ValueError(f"top_k must be an int >= 0, or -1 (0 and -1: off), got {top_k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if temperature == 0:
            return cls()
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return cls(float(temperature), max(top_k, 0), float(top_p), generator)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The base's token from its logits: argmax, or a sample from the warped distribution."""
        return greedy(logits) if self.is_greedy else sample(self.probs(logits), self.generator)
