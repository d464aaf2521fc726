"""Base + draft prefill of a wave's prompts, whole or in chunks of `prefill_chunk_size` tokens.

Unshifted chunk [a, c): the draft gets tokens t_a..t_{c-1} with features (carry = f_{a-1}),
f_a..f_{c-2} (the shift of features is inside the graph, drop_prefill_shift); in a sequence's
last chunk it also gets the token sampled after the prompt, t_n at position n with f_{n-1}, so its
output there is the draft's state before the first cycle (what d_1 is drawn from) and no separate
draft-extend call is needed (except with kv_share=LAYER: scheduler.enter_draft). Shifted chunk
[a, c): draft tokens t_{a+1}..t_c, where t_c is the real next prompt token for an inner chunk and
the sampled token only for the last one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_fx.runtime.kv_cache import slot_mapping
from eagle_fx.structured.bitmask import mask_logits


@dataclass
class Prefilled:
    pending: torch.Tensor  # [B] the token sampled after each prompt
    last_features: torch.Tensor  # [B, F] the base's feature at each prompt's last token
    draft_logits: torch.Tensor | None  # [B, Vd] the draft's last prefill call (shifted: what d_1 is drawn from)
    draft_hidden: torch.Tensor | None  # [B, H]
    pending_in_draft: bool = False  # unshifted: the draft's state already includes the pending token


def prefill(model, call, wave, carry: torch.Tensor) -> Prefilled:
    """prompts[s][cached_tokens[s]:] of every sequence of the wave, chunk by chunk; carry [B, F] is
    each sequence's feature before its first computed token (updated in place chunk by chunk)."""
    chunks = prefill_chunks(model, call, wave, carry)
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value


def prefill_chunks(model, call, wave, carry: torch.Tensor, draft_prefill: bool = True, keep_features=None):
    """prefill() one chunk at a time: a generator that yields after each chunk (the serving engine
    runs decode cycles in between) and returns the Prefilled. wave.spec_rows (when set): each
    sequence's row of the per-sequence buffers (the engine's slot), else its index in the wave.
    draft_prefill=False: the base's prefill only (the serving engine's lazy draft prefill: the draft catches
    up later, from the base features, eagle_fx.serving.draft_catch_up); keep_features(rows, positions,
    features), when given, receives each chunk's base features with each token's row and position."""
    device, block_size = model.device, model.options.block_size
    long = dict(dtype=torch.long, device=device)
    prompts, block_table, stats = wave.graph_prompts, wave.blocks.block_table, call.stats
    num_seqs = len(prompts)
    lens = [len(p) for p in prompts]
    chunk = model.options.prefill_chunk_size or max(lens)
    done = list(wave.blocks.cached_tokens)  # prompt tokens in the cache so far, per sequence
    pending = torch.zeros(num_seqs, **long)
    last_features = carry.clone()
    draft_logits = draft_hidden = None
    # (kv_share=LAYER's pruned draft prefill computes no K/V of its own: its pending rows go to enter_draft)
    pending_in_draft = (bool(model.draft_offset) and model.speculates and model.kv_cache.kv_mode != "layer"
                        and draft_prefill)
    while True:
        chunk_seqs = [s for s in range(num_seqs) if done[s] < lens[s]]
        if not chunk_seqs:
            break
        spans = [(done[s], min(done[s] + chunk, lens[s])) for s in chunk_seqs]
        num_tokens = torch.tensor([end - begin for begin, end in spans], **long)
        query_start_loc = torch.zeros(len(chunk_seqs) + 1, **long)
        query_start_loc[1:] = num_tokens.cumsum(0)
        ids = torch.tensor([t for s, (begin, end) in zip(chunk_seqs, spans) for t in prompts[s][begin:end]], **long)
        positions = torch.cat([torch.arange(begin, end, **long) for begin, end in spans])
        seq = torch.repeat_interleave(torch.arange(len(chunk_seqs), **long), num_tokens)
        rows = torch.tensor(chunk_seqs, **long)
        spec_rows = rows if wave.spec_rows is None else wave.spec_rows[rows]
        table = block_table[rows]
        slots = slot_mapping(table, seq, positions, block_size)
        last = query_start_loc[1:] - 1
        logits, features = model.executor.prefill(
            "base", wave.tables, call.profiler, input_ids=ids[None], positions=positions[None], logits_indices=last,
            slot_mapping=slots, block_table=table, query_start_loc=query_start_loc, seq_rows=rows)
        is_final = [end == lens[s] for s, (begin, end) in zip(chunk_seqs, spans)]
        if wave.first_allowed is not None:  # structured output: the first token under each grammar
            logits = mask_logits(logits, wave.first_allowed[rows])
        sampled = call.sampler.select(chunk_seqs).pick(logits)
        final = torch.tensor(is_final, dtype=torch.bool, device=device)
        next_tokens = None
        if model.options.prefill_shift:  # the look-ahead token
            look_ahead = torch.tensor([prompts[s][end] if not f else 0
                                       for s, (begin, end), f in zip(chunk_seqs, spans, is_final)], **long)
            next_tokens = torch.where(final, sampled, look_ahead)
        ends = torch.tensor([end for begin, end in spans], **long)
        if keep_features is not None:
            keep_features(spec_rows[seq], positions, features)
        if not (model.speculates and draft_prefill):  # num_spec_tokens=0: no draft; or the draft's prefill deferred
            chunk_logits, chunk_hidden = logits.new_zeros(len(chunk_seqs), 0), features.new_zeros(len(chunk_seqs), 0)
        else:
            draft = dict(input_ids=ids, positions=positions, features=features, logits_indices=last,
                         query_start_loc=query_start_loc, slot_mapping=slots)
            if pending_in_draft:  # unshifted: each prompt's sampled token enters the draft in its last chunk
                draft = with_pending_tokens(draft, num_tokens, final, sampled, table, block_size)
            chunk_logits, chunk_hidden = model.executor.prefill(
                "draft_prefill", wave.tables, call.profiler, input_ids=draft["input_ids"][None],
                positions=draft["positions"][None], features=draft["features"], logits_indices=draft["logits_indices"],
                next_tokens=next_tokens, carry_features=carry[rows], query_start_loc=draft["query_start_loc"],
                slot_mapping=draft["slot_mapping"], block_table=table, spec_rows=spec_rows, committed_len=ends)
            # the draft computes every prompt token, or (kv_share=LAYER, rows pruned) one per sequence
            stats.prefill_tokens_computed_draft += len(chunk_seqs) if model.kv_cache.kv_mode == "layer" else ids.numel()
        if model.options.prefix_caching:
            model.kv_cache.keep_block_features(table, seq, positions, features)
        carry[rows] = features[last]
        if draft_logits is None:
            draft_logits = chunk_logits.new_zeros(num_seqs, chunk_logits.shape[-1])
            draft_hidden = chunk_hidden.new_zeros(num_seqs, chunk_hidden.shape[-1])
        final_rows = rows[final]
        pending[final_rows] = sampled[final]
        last_features[final_rows] = features[last][final]
        draft_logits[final_rows], draft_hidden[final_rows] = chunk_logits[final], chunk_hidden[final]
        for s, (begin, end) in zip(chunk_seqs, spans):
            done[s] = end
        yield
    return Prefilled(pending, last_features, draft_logits, draft_hidden, pending_in_draft)


