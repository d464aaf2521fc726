"""A chain's speculative cycle as one function, the only one a chain runs: the k-1 draft steps, the
verify, acceptance on the device (greedy, or rejection sampling from noise drawn before the call)
and the padded draft extend over the k+1 verified positions.

    accepted, next_token, drafts, draft_logits, draft_hidden, features = chain_cycle(run, ...)

`run(graph, values)` makes one step-graph call. `ChainCycle` gives it one of two ways:
- compiled (backend="inductor", no static buffers, no per-wave tables, nobody observing): the step
  graphs called directly on the pools, and the whole cycle compiled once with torch.compile
  (fullgraph, dynamic sizes, frozen weights): one graph per cycle for every batch size, context
  length and sampling setting;
- through the executor (every other case: the eager backend, static buffers / CUDA graphs, a
  vision-language base's wave tables, observers, per-graph profiling): the same function, run as
  Python, each step graph called through `Executor.step` / `Executor.call`.

Under grammar masks (structured output) the mask of draft j+1 comes from the host's matchers after
draft j, and the verify's rows after every draft: the cycle calls them as ops
(eagle_fx.structured.mask_op), so a compiled cycle under a grammar is still one compiled call.

Every input and output is a tensor of fixed shape for a batch size and block-table width; nothing
inside reads a value on the host but the grammar's mask ops (the attention of these graphs is
device-side, see passes/mark_uniform_queries.py). The host reads the outputs once per cycle
(runtime.scheduler).

Sampling (eagle_fx.runtime.sampling): temperature, top-k and top-p are per-row tensors (inputs,
not constants: one compiled function serves every setting; a row at temperature 0 is greedy).
Tokens are drawn by the exponential race (argmax p / E, E ~ Exp(1)); the acceptance test uses
uniforms; both noise tensors come from the call's generator outside the graph.
"""
from __future__ import annotations

import contextlib
import dataclasses
import types
from dataclasses import dataclass
from functools import partial

import torch

from eagle_fx.passes import inline_uniform_attention
from eagle_fx.passes.fx_graph import copy_graph_module
from eagle_fx.runtime.compiled import compile_dynamic
from eagle_fx.runtime.sampling import Warping, greedy, race_sample
from eagle_fx.runtime.stats import CHAIN_CYCLE
from eagle_fx.runtime.step_inputs import draft_step_inputs, extend_inputs, verify_inputs
from eagle_fx.runtime.verifier import greedy_accept, rejection_accept
from eagle_fx.structured.bitmask import bitmask_width, mask_logits, unpack_bitmask
from eagle_fx.structured.mask_op import filling, grammar_draft_row, grammar_verify_rows


@dataclass(frozen=True)
class CycleSettings:
    """What a compiled cycle is specialised on: at most one variant per combination of the flags."""

    num_spec_tokens: int
    draft_offset: int
    block_size: int
    sampling: bool = False  # False: every row greedy (no warping, no noise)
    forced_drafts: bool = False  # a test oracle's tokens replace the draft's where they are >= 0
    grammar: bool = False  # drafts and verify under grammar masks (eagle_fx.structured.mask_op's ops)
    # the bench's real-proportions mode only: each draft position accepted by a coin of this
    # probability (from `uniforms`), not by matching; the output is then NOT the base's greedy
    synthetic_acceptance: float | None = None


@dataclass
class CycleNoise:
    """What a cycle draws, drawn before it from the call's generator (None where not needed)."""

    warping: Warping | None = None  # per-row temperature / top-k / top-p (sampling)
    uniforms: torch.Tensor | None = None  # [B, k] the acceptance test's (or the synthetic coin's)
    race: torch.Tensor | None = None  # [B, k+1, V] Exp(1): the draft tokens and the next token
    forced: torch.Tensor | None = None  # [B, k] forced draft tokens (-1: the draft's own)


