"""Admission and prefill of the serving engine's waiting requests (eagle_fx.serving.engine).

admit: waiting requests, first come, first served, each into a free slot (a row of the engine's
device buffers) with KV blocks for prompt + max_tokens reserved up front (a request that does not
fit waits, and every later one behind it; admission="waves": only when nothing runs); the requests
admitted in one step form a group, prefilled together chunk by chunk (eagle_fx.runtime.prefill).
prefill_step: one chunk of the oldest group; after its last, each request's first token is emitted
and those that go on join the running batch with the draft's state of their prompt (entered at
their slots).
"""
from __future__ import annotations

import logging

import torch

from eagle_fx.runtime.kv_cache import PoolExhausted, WaveBlocks
from eagle_fx.runtime.prefill import prefill_chunks
from eagle_fx.runtime.scheduler import GenerateCall, Wave, enter_draft
from eagle_fx.runtime.stats import Profiler
from eagle_fx.serving.adaptive import Acceptance, CollapseWatch

log = logging.getLogger("eagle_fx.serving")


def admit(engine) -> None:
    """Waiting requests into free slots and reserved blocks while both last (see the module); the
    admitted ones, if any, as one group queued for prefill (engine.prefilling)."""
    options, group = engine.model.options, []
    if engine.admission == "waves" and (engine.running or engine.prefilling):
        return
    while engine.waiting and engine.free_slots:
        request = engine.waiting[0]
        try:
            request.blocks = engine.kv.admit([request.prompt], [len(request.prompt)], request.params.max_tokens,
                                             engine.model.lookahead, options.prefix_caching, options.prefill_shift)
        except PoolExhausted:
            if engine.running or engine.prefilling or group:
                break  # first come, first served: it waits for blocks, and the rest behind it
            # nothing of this engine holds blocks: they are held outside it and may never come back
            if engine.call is not None:
                raise  # generate(): as before, the error that says what to raise
            log.warning("eagle_fx serving: request %s aborted: the KV pool's blocks are held outside the "
                        "engine", request.request_id)
            engine.waiting.popleft().finish_reason = "abort"
            engine.aborted.append(request)
            continue
        engine.waiting.popleft()
        request.slot = engine.free_slots.pop()
        request.cached = request.blocks.cached_tokens[0]
        engine.tables[request.slot] = request.blocks.block_table[0]
        group.append(request)
    if not group:
        return
    hits = sum(r.cached for r in group)
    engine.stats.prefix_hit_tokens_base += hits
    engine.stats.prefix_hit_tokens_draft += hits
    engine.stats.prefill_tokens_computed_base += sum(len(r.prompt) for r in group) - hits
    engine.prompt_tokens += sum(len(r.prompt) for r in group)
    long = dict(dtype=torch.long, device=engine.device)
    blocks = WaveBlocks([r.blocks.rows[0] for r in group], [r.cached for r in group],
                        torch.cat([r.blocks.block_table for r in group]))
    prompts = [r.prompt for r in group]
    wave = Wave(prompts, prompts, prompts, None, blocks, spec_rows=torch.tensor([r.slot for r in group], **long),
                first_allowed=engine.grammars.first_allowed(group, engine.device))
    call = engine.call or GenerateCall(engine._sampler(group), engine.stats,
                                       Profiler(engine.stats, False, engine.device), set(), 1)
    carry = engine.kv.carry_features(blocks, engine.model.bootstrap)
    # deferred only while the engine is not speculating: then the draft may never be needed for it
    lazy = (engine.lazy_draft_prefill and not engine.last_decode_speculated
            and all(engine.can_catch_up(len(r.prompt) - r.cached + 1) for r in group))
    keep = None
    if lazy:  # the base's prefill only; its features kept for the draft's catch-up, with f_{cached-1} (the carry)
        window, slots = engine.resume_window, wave.spec_rows
        engine.features[slots, torch.tensor([r.cached - 1 for r in group], **long) % window] = carry

        def keep(rows, positions, features):
            engine.features[rows, positions % window] = features
    skip = lazy or engine.draft_free  # (a fixed k = 0's: no catch-up ever, nothing kept)
    for r in group:
        r.lazy = skip
    chunks = prefill_chunks(engine.model, call, wave, carry, draft_prefill=not skip, keep_features=keep)
    engine.prefilling.append((group, chunks, wave, call))


def prefill_step(engine, outputs) -> None:
    """One prefill chunk of the oldest admitted group; after its last, the group's first tokens
    into `outputs` and the requests that go on into the running batch."""
    group, chunks, wave, call = engine.prefilling[0]
    try:
        next(chunks)
        return
    except StopIteration as done:
        first = done.value
    engine.prefilling.pop(0)
    long = dict(dtype=torch.long, device=engine.device)
    joining = []
    for i, (request, token) in enumerate(zip(group, first.pending.tolist())):
        if request.finish_reason == "abort":  # aborted mid-prefill: let go now
            engine._release(request, cache=False)
            continue
        request.committed = len(request.prompt)
        if engine._emit(request, [token], outputs):  # (its prompt's draft K/V is final only where prefilled)
            engine._finish(request, final=request.cached if request.lazy else len(request.prompt))
        else:
            joining.append(i)
    if not joining:
        return
    rows = torch.tensor(joining, **long)
    joined = [group[i] for i in joining]
    slots = torch.tensor([r.slot for r in joined], **long)
    committed = torch.tensor([len(r.prompt) for r in joined], **long)
    pending = first.pending[rows]
    engine.pending[slots], engine.committed[slots] = pending, committed
    if engine.model.speculates and not group[0].lazy:
        table = engine._table(slots, max(len(r.prompt) for r in joined))
        engine.draft_logits[slots], engine.draft_hidden[slots] = enter_draft(
            engine.model, engine.profiler, None, first, rows, pending, committed, table, slots)
    for r in joined:
        # the draft has seen every committed token and the pending one; lazy: only the cached prefix
        r.draft_upto = r.cached - 1 if r.lazy else r.committed
        r.speculating, r.off_reason = True, None
        r.watch = CollapseWatch(engine.collapse_window, engine.collapse_threshold)
        r.acceptance = Acceptance(engine.acceptance.num_positions)
        engine.running.append(r)
