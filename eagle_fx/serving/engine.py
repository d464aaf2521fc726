"""The serving engine: continuous batching of requests over one SpeculativeModel (a chain).

    engine = Engine(model, tokenizer, speculation="adaptive")   # or a fixed k (0 included)
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step(): ...                           # RequestOutput per request with news

One `step()`: aborted requests are let go; waiting requests are admitted first come, first served
while a slot (a row of the model's max_batch_size) and KV blocks for prompt + max_tokens are free
(blocks are reserved up front, so a running request never runs out of them and nothing is ever
preempted; a request that does not fit waits, and every later one waits behind it); then one
prefill chunk of the oldest admitted group (chunked prefill, prefix caching: the model's options),
and one decode cycle of every running request (split_by_length=True: several, of like context
lengths, where the measured prices say so: eagle_fx.serving.length_groups). A request joins the
running batch when its prefill is done and leaves it when it stops (eos, a stop token or string,
max_tokens, abort); its blocks go back at once (its full blocks into the prefix cache when caching).
Each request keeps its slot for life: its row of the engine's device buffers (pending token,
committed length, the draft's last outputs, block table) and of a KV-sharing draft's ring.

Speculation (eagle_fx.serving.adaptive): with `speculation="adaptive"` each step picks k among `ks`
(default 0, 1 and the model's k) from measured cycle costs and the requests' recent acceptance; a
request whose acceptance collapses (a rolling window below `collapse_threshold`) is not speculated
for (a warning once, a metric; it rides in the others' cycle when that is cheaper than a cycle of
its own) and is probed again `probe_after` tokens later. A request decoded at k = 0 leaves the draft
behind: the base features of the tokens it commits are kept (a ring of `resume_window` positions per
slot, by default a whole sequence) and the draft catches up in one prefill-like call before it drafts
again; past the ring it stays at k = 0. With lazy_draft_prefill (adaptive; by default when prefix
caching is off) a prompt admitted while the engine is not speculating (its last decode ran its
speculating requests at k = 0, or none has run) has its base prefill only: the draft computes its
prompt in the same catch-up, when (if ever) a cycle speculates for it, a cost choose_k prices as it
prices any catch-up. A prompt admitted while the engine speculates gets the draft's prefill with the
base's at admission, as at a fixed k: a catch-up call per request later cost more than that (README,
stop 54). With plain_check (adaptive; on by default) what those choices deliver is checked against
plain decoding and against the largest k for every request (which leads at first) in adjacent
epochs of the engine's own running, and the fastest arm runs (eagle_fx.serving.plain_check): prices
of a few noisy cycles decide close races wrongly, and the check caps what that costs. A fixed k = 0
on a pair never drafts, and its prompts get no draft prefill (but with prefix caching or
kv_share='layer').

Lossless: every cycle is the model's chain cycle, so a greedy request's output is HF's greedy decode
of its prompt alone (fp32), whatever it is batched with and whatever k each cycle runs.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import torch

from eagle_fx.runtime.sampling import RowSampler, Sampler
from eagle_fx.runtime.scheduler import GenerateCall, decode_columns
from eagle_fx.runtime.stats import SpecDecodeStats
from eagle_fx.serving.adaptive import Acceptance, Exploration, SizeCosts, StepCosts, choose_k, speculation_ks
from eagle_fx.serving.admission import admit, prefill_step
from eagle_fx.serving.cost_probe import cycle_keys, measure_cycle_costs
from eagle_fx.serving.draft_catch_up import catch_up_draft
from eagle_fx.serving.engine_metrics import OFF_REASONS, engine_metrics
from eagle_fx.serving.grammars import EngineGrammars, commit
from eagle_fx.serving.length_groups import choice_prices, length_groups
from eagle_fx.serving.plain_check import ADAPTIVE, FULL, PLAIN, PlainCheck
from eagle_fx.serving.requests import Request, RequestOutput, SamplingParams, TextState, checked_prompt

log = logging.getLogger("eagle_fx.serving")


class Engine:
    def __init__(self, model, tokenizer=None, speculation: str | int = "adaptive", *, ks=None,
                 collapse_window: int = 8, collapse_threshold: float = 0.15, probe_after: int = 64,
                 resume_window: int | None = None, measure: bool = True, call: GenerateCall | None = None,
                 admission: str = "continuous", explore_every: int = 200, split_by_length: bool = False,
                 lazy_draft_prefill: bool | None = None, plain_check: bool = True):
        """call: a generate call's GenerateCall (model.generate runs on an engine): its sampler (one
        generator for every row), stats, profiler and graph-by-graph flag serve every request; the
        model's forced_drafts oracle applies. admission="waves": requests are admitted only when
        nothing runs, up to max_batch_size at a time (the wave runtime's policy, kept as the
        baseline continuous batching is measured against). explore_every: adaptive speculation runs a k not
        run in this many decisions at a size bucket for a few cycles there (adaptive.Exploration), so a noisy
        or stale cost does not keep it out (its service cost replaces it). split_by_length (opt-in): a step's batch
        runs as cycles of like context lengths where the measured prices say that is cheaper (length_groups;
        the probe then runs at a fixed k too). resume_window: positions of base features kept per slot for
        the draft's catch-up (None: a whole sequence, max_seq_len + the cycle's lookahead, which never wraps;
        feature_dim values per position and slot). lazy_draft_prefill (adaptive only): the draft prefill of a
        prompt admitted while the engine is not speculating deferred to its catch-up (where its prompt fits
        the ring; see the module); None: on unless prefix caching is (a block enters the prefix cache only
        with the draft's K/V, which a deferred prefill may never compute).
        plain_check (adaptive only): its choices checked against plain decoding and the largest k (which
        leads at first) in adjacent epochs, the fastest arm running (eagle_fx.serving.plain_check)."""
        if admission not in ("continuous", "waves"):
            raise ValueError(f"admission must be 'continuous' or 'waves', got {admission!r}")
        self.admission = admission
        if model.tree is not None:
            raise ValueError("the serving engine runs chains; this model has a draft tree (compile without draft_tree=)")
        if model.spec.vision_language:
            raise ValueError("the serving engine takes token prompts; a vision-language pair runs with generate()")
        k_max, ks = model.num_spec_tokens, speculation_ks(model, speculation, ks)
        self.model, self.tokenizer, self.ks = model, tokenizer, ks
        self.adaptive, self.exploration = len(ks) > 1, Exploration(ks, explore_every)
        self.split_by_length = split_by_length and not model.static_steps
        self._ks_before, self._ks_now = set(), set()  # the ks of the last step's cycles, and of this one's
        # the model's own cycle at its k (an injection point: tests set model.chain_cycle), others by k
        self.cycles = {k: model.chain_cycle if k == k_max else model.chain_cycle_for(k) for k in ks}
        self.kv, self.executor, self.device = model.kv_cache, model.executor, model.device
        self.collapse_window, self.collapse_threshold, self.probe_after = collapse_window, collapse_threshold, probe_after
        whole = self.kv.blocks_per_seq * model.options.block_size
        if resume_window is not None and not (isinstance(resume_window, int) and 2 <= resume_window):
            raise ValueError(f"resume_window must be an int >= 2 or None (a whole sequence), got {resume_window!r}")
        self.resume_window = whole if resume_window is None else min(resume_window, whole)
        if lazy_draft_prefill is None:
            lazy_draft_prefill = not model.options.prefix_caching
        self.lazy_draft_prefill = lazy_draft_prefill and self.adaptive and self.kv.kv_mode != "layer"
        # fixed k = 0 on a pair never drafts: its prompts skip the draft's prefill (kept where the prefix cache
        # takes a block only with the draft's K/V, and where the draft's K/V lives in the base's layers)
        self.draft_free = (model.speculates and ks == [0] and not model.options.prefix_caching
                           and self.kv.kv_mode != "layer")
        slots, spec, long = model.options.max_batch_size, model.spec, dict(dtype=torch.long, device=model.device)
        draft_vocab = (spec.vocab_size if spec.d2t is None else spec.d2t.shape[0]) if model.speculates else 0
        draft_hidden = spec.draft_hidden_size if model.speculates else 0
        # per slot, on the device: what the next cycle of that slot's request reads
        self.pending = torch.zeros(slots, **long)
        self.committed = torch.zeros(slots, **long)
        self.draft_logits = torch.zeros(slots, draft_vocab, device=model.device, dtype=model.dtype)
        self.draft_hidden = torch.zeros(slots, draft_hidden, device=model.device, dtype=model.dtype)
        self.tables = torch.zeros(slots, self.kv.blocks_per_seq, **long)
        # base features of tokens the draft has not seen (committed at k = 0; lazy: prompts), for its catch-up
        self.features = torch.zeros(slots, self.resume_window, spec.feature_dim, device=model.device,
                                    dtype=model.dtype) if self.adaptive else None
        self.free_slots = list(range(slots - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.prefilling: list[tuple] = []  # (requests, chunk generator, wave, call) in order of admission
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.aborted: list[Request] = []
        self.call = call
        self.stats = call.stats if call is not None else SpecDecodeStats(max(k_max, 1))
        self.profiler = call.profiler if call is not None else None
        self.acceptance = Acceptance(max(k_max, 1))  # every request's, the prior of a new one
        self.grammars = EngineGrammars(tokenizer, model.spec.vocab_size)  # structured output
        self.costs = StepCosts()  # seconds of a cycle per (k, batch size, keys its attention reads)
        self.outside = SizeCosts()  # seconds of a step outside its cycles, prefill and catch-up, per running requests
        self.catch_ups = SizeCosts(extrapolate=False)  # seconds of a draft catch-up call, per tokens behind (powers of 2)
        self._step_ended: float | None = None  # when the last step that left requests running ended
        self._cycle_seconds = 0.0
        self.current_k = ks[-1]  # the last cycle's k
        # whether the last decode ran its speculating requests at k > 0 (lazy draft prefill defers only when not)
        self.last_decode_speculated = False
        # pick_k's last choice (the plan its hysteresis keeps): a plain or full epoch of the check leaves it, so
        # that adaptive resumes where it was (from k = 0, the catch-up it must price kept it there)
        self.chosen = (ks[-1], False)
        self.finished_by_reason = dict.fromkeys(("stop", "length", "abort"), 0)
        self.off_events, self.cycles_by_k = dict.fromkeys(OFF_REASONS, 0), dict.fromkeys(ks, 0)
        self.prompt_tokens = self.generation_tokens = 0
        self.switch_cycles, self.switch_seconds, self.switch_priced, self.catch_up_seconds = 0, 0.0, 0.0, 0.0
        self.plain_check = PlainCheck() if plain_check and self.adaptive else None
        self._step_tokens = 0
        self._ids, self._warned_collapse = itertools.count(), False
        if measure and (self.adaptive or self.split_by_length):
            measure_cycle_costs(self)  # into self.costs (eagle_fx.serving.cost_probe)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request (token ids); returns its id. Bad input is a ValueError, before anything runs."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = checked_prompt(self, prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is in use")
        eos = set() if params.ignore_eos else set(params.eos_token_id if params.eos_token_id is not None
                                                  else self.model.spec.eos)
        request = Request(request_id, prompt, params, frozenset(eos | set(params.stop_token_ids)), next(self._ids))
        request.grammar = self.grammars.state_for(params, frozenset(eos))  # a bad grammar: an error now
        if not params.greedy and self.call is None:
            request.generator = torch.Generator(device=self.device).manual_seed(
                params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        if self.tokenizer is not None:
            request.text = TextState(self.tokenizer, params.stop)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now: its blocks and slot are freed (a request mid-prefill: when its group's
        prefill ends); step() then returns its last output (finish_reason "abort"). False if unknown."""
        request = self.requests.get(request_id)
        if request is None or request.finish_reason is not None:
            return False
        request.finish_reason = "abort"
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
            self._release(request, cache=False)
        self.aborted.append(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.aborted)

    @property
    def num_running(self) -> int:
        """Requests holding a slot: running, or in prefill."""
        return len(self.running) + sum(len(group[0]) for group in self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One step (see the module); returns the outputs of requests with news. Holds the model's
        lock (a generate() on the same model waits), except inside generate() itself."""
        if self.call is not None:
            return self._step()
        with self.model._lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        outputs = [r.progress([]) for r in self.aborted]
        for r in self.aborted:
            self._forget(r)
        self.aborted = []
        self._admit()
        prefill_seconds = time.perf_counter()
        if self.prefilling:
            self._prefill_chunk(outputs)
        prefill_seconds = time.perf_counter() - prefill_seconds
        size, self._cycle_seconds, self._step_tokens = len(self.running), 0.0, 0  # (cycles and catch-ups)
        self._ks_before, self._ks_now = self._ks_now, set()
        if self.running:
            self._decode(outputs)
        ended = time.perf_counter()
        if size and self._step_ended is not None:  # the seconds between cycles: since the last step, and in this one
            self.outside.observe(size, ended - self._step_ended - prefill_seconds - self._cycle_seconds)
        if size and self.plain_check is not None:  # (outside the cycles: the robust estimate, not this gap)
            outside = self.outside.cost(size) if self.outside else 0.0
            self.plain_check.record(self._step_tokens, self._cycle_seconds + outside, size)
        self._step_ended = ended if self.running else None  # else the caller may wait for requests: not a cost
        return outputs

    def _admit(self) -> None:
        admit(self)

    def _prefill_chunk(self, outputs) -> None:
        prefill_step(self, outputs)

    # ------------------------------------------------------------------ decode
    def _decode(self, outputs) -> None:
        for r in self.running:  # a collapsed request's probe: speculate again
            if not r.speculating and r.off_reason == "acceptance_collapse" and len(r.output) >= r.probe_at:
                r.speculating, r.off_reason = True, None
                r.watch.clear()
        spec = [r for r in self.running if r.speculating and self.can_speculate(r)]
        off = [r for r in self.running if not (r.speculating and self.can_speculate(r))]
        check = self.plain_check  # (the load an epoch of the check counts in: requests in the engine)
        arm = ADAPTIVE if check is None else check.arm_for(self.num_running + self.num_waiting)
        if not (self.adaptive and spec) or arm == PLAIN:
            k, ride = self.ks[0], False
        elif arm == FULL:
            k, ride = self.ks[-1], False
        else:
            k, ride = self.chosen = self.pick_k(spec, off)
        if k == 0 and self.current_k > 0 and spec:
            self.off_events["plain_check" if arm == PLAIN else "cost"] += 1
        self.current_k = k
        self.last_decode_speculated = k > 0 and bool(spec)
        groups = [(k, spec), (0, off)] if k > 0 and not ride else [(k, spec + off)]
        for k, group in groups:
            if group:
                if k > 0:
                    behind = [r for r in group if r.draft_upto < r.committed]
                    if behind:
                        self._catch_up(behind)
                for part in length_groups(self, k, group):
                    self._cycle(k, part, outputs)
                self.exploration.ran(k, len(group))  # (at the decision's size, whatever cycles it ran as)

    def pick_k(self, spec: list[Request], off: list[Request]) -> tuple[int, bool]:
        """(k, ride): the k of this step's cycle of the speculating requests `spec`, and whether those
        at k = 0 (`off`) ride in it rather than run a cycle of their own: the fastest by measured costs
        and recent acceptance (eagle_fx.serving.adaptive). Only requests the draft can catch up on ride."""
        exploring = self.exploration.continuing(len(spec))
        if exploring is not None:
            return exploring, False
        behind = sum(r.committed - r.draft_upto for r in spec)
        behind_all = behind + sum(r.committed - r.draft_upto for r in off)
        catch_up, ride_catch_up = (self.catch_ups.cost(b) if b and self.catch_ups else 0.0 for b in (behind, behind_all))
        keys = tuple(cycle_keys(self.model, [r.committed for r in g]) for g in (spec, off, spec + off))
        stale = self.exploration.due(len(spec), lambda k: k == 0 or catch_up <= self.costs.cost(
            k, len(spec), float('inf'), keys[0]))  # (a k > 0 unless its catch-up costs more than its cycle)
        if stale is not None:
            return stale, False
        prior = self.acceptance.rates()
        rates = [r.acceptance.rates(prior) for r in spec]
        off_rates = [r.acceptance.rates(prior) for r in off] if all(map(self.can_speculate, off)) else None
        # what a catch-up is repaid over: the output tokens left to the requests it lets speculate
        remaining = sum(r.params.max_tokens - len(r.output) for r in spec if r.draft_upto < r.committed)
        ride_remaining = remaining + sum(r.params.max_tokens - len(r.output) for r in off if r.draft_upto < r.committed)
        return choose_k(self.ks, self.costs, rates, len(off), self.chosen, self.outside,
                        catch_up, remaining, keys, off_rates, ride_catch_up, choice_prices(self, spec, off),
                        ride_remaining)

    def can_speculate(self, request) -> bool:
        """False once the request fell further behind the draft than its ring keeps (it stays at k = 0)."""
        return self.can_catch_up(request.committed - request.draft_upto)

    def can_catch_up(self, behind: int) -> bool:
        """Whether the ring keeps the features of a catch-up over `behind` positions (and the one before)."""
        return behind < self.resume_window

    def _cycle(self, k: int, group: list[Request], outputs) -> None:
        """One cycle at k of `group`, timed whole (its host bookkeeping differs by k) into choose_k's costs."""
        started, long = time.perf_counter(), dict(dtype=torch.long, device=self.device)
        slots = torch.tensor([r.slot for r in group], **long)
        committed = self.committed[slots]
        table = self._table(slots, max(r.committed for r in group))
        forced, masks = None, None
        if any(r.grammar is not None for r in group):  # (rows of requests without one: all-allowed)
            masks = self.grammars.cycle_masks(group, k, self.stats)
        if self.model.forced_drafts is not None and k > 0:  # a test oracle's tokens for the drafts
            forced = torch.as_tensor(self.model.forced_drafts([r.context for r in group], k), **long)
        accepted_t, next_t, drafts, draft_logits, draft_hidden, features = self.cycles[k](
            self.executor, self._sampler(group), self.pending[slots], committed, table, slots,
            self.draft_logits[slots], self.draft_hidden[slots], profiler=self.profiler, forced=forced, masks=masks,
            graph_by_graph=self.call is not None and self.call.graph_by_graph)
        size = len(group)
        host = torch.cat([accepted_t, next_t, drafts.reshape(-1)]).tolist()
        accepted, next_token = host[:size], host[size:2 * size]
        self._step_tokens += size + sum(accepted)
        self.pending[slots], self.committed[slots] = next_t, committed + accepted_t + 1
        if k > 0:
            self.draft_logits[slots], self.draft_hidden[slots] = draft_logits, draft_hidden
        elif self.adaptive:  # f_m of each request's committed position m, for the draft's catch-up
            self.features[slots, committed % self.resume_window] = features[:, 0]
        if self.model.options.prefix_caching:  # features of [pending, accepted...] (past them: overwritten later)
            path_positions = committed[:, None] + torch.arange(k + 1, **long)[None]
            self.kv.keep_block_features(table, torch.repeat_interleave(torch.arange(size, **long), k + 1),
                                        path_positions.reshape(-1), features.reshape(size * (k + 1), -1))
        for row, r in enumerate(group):
            a = accepted[row]
            new = host[2 * size + row * k:2 * size + row * k + a] + [next_token[row]]
            before = r.committed
            r.committed += a + 1
            if k > 0:
                r.draft_upto = r.committed
                self._record(r, k, a)
            elif not self.adaptive:  # fixed k = 0: every cycle a step of no drafts (vLLM's count, generate's)
                self.stats.record([0], 0)
            if self._emit(r, new, outputs):
                final = before + self.model.draft_offset if k > 0 else min(r.draft_upto + 1, before + 1)
                self.running.remove(r)
                self._finish(r, final=final)
        seconds, keys = time.perf_counter() - started, table.numel() * self.model.options.block_size
        if masks is None and k not in self._ks_before | self._ks_now:  # the first after a switch: not a price
            self.switch_cycles += 1
            self.switch_seconds += seconds
            self.switch_priced += self.costs.cost(k, size, seconds, keys)
        elif masks is None:  # (a grammar's cycle, which pays its masks' host time: neither)
            self.costs.observe(k, size, seconds, keys=keys)
        self._cycle_seconds += seconds
        self.cycles_by_k[k] += 1
        self._ks_now.add(k)

    def _record(self, r: Request, k: int, a: int) -> None:
        """A cycle's drafts of r: counted, and r's acceptance updated. A request riding with speculation
        off (pick_k) stays off until its probe, and its acceptance is not the prior of new requests."""
        self.stats.record([a], k)
        r.acceptance.record(k, a)
        if not r.speculating:
            return
        self.acceptance.record(k, a)
        if r.watch.record(a, k) and self.adaptive:
            r.speculating, r.off_reason, r.probe_at = False, "acceptance_collapse", len(r.output) + self.probe_after
            self.off_events["acceptance_collapse"] += 1
            if not self._warned_collapse:
                self._warned_collapse = True
                log.warning("eagle_fx serving: request %s: draft acceptance below %.0f%% over its last %d cycles; "
                            "speculation off for it (probed again after %d tokens). A draft trained for another base, "
                            "or text unlike its training data, does this (metric speculation_off_events_total).",
                            r.request_id, 100 * self.collapse_threshold, self.collapse_window, self.probe_after)

    def _catch_up(self, group: list[Request]) -> None:
        started, slots = time.perf_counter(), [r.slot for r in group]
        rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.draft_logits[rows], self.draft_hidden[rows] = catch_up_draft(self.model, group, self.features, slots,
                                                                          self.tables, self.resume_window)
        self.draft_logits[rows[:1]].sum().item()  # (a host read: the call's time, not its launch)
        behind = sum(r.committed - r.draft_upto for r in group)  # (by the power of two at or above: a few sizes)
        seconds = time.perf_counter() - started
        self.catch_ups.observe(1 << (behind - 1).bit_length(), seconds)
        self._cycle_seconds += seconds
        self.catch_up_seconds += seconds
        for r in group:
            r.draft_upto = r.committed

    def _table(self, slots: torch.Tensor, longest: int) -> torch.Tensor:
        """The slots' block tables for a cycle of sequences up to `longest` committed tokens."""
        return decode_columns(self.model, self.tables[slots], longest)

    def _sampler(self, group: list[Request]):
        if self.call is not None:
            return self.call.sampler
        if all(r.params.greedy for r in group):
            return Sampler()
        return RowSampler([r.params.temperature for r in group], [max(r.params.top_k, 0) for r in group],
                          [r.params.top_p for r in group], [r.generator for r in group])

    def _emit(self, r: Request, new: list[int], outputs) -> bool:
        """Append tokens up to a stop; one RequestOutput; True when the request is finished."""
        added = r.append(new)
        commit(r, added)  # its grammar (structured output) follows every token it keeps
        self.generation_tokens += len(added)
        outputs.append(r.progress(added))
        return r.finish_reason is not None

    def _finish(self, r: Request, final: int) -> None:
        if self.model.options.prefix_caching:
            self.kv.cache_finished([r.prompt], [r.output], r.blocks, [final], self.model.options.prefill_shift)
        self._release(r, cache=True)
        self._forget(r)

    def _release(self, r: Request, cache: bool) -> None:
        if r.blocks is not None:
            self.kv.release(r.blocks)
            r.blocks = None
        if r.slot is not None:
            self.free_slots.append(r.slot)
            r.slot = None

    def _forget(self, r: Request) -> None:
        self.finished_by_reason[r.finish_reason] += 1
        self.requests.pop(r.request_id, None)

    def metrics(self) -> dict:
        """A snapshot of the counters /metrics shows (eagle_fx.serving.prometheus names them)."""
        return engine_metrics(self)