def chain_cycle(run, spec, settings: CycleSettings, pending: torch.Tensor, committed_len: torch.Tensor,
                block_table: torch.Tensor, spec_rows: torch.Tensor, draft_logits: torch.Tensor,
                draft_hidden: torch.Tensor, noise: CycleNoise):
    """One cycle for B sequences. run(graph, values) -> the graph's outputs. pending [B] (the last
    sampled token), committed_len [B], block_table [B, blocks], spec_rows [B], draft_logits [B, Vd]
    / draft_hidden [B, H] (the draft's last call). Returns accepted [B], next_token [B], drafts
    [B, k], the extend's draft_logits / draft_hidden, and the base's features at the k+1 verified
    positions [B, k+1, F]. k = 0 is plain decoding: the verify of the pending token alone, no draft
    (draft_logits / draft_hidden pass through). settings.grammar: each draft is picked under its
    grammar mask and the verify's rows are masked, the masks from eagle_fx.structured.mask_op's ops
    (the caller runs the cycle inside `filling(masks)`)."""
    k, offset = settings.num_spec_tokens, settings.draft_offset
    width = bitmask_width(spec.vocab_size)
    committed_len, block_table, spec_rows, draft_logits, draft_hidden = per_sequence(
        pending.shape[0], committed_len, block_table, spec_rows, draft_logits, draft_hidden)

    def allowed(j, previous):  # the packed mask of draft j+1, after draft j = previous (None: no grammar)
        return grammar_draft_row(previous, j, width) if settings.grammar else None

    drafts, draft_probs = pending[:, None][:, :0], None  # k = 0: no draft; the draft does not run
    if k > 0:
        token, q = pick_draft(spec, settings, noise, draft_logits, 0, allowed(0, pending))
        tokens, probs, hidden = [token], [q], draft_hidden
        for j in range(1, k):
            token, q, hidden = draft_step(run, spec, settings, noise, j, token, committed_len - 1 + j + offset, hidden,
                                          committed_len, block_table, spec_rows, allowed(j, token))
            tokens.append(token)
            probs.append(q)
        drafts = torch.stack(tokens, dim=1)
        draft_probs = torch.stack(probs, dim=1) if settings.sampling else None
    rows = grammar_verify_rows(drafts, width) if settings.grammar else None
    return verify_and_extend(run, spec, settings, noise, pending, drafts, draft_probs, committed_len, block_table,
                             spec_rows, draft_logits, draft_hidden, rows)