def with_pending_tokens(draft: dict, num_tokens: torch.Tensor, final: torch.Tensor, sampled: torch.Tensor,
                        table: torch.Tensor, block_size: int) -> dict:
    """The unshifted draft prefill's inputs of one chunk (input_ids, positions, features,
    logits_indices, query_start_loc, slot_mapping: one row per prompt token) with one more row after
    each sequence whose prompt ends in it (`final`): its sampled token at the next position. That
    row's feature is the sequence's last prompt row again, a placeholder the graph never reads (it
    shifts features right by one within each sequence: the pending token gets the last prompt
    token's feature, f_{n-1}). logits_indices then point at the pending rows, whose output is the
    draft's state before the first cycle, as a draft extend of the pending token would give."""
    device = num_tokens.device
    rows = num_tokens + final.long()
    starts = draft["query_start_loc"]
    query_start_loc = torch.zeros_like(starts)
    query_start_loc[1:] = rows.cumsum(0)
    seq = torch.repeat_interleave(torch.arange(rows.shape[0], device=device), rows)
    offset = torch.arange(seq.shape[0], device=device) - query_start_loc[seq]  # the row's index in its sequence
    pending = offset == num_tokens[seq]
    source = starts[seq] + torch.minimum(offset, num_tokens[seq] - 1)  # the prompt row it copies (pending: the last)
    positions = draft["positions"][source] + pending.long()
    return dict(input_ids=torch.where(pending, sampled[seq], draft["input_ids"][source]), positions=positions,
                features=draft["features"][source], logits_indices=query_start_loc[1:] - 1,
                query_start_loc=query_start_loc, slot_mapping=slot_mapping(table, seq, positions, block_size))
