"""Token selection: greedy, or sampling from a warped distribution with a per-call generator.

One scheme everywhere: a token is drawn from p by the exponential race (the argmax of p / E with
E ~ Exp(1) i.i.d., `race_sample`), and speculative acceptance tests use uniforms; the noise is drawn
from the call's generator outside any graph. Temperature, top-k and top-p are per-row tensors
(`Warping`), so a compiled graph takes them as inputs and serves every setting.

Sampling settings belong to one generate call (a `Sampler`), never to the model, so two calls with
different settings do not interfere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [..., V] after temperature, then top-k, then top-p (nucleus), in Hugging Face's
    order and conventions (top-p keeps the smallest set whose mass reaches top_p, at least one token).

    The settings are tensors broadcastable to logits.shape[:-1] (one value per row): temperature
    (<= 0: that row is greedy, a one-hot at the argmax), top_k (a long; 0: off), top_p (1: off).
    Nothing is read on the host."""
    vocab = logits.shape[-1]
    rows = logits.shape[:-1]
    temperature, top_k, top_p = (t.expand(rows)[..., None] for t in (temperature, top_k, top_p))
    is_greedy = temperature <= 0
    x = logits.float() / torch.where(is_greedy, torch.ones_like(temperature), temperature)
    ascending, order = torch.sort(x, dim=-1)
    keep_k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    kth = ascending.gather(-1, vocab - keep_k)  # the k-th largest value
    x = x.masked_fill(x < kth, float("-inf"))
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))  # the same order, top-k applied
    cum = ascending.softmax(-1).cumsum(-1)
    drop = cum <= 1 - top_p
    drop[..., -1] = False
    x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = x.softmax(-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # (F.one_hot reads on the host)
    return torch.where(is_greedy, one_hot, probs)


def race_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [..., V] from noise [..., V] of i.i.d. Exp(1) draws: the argmax of
    p / E, which is distributed as p (the exponential race; no host read, no generator inside)."""
    return (probs / noise.clamp_min(1e-30)).argmax(dim=-1)


def race_noise(shape, generator: torch.Generator | None, device) -> torch.Tensor:
    """Exp(1) noise for race_sample, drawn from `generator`."""
    return torch.empty(shape, device=device).exponential_(generator=generator)


@dataclass
class Warping:
    """Per-row sampling settings as tensors: temperature [B] float, top_k [B] long, top_p [B] float."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, ..., V] (row b's settings apply to logits[b]) -> warped probabilities."""
        extra = (1,) * (logits.dim() - 2)
        b = logits.shape[0]
        return warp(logits, *(t.view(b, *extra) for t in (self.temperature, self.top_k, self.top_p)))


class Picking:
    """What Sampler and RowSampler share: the warped distribution and the base's token, over their
    own warping() and race() (the noise)."""

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, ..., V] -> the warped distribution (row b's settings on logits[b])."""
        return self.warping(logits.shape[0], logits.device).probs(logits)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The base's token from its logits [B, V]: argmax, or a race sample from the warped distribution."""
        if self.is_greedy:
            return greedy(logits)
        probs = self.probs(logits)
        return race_sample(probs, self.race(probs.shape, logits.device))


@dataclass
class Sampler(Picking):
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

    def warping(self, num_rows: int, device) -> Warping:
        """This call's settings for num_rows rows."""
        return Warping(torch.full((num_rows,), self.temperature, dtype=torch.float32, device=device),
                       torch.full((num_rows,), self.top_k, dtype=torch.long, device=device),
                       torch.full((num_rows,), self.top_p, dtype=torch.float32, device=device))

    def select(self, rows: list[int]) -> "Sampler":
        """The sampler of a subset of rows (one call's settings serve every row: itself)."""
        return self

    def uniforms(self, num_rows: int, k: int, device) -> torch.Tensor:
        """[num_rows, k] U[0, 1) draws for the acceptance test, from this call's generator."""
        return torch.rand(num_rows, k, generator=self.generator, device=device)

    def race(self, shape, device) -> torch.Tensor:
        """[num_rows, ...] Exp(1) draws for race_sample, from this call's generator."""
        return race_noise(shape, self.generator, device)



@dataclass
class RowSampler(Picking):
    """Each row its own settings and generator (the serving engine: one row per request). A row at
    temperature 0 is greedy (its noise is a constant: the warped p is one-hot). The noise of a row
    comes from its own generator only, so a seeded row draws the same numbers whatever rows it is
    batched with. The same methods as Sampler, which the chain cycle and the prefill call."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    generators: list  # per row: a torch.Generator, or None (greedy)

    @property
    def is_greedy(self) -> bool:
        return all(t == 0 for t in self.temperature)

    def warping(self, num_rows: int, device) -> Warping:
        assert num_rows == len(self.temperature), "one setting per row"
        return Warping(torch.tensor(self.temperature, dtype=torch.float32, device=device),
                       torch.tensor(self.top_k, dtype=torch.long, device=device),
                       torch.tensor(self.top_p, dtype=torch.float32, device=device))

    def select(self, rows: list[int]) -> "RowSampler":
        """The sampler of these rows, in this order."""
        return RowSampler([self.temperature[r] for r in rows], [self.top_k[r] for r in rows],
                          [self.top_p[r] for r in rows], [self.generators[r] for r in rows])

    def _per_row(self, shape, device, draw, constant: float) -> torch.Tensor:
        rows = [draw(g) if g is not None else torch.full(tuple(shape[1:]), constant, device=device)
                for g in self.generators]
        return torch.stack(rows)

    def uniforms(self, num_rows: int, k: int, device) -> torch.Tensor:
        return self._per_row((num_rows, k), device, lambda g: torch.rand(k, generator=g, device=device), 0.5)

    def race(self, shape, device) -> torch.Tensor:
        return self._per_row(shape, device, lambda g: race_noise(tuple(shape[1:]), g, device), 1.0)