def per_sequence(num_seqs, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """tensors viewed with num_seqs rows (they have that many). Free when run eagerly; traced, it tells
    the compiler that their first sizes are one size: torch.compile gives each input's size a symbol
    of its own, and a one-sequence cycle specialises pending's to 1 but not committed_len's, so the
    verify's positions had another row count than its tokens, and an attention output reshaped by
    both had a symbolic width, which inductor's C++ GEMM template refuses: the o_proj and residual
    add of every layer fell back to a oneDNN call at 3-5x the template's time (measured: 50 us of a
    1.4 ms k=0 step each)."""
    return [t.view(num_seqs, *t.shape[1:]) for t in tensors]


def pick_draft(spec, settings: CycleSettings, noise: CycleNoise, logits: torch.Tensor, j: int,
               allowed: torch.Tensor | None = None):
    """Draft token j (target ids) from the draft's logits [B, Vd] (only where the grammar's packed
    mask `allowed` [B, W] int32 allows, when given) and, when sampling, the distribution it was drawn
    from [B, V]."""
    if allowed is not None:
        logits = mask_logits(logits, spec.to_draft_mask(unpack_bitmask(allowed, spec.vocab_size)))
    if settings.sampling:
        q = spec.to_target_probs(noise.warping.probs(logits[:, None])[:, 0])
        token = race_sample(q, noise.race[:, j])
    else:
        q, token = None, spec.to_target(greedy(logits))
    if settings.forced_drafts:
        token = torch.where(noise.forced[:, j] >= 0, noise.forced[:, j], token)
    return token, q


def draft_step(run, spec, settings: CycleSettings, noise: CycleNoise, j: int, token: torch.Tensor,
               position: torch.Tensor, hidden: torch.Tensor, committed_len: torch.Tensor, block_table: torch.Tensor,
               spec_rows: torch.Tensor, allowed: torch.Tensor | None = None):
    """Draft token j after token j-1 at `position` [B]: one draft_step graph call and pick_draft.
    Returns the token, its distribution (sampling) and the draft's hidden state."""
    logits, hidden = run("draft_step", draft_step_inputs(token, position, hidden, block_table, spec_rows,
                                                         committed_len, settings.block_size))
    token, q = pick_draft(spec, settings, noise, logits, j, allowed)
    return token, q, hidden


def verify_and_extend(run, spec, settings: CycleSettings, noise: CycleNoise, pending, drafts, draft_probs,
                      committed_len, block_table, spec_rows, draft_logits, draft_hidden,
                      allowed: torch.Tensor | None = None):
    """The verify of [pending, drafts] (its k+1 rows masked by the grammar's packed masks `allowed`
    [B, k+1, W] int32, unpacked here, when given), acceptance, and the draft's extend over the
    verified positions: chain_cycle's outputs."""
    k, offset, block_size = drafts.shape[1], settings.draft_offset, settings.block_size
    num_seqs = pending.shape[0]

    def probs(logits, rows_per_seq: int):  # logits [B * rows, V] -> the warped distribution [B, rows, V]
        return noise.warping.probs(logits.view(num_seqs, rows_per_seq, -1))

    logits, features = run("verify", {**verify_inputs(pending, drafts, committed_len, block_table, block_size),
                                      "seq_rows": spec_rows})  # (seq_rows: a vision-language base's M-RoPE rows)
    if allowed is not None:  # row j: what the grammar allows after drafts[:j]
        logits = mask_logits(logits, unpack_bitmask(allowed, spec.vocab_size).view(num_seqs * (k + 1), -1))
    if k == 0:  # plain decoding: the verify's token; the draft did not run (its outputs pass through)
        next_token = race_sample(probs(logits, 1)[:, 0], noise.race[:, 0]) if settings.sampling else greedy(logits)
        return torch.zeros_like(pending), next_token, drafts, draft_logits, draft_hidden, features[:, None]
    if settings.synthetic_acceptance is not None:  # bench only: acceptance by a coin, cost as in a real cycle
        target = greedy(logits).view(num_seqs, k + 1)
        accepted = (noise.uniforms < settings.synthetic_acceptance).long().cumprod(dim=1).sum(dim=1)
        next_token = target.gather(1, accepted[:, None])[:, 0]
    elif settings.sampling:
        accepted, next_token = rejection_accept(drafts, draft_probs, probs(logits, k + 1), noise.uniforms,
                                                noise.race[:, k])
    else:
        accepted, next_token = greedy_accept(drafts, greedy(logits).view(num_seqs, k + 1))
    features = features.view(num_seqs, k + 1, features.shape[-1])
    inputs, _ = extend_inputs(drafts, accepted, next_token, features, committed_len, block_table, spec_rows, offset,
                              block_size)
    draft_logits, draft_hidden = run("draft_extend", inputs)
    return accepted, next_token, drafts, draft_logits, draft_hidden, features


def call_graphs(graphs: dict, signatures: dict, pools: dict, graph: str, values: dict):
    """A step graph called directly on the pools (pools: KVCache.pools_by_side())."""
    signature = signatures[graph]
    return graphs[graph](**signature.select({**pools["base" if signature.is_base else "draft"], **values}))


def _compiled_cycle(graphs, signatures, spec, settings):
    """The function a compiled cycle traces: the step graphs called directly on the pools."""

    def cycle(pools, pending, committed_len, block_table, spec_rows, draft_logits, draft_hidden, noise):
        run = partial(call_graphs, graphs, signatures, pools)
        return chain_cycle(run, spec, settings, pending, committed_len, block_table, spec_rows, draft_logits,
                           draft_hidden, noise)

    return cycle


def _cycle_name(settings: CycleSettings) -> str:
    return (f"chain_cycle_k{settings.num_spec_tokens}_o{settings.draft_offset}_b{settings.block_size}"
            f"{'_sampling' if settings.sampling else ''}{'_forced' if settings.forced_drafts else ''}"
            f"{'_coin' if settings.synthetic_acceptance is not None else ''}")


def _own_code(fn, name: str):
    """fn (a plain function, not a partial: torch.compile wraps those in one shared function) with a
    code object of its own. torch.compile keeps its compiled variants per code object and gives up
    past dynamo's recompile limit (8): every k and sampling variant of every model (the serving
    engine runs several k on one model: two variants each, one sequence and several) would
    otherwise pile onto one code object, and each call would check the guards of every variant
    before its own."""
    code = fn.__code__.replace(co_name=name, co_qualname=name) if hasattr(fn.__code__, "co_qualname") else \
        fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """tensor, or a copy when it is a view: dynamo guards a view's base (its size), so a compiled
    cycle traced on a view (a table cut from a longer one) is traced again for the first tensor
    that is not one, and the other way round: in serving, 25-45 s of inductor inside a request."""
    return tensor if tensor._base is None else tensor.clone()


class ChainCycle:
    """A model's chain cycle. compile=True (backend="inductor" with the GraphModules at hand): a
    torch.compile'd variant per CycleSettings (greedy / sampling / forced drafts / the bench's coin:
    a handful, never one per sampling value), dynamic in batch size and block-table width, used
    whenever the call allows it (see `compiled_for`); otherwise, and for the calls that need the
    executor, the cycle runs as Python over the executor's step-graph calls.

    Compiled, a batch of one sequence is a graph of its own (torch.compile specialises a size of
    1; the warm-up compiles both), and the block table has at least 2 columns (a narrower one gets
    a masked second column), so the width never specialises."""

    def __init__(self, graphs: dict | None, signatures: dict, spec, num_spec_tokens: int, draft_offset: int,
                 block_size: int, compiler=None, gemm_autotune: bool = True):
        """graphs: the draft_step / verify / draft_extend GraphModules to compile the cycle from (None:
        no compiled cycle). compiler(fn) -> compiled fn (default: inductor, dynamic sizes, frozen
        weights, GEMMs autotuned unless gemm_autotune=False; tests pass a lighter one)."""
        self.compile = graphs is not None
        self._compiler = compiler or partial(compile_dynamic, fullgraph=True, frozen_on=spec.device, cpp_wrapper=True,
                                             autotune=gemm_autotune, guard_inputs_only=True)
        if self.compile:  # the device-side attention traced into the one compiled graph (not opaque ops)
            graphs = {name: inline_uniform_attention.run(copy_graph_module(gm)).gm for name, gm in graphs.items()}
        self.graphs, self.signatures, self.spec = graphs, signatures, spec
        self.base_settings = CycleSettings(num_spec_tokens, draft_offset, block_size)
        self._fns: dict = {}  # compiled cycles by CycleSettings
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

    def _compiled(self, settings: CycleSettings):
        fn = self._fns.get(settings)
        if fn is None:
            fn = _own_code(_compiled_cycle(self.graphs, self.signatures, self.spec, settings), _cycle_name(settings))
            fn = self._compiler(fn)
            self._fns[settings] = fn
        return fn

    def compiled_for(self, executor, tables, graph_by_graph: bool) -> bool:
        """Whether a call runs the compiled cycle: not when its graph calls must go through the
        executor (static buffers, a wave's image tables, observers, per-graph profiling)."""
        return (self.compile and not graph_by_graph and tables is None and not executor.static
                and not executor.observers)

    def __call__(self, executor, sampler, pending, committed_len, block_table, spec_rows, draft_logits, draft_hidden,
                 *, tables=None, profiler=None, graph_by_graph: bool = False, forced: torch.Tensor | None = None,
                 masks=None):
        """One cycle of the sequences (see chain_cycle). sampler: the call's Sampler; tables: the
        wave's WaveTables (a vision-language base) or None; forced [B, k]: a test oracle's draft
        tokens (-1: the draft's own; greedy only); masks: the rows' grammar masks (a CycleMasks of
        eagle_fx.structured, filled by the cycle's mask ops as it runs: one compiled call still)."""
        settings = self.base_settings
        num_seqs, k, device = pending.shape[0], settings.num_spec_tokens, pending.device
        noise = CycleNoise(forced=forced)
        if masks is not None:
            settings = dataclasses.replace(settings, grammar=True)
        if forced is not None:
            if not sampler.is_greedy:
                raise ValueError("forced draft tokens (a test oracle) run greedy only")
            settings = dataclasses.replace(settings, forced_drafts=True)
        if not sampler.is_greedy:
            if settings.synthetic_acceptance is not None:
                raise ValueError("synthetic acceptance (a bench mode) runs greedy only")
            settings = dataclasses.replace(settings, sampling=True)
            noise.warping = sampler.warping(num_seqs, device)
            noise.uniforms = sampler.uniforms(num_seqs, k, device)
            noise.race = sampler.race((num_seqs, k + 1, self.spec.vocab_size), device)
        elif settings.synthetic_acceptance is not None:
            noise.uniforms = torch.rand(num_seqs, k, generator=self._coin, device=device)
        with torch.no_grad(), (filling(masks) if masks is not None else contextlib.nullcontext()):
            if self.compiled_for(executor, tables, graph_by_graph):
                if block_table.shape[1] < 2:  # a second column (block 0, past every position: masked)
                    block_table = torch.cat([block_table, torch.zeros_like(block_table)], dim=1)
                inputs = [_own_storage(t) for t in (pending, committed_len, block_table, spec_rows, draft_logits,
                                                    draft_hidden)]
                started = profiler.start() if profiler is not None else 0.0
                out = self._compiled(settings)(executor.kv_cache.pools_by_side(), *inputs, noise)
                if profiler is not None:
                    profiler.stop(CHAIN_CYCLE, started)
                return out

            def run(graph: str, values: dict):  # through static buffers where the model has them
                return executor.step(graph, num_seqs, tables, profiler, **values)

            return chain_cycle(run, self.spec, settings, pending, committed_len, block_table, spec_rows, draft_logits,
                               draft_hidden, noise)
