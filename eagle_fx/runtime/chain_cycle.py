"""A chain's speculative cycle as one function: the k-1 draft steps, the verify, acceptance on the
device (greedy, or rejection sampling from noise drawn before the call) and the padded draft
extend over the k+1 verified positions.

    accepted, next_token, drafts, draft_logits, draft_hidden, features = chain_cycle(...)

Every input and output is a tensor of fixed shape for a batch size and block-table width; nothing
inside reads a value on the host (the attention of these graphs is device-side, see
passes/mark_uniform_queries.py). With backend="inductor" `ChainCycle` compiles it once with
torch.compile (fullgraph, dynamic sizes): one graph per cycle, the same one for every batch size
and context length. With "eager" it runs as plain Python over the step graphs. The host reads its
outputs once per cycle (eagle_fx.runtime.scheduler).

Sampling: the draft tokens and the resampled / bonus token are drawn by the exponential race
(argmax p / E with E ~ Exp(1), a sample from p), and the acceptance test uses uniforms; both noise
tensors come from the call's generator outside the graph, so the graph itself is deterministic.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from eagle_fx.passes import inline_uniform_attention
from eagle_fx.passes.fx_graph import copy_graph_module
from eagle_fx.runtime.compiled import compile_dynamic
from eagle_fx.runtime.sampling import greedy, race_sample, warp
from eagle_fx.runtime.step_inputs import draft_step_inputs, extend_inputs, verify_inputs
from eagle_fx.runtime.verifier import greedy_accept, rejection_accept_drawn


@dataclass(frozen=True)
class CycleSettings:
    """What a compiled cycle is specialised on (one compiled variant per distinct value)."""

    num_spec_tokens: int
    draft_offset: int
    block_size: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    # the bench's real-proportions mode only: each draft position accepted by a coin of this
    # probability (from `uniforms`), not by matching; the output is then NOT the base's greedy
    synthetic_acceptance: float | None = None


def chain_cycle(graphs: dict, signatures: dict, spec, settings: CycleSettings, pools: dict, pending: torch.Tensor,
                committed_len: torch.Tensor, block_table: torch.Tensor, spec_rows: torch.Tensor,
                draft_logits: torch.Tensor, draft_hidden: torch.Tensor, uniforms: torch.Tensor | None,
                noise: torch.Tensor | None):
    """One cycle for B sequences. pools: {"base": the base graphs' pools, "draft": the draft's}
    (KVCache.pools_by_side). pending [B] (the last sampled token), committed_len [B],
    block_table [B, blocks], spec_rows [B], draft_logits [B, Vd] / draft_hidden [B, H] (the draft's
    last call); sampling: uniforms [B, k], noise [B, k+1, V] (None when greedy). Returns accepted
    [B], next_token [B], drafts [B, k], the extend's draft_logits / draft_hidden, and the base's
    features at the k+1 verified positions [B, k+1, F]. k = 0 is plain decoding: the verify of the
    pending token alone, no draft (draft_logits / draft_hidden pass through)."""
    k, offset, block_size = settings.num_spec_tokens, settings.draft_offset, settings.block_size
    is_greedy = settings.temperature == 0

    def run(name: str, values: dict):
        signature = signatures[name]
        return graphs[name](**signature.select({**pools["base" if signature.is_base else "draft"], **values}))

    def probs(logits):
        return warp(logits, settings.temperature, settings.top_k, settings.top_p)

    def pick(logits, j):
        if is_greedy:
            return spec.to_target(greedy(logits)), None
        q = spec.to_target_probs(probs(logits))
        return race_sample(q, noise[:, j]), q

    if k == 0:  # num_spec_tokens=0: the base alone, one token per cycle; the draft does not run
        no_drafts = pending[:, None][:, :0]  # [B, 0]
        logits, features = run("verify", verify_inputs(pending, no_drafts, committed_len, block_table, block_size))
        next_token = greedy(logits) if is_greedy else race_sample(probs(logits), noise[:, 0])
        return torch.zeros_like(pending), next_token, no_drafts, draft_logits, draft_hidden, features[:, None]
    token, q = pick(draft_logits, 0)
    tokens, draft_probs, hidden = [token], [q], draft_hidden
    for j in range(1, k):
        position = committed_len - 1 + j + offset
        logits, hidden = run("draft_step", draft_step_inputs(token, position, hidden, block_table, spec_rows,
                                                             committed_len, block_size))
        token, q = pick(logits, j)
        tokens.append(token)
        draft_probs.append(q)
    drafts = torch.stack(tokens, dim=1)
    num_seqs = drafts.shape[0]
    logits, features = run("verify", verify_inputs(pending, drafts, committed_len, block_table, block_size))
    if settings.synthetic_acceptance is not None:  # bench only: acceptance by a coin, cost as in a real cycle
        target = greedy(logits).view(num_seqs, k + 1)
        accepted = (uniforms < settings.synthetic_acceptance).long().cumprod(dim=1).sum(dim=1)
        next_token = target.gather(1, accepted[:, None])[:, 0]
    elif is_greedy:
        accepted, next_token = greedy_accept(drafts, greedy(logits).view(num_seqs, k + 1))
    else:
        accepted, next_token = rejection_accept_drawn(drafts, torch.stack(draft_probs, dim=1),
                                                      probs(logits.view(num_seqs, k + 1, -1)), uniforms, noise[:, k])
    features = features.view(num_seqs, k + 1, -1)
    inputs, _ = extend_inputs(drafts, accepted, next_token, features, committed_len, block_table, spec_rows, offset,
                              block_size)
    draft_logits, draft_hidden = run("draft_extend", inputs)
    return accepted, next_token, drafts, draft_logits, draft_hidden, features


class ChainCycle:
    """A model's chain cycle: plain Python over the step graphs, or (compile=True) one
    torch.compile'd graph per sampling setting, dynamic in batch size and block-table width.

    Compiled, a batch of one sequence is a graph of its own (torch.compile specialises a size of
    1; the warm-up compiles both), and the block table has at least 2 columns (a narrower one gets
    a masked second column), so the width never specialises."""

    def __init__(self, graphs: dict, signatures: dict, spec, num_spec_tokens: int, draft_offset: int,
                 block_size: int, compile: bool):
        if compile:  # the device-side attention traced into the one compiled graph (not opaque ops)
            graphs = {name: inline_uniform_attention.run(copy_graph_module(gm)).gm for name, gm in graphs.items()}
        self.graphs, self.signatures, self.spec, self.compile = graphs, signatures, spec, compile
        self.base_settings = CycleSettings(num_spec_tokens, draft_offset, block_size)
        self._fns: dict[CycleSettings, object] = {}
        self._coin: torch.Generator | None = None  # set by use_synthetic_acceptance (the bench)

    def use_synthetic_acceptance(self, probability: float, seed: int = 0) -> None:
        """Bench only (`eagle-fx bench --synthetic-acceptance P`): from now on, greedy cycles accept
        each draft position with a seeded coin of `probability` (so the mean acceptance length is
        1 + P + ... + P^k) instead of by matching the base's argmax; drafts, verify and extend run
        as usual. The output is then not the base's greedy decode."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"synthetic acceptance must be a probability in [0, 1], got {probability!r}")
        self.base_settings = dataclasses.replace(self.base_settings, synthetic_acceptance=float(probability))
        self._coin = torch.Generator(device=self.spec.device).manual_seed(seed)

    def _fn(self, settings: CycleSettings):
        fn = self._fns.get(settings)
        if fn is None:
            fn = partial(chain_cycle, self.graphs, self.signatures, self.spec, settings)
            if self.compile:
                fn = compile_dynamic(fn, fullgraph=True, frozen_on=self.spec.device, cpp_wrapper=True)
            self._fns[settings] = fn
        return fn

    def __call__(self, sampler, pools: dict, pending, committed_len, block_table, spec_rows, draft_logits,
                 draft_hidden):
        settings = self.base_settings
        if not sampler.is_greedy:
            if settings.synthetic_acceptance is not None:
                raise ValueError("synthetic acceptance (a bench mode) runs greedy only")
            settings = CycleSettings(settings.num_spec_tokens, settings.draft_offset, settings.block_size,
                                     sampler.temperature, sampler.top_k, sampler.top_p)
        num_seqs, k = pending.shape[0], settings.num_spec_tokens
        uniforms = noise = None
        if settings.synthetic_acceptance is not None:
            uniforms = torch.rand(num_seqs, k, generator=self._coin, device=pending.device)
        if not sampler.is_greedy:
            uniforms = torch.rand(num_seqs, k, generator=sampler.generator, device=pending.device)
            noise = torch.empty(num_seqs, k + 1, self.spec.vocab_size, device=pending.device).exponential_(
                generator=sampler.generator)
        if self.compile and block_table.shape[1] < 2:  # a second column (block 0, past every position: masked)
            block_table = torch.cat([block_table, torch.zeros_like(block_table)], dim=1)
        with torch.no_grad():
            out = self._fn(settings)(pools, pending, committed_len, block_table, spec_rows, draft_logits,
                                     draft_hidden, uniforms, noise)
        return out
