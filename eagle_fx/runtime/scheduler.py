"""Requests in waves: validation, one wave's decode from prefill to stop, eos / max_new_tokens.

A generate call holds its own state (a `GenerateCall`: sampler, stats, profiler, stopping rules)
and each wave its own (`Wave`: prompts, blocks, image tables, outputs); nothing of either lives on
the model, so a model keeps no per-call state between or during calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from eagle_fx.multimodal import wave_inputs
from eagle_fx.runtime.cycle import ActiveBatch, Verified, extend_draft, verify_tree
from eagle_fx.runtime.executor import WaveTables
from eagle_fx.runtime.kv_cache import WaveBlocks, slot_mapping
from eagle_fx.runtime.prefill import prefill
from eagle_fx.runtime.sampling import Sampler
from eagle_fx.runtime.stats import Profiler, SpecDecodeStats


class _ConfigEos:
    """Default of generate(eos_token_id=...): the base's generation_config eos, as HF generate does
    when eos_token_id is not passed (an explicit None means: never stop at an eos token)."""

    def __repr__(self) -> str:
        return "<generation_config.eos_token_id>"


CONFIG_EOS = _ConfigEos()


def _ids_list(x) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def check_prompts(prompts, max_new_tokens, vocab_size: int, max_seq_len: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else None
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple, torch.Tensor)) for p in prompts):
        raise TypeError("prompts must be a list of token-id lists, e.g. [[1, 2, 3], [4, 5]]")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    out = []
    for i, p in enumerate(prompts):
        p = _ids_list(p)
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise TypeError(f"prompt {i} holds non-integer token ids; pass ints")
        bad = [t for t in p if t < 0 or t >= vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id(s) {bad[:5]} outside the vocab [0, {vocab_size})")
        out.append(p)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    for i, p in enumerate(out):
        if len(p) + max_new_tokens > max_seq_len:
            raise ValueError(
                f"prompt {i}: {len(p)} prompt tokens + max_new_tokens {max_new_tokens} > max_seq_len "
                f"{max_seq_len}; shorten the prompt, lower max_new_tokens, or compile with a larger max_seq_len")
    return out


def eos_set(eos_token_id, default_eos) -> set[int]:
    if eos_token_id is CONFIG_EOS:  # like HF generate without eos_token_id: the model's own
        return set(default_eos)
    if eos_token_id is None:
        return set()
    ids = [eos_token_id] if not isinstance(eos_token_id, (list, tuple, set, torch.Tensor)) else list(eos_token_id)
    ids = [int(e) if isinstance(e, torch.Tensor) and e.numel() == 1 else e for e in ids]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
        raise TypeError(f"eos_token_id must be a token id (int), a list of ids or None, got {eos_token_id!r}; for a "
                        "token string use tokenizer.convert_tokens_to_ids(...)")
    return set(ids)


@dataclass
class GenerateCall:
    """What one generate call decides and counts."""

    sampler: Sampler
    stats: SpecDecodeStats
    profiler: Profiler
    eos: set[int]
    max_new_tokens: int
    streamer: object = None  # transformers' streamer protocol: put(ids), end() (one prompt)
    graph_by_graph: bool = False  # generate(profile="graphs"): the chain cycle through the executor, timed per graph

    def emit(self, out: list[int], context: list[int], new: list[int]) -> bool:
        """Append new tokens, stopping at eos (kept) or max_new_tokens; True when finished."""
        for t in new:
            out.append(t)
            context.append(t)
            if self.streamer is not None:
                self.streamer.put(torch.tensor([t]))
            if t in self.eos or len(out) >= self.max_new_tokens:
                return True
        return False


@dataclass
class Wave:
    """Up to max_batch_size requests decoded together."""

    prompts: list[list[int]]  # as given
    graph_prompts: list[list[int]]  # as the graphs see them (image placeholders as virtual ids)
    keys: list[list[int]]  # prefix-cache keys (image placeholders as image-content keys)
    tables: WaveTables | None
    blocks: WaveBlocks | None = None
    outputs: list[list[int]] = field(default_factory=list)
    contexts: list[list[int]] = field(default_factory=list)  # prompt + output, per sequence
    # per sequence, once it stops: leading positions whose base AND draft K/V are final
    final_positions: list[int | None] = field(default_factory=list)
    spec_rows: torch.Tensor | None = None  # each sequence's row of per-sequence buffers (None: its index)
    first_allowed: torch.Tensor | None = None  # [n, V] bool: the tokens each first token may be (a grammar's)

    def contexts_of(self, batch: ActiveBatch) -> list[list[int]]:
        return [self.contexts[s] for s in batch.seqs]


def new_wave(model, prompts: list[list[int]], images: list) -> Wave:
    graph_prompts = keys = prompts
    tables = None
    if model.spec.vision_language:  # this wave's image rows and M-RoPE table; placeholders as virtual ids / image keys
        graph_prompts, keys, mm_embeds, rope = wave_inputs(
            prompts, images, model.spec.vocab_size, model.spec.image_token_id, model.spec.embed_dim, model.spec.mrope,
            model.device, model.dtype)
        tables = WaveTables(mm_embeds, rope)
    return Wave(prompts, graph_prompts, keys, tables, outputs=[[] for _ in prompts],
                contexts=[list(p) for p in prompts], final_positions=[None] * len(prompts))


def run_wave(model, call: GenerateCall, wave: Wave) -> list[list[int]]:
    """Take blocks (cached prefix first), decode, then cache the finished sequences' full blocks."""
    kv, options, stats = model.kv_cache, model.options, call.stats
    wave.blocks = kv.admit(wave.keys, [len(p) for p in wave.prompts], call.max_new_tokens, model.lookahead,
                           options.prefix_caching, options.prefill_shift)
    try:
        hits = sum(wave.blocks.cached_tokens)
        stats.prefix_hit_tokens_base += hits
        stats.prefix_hit_tokens_draft += hits
        stats.prefill_tokens_computed_base += sum(len(p) for p in wave.prompts) - hits
        decode_wave(model, call, wave)
        if options.prefix_caching:
            kv.cache_finished(wave.keys, wave.outputs, wave.blocks, wave.final_positions, options.prefill_shift)
        return wave.outputs
    finally:
        kv.release(wave.blocks)


def decode_width(model, longest: int) -> int:
    """Blocks a cycle's table needs: the longest sequence's committed tokens (`longest`, known on the
    host) and one cycle's lookahead. The decode-step attention reads every key of its table row, so
    a narrower table is less work; its width is a dynamic size of the compiled graphs."""
    return model.kv_cache.table_width(longest + model.lookahead + model.draft_offset)


def decode_columns(model, full_rows: torch.Tensor, longest: int) -> torch.Tensor:
    """full_rows (whole block-table rows) cut to decode_width columns, with standard strides (no
    stride guard); the whole rows with static buffers."""
    if model.static_steps:
        return full_rows
    return full_rows[:, :decode_width(model, longest)].clone(memory_format=torch.contiguous_format)


def decode_table(model, wave: Wave, rows: torch.Tensor, longest: int,
                 previous: torch.Tensor | None = None) -> torch.Tensor:
    """The block table of the wave's sequences `rows` for the next cycle (decode_columns).
    previous: these rows' table of the last cycle, returned as it is when the width still holds."""
    if previous is not None and not model.static_steps and previous.shape[1] == decode_width(model, longest):
        return previous  # the same rows' table, as wide: reuse it
    return decode_columns(model, wave.blocks.block_table[rows], longest)


def enter_draft(model, profiler, tables, first, rows, pending, committed_len, block_table, spec_rows):
    """The draft's state before the first cycle of sequences `rows` of a prefill (`first`): unshifted,
    the pending token t_n enters the draft at position n with feature f_{n-1}, in the draft
    prefill's last call (first.pending_in_draft) or, where that call cannot take it (kv_share=LAYER,
    whose pruned prefill computes no K/V of its own), in one draft_extend row each; shifted, the
    draft prefill's last call already is it. Returns draft_logits, draft_hidden [len(rows), ...]."""
    if not (model.draft_offset and model.speculates) or first.pending_in_draft:
        return first.draft_logits[rows], first.draft_hidden[rows]
    num_seqs = pending.shape[0]
    seq_index = torch.arange(num_seqs + 1, dtype=torch.long, device=pending.device)
    return model.executor.call(
        "draft_extend", tables, profiler, input_ids=pending[None], positions=committed_len[None],
        features=first.last_features[rows], logits_indices=seq_index[:num_seqs], next_tokens=pending,
        query_start_loc=seq_index, block_table=block_table, spec_rows=spec_rows, committed_len=committed_len,
        slot_mapping=slot_mapping(block_table, seq_index[:num_seqs], committed_len, model.options.block_size))


def decode_wave(model, call: GenerateCall, wave: Wave) -> None:
    """Prefill, then speculative cycles until every sequence of the wave stops."""
    long = dict(dtype=torch.long, device=model.device)
    carry = model.kv_cache.carry_features(wave.blocks, model.bootstrap)
    first = prefill(model, call, wave, carry)
    active = []
    for s, (prompt, token) in enumerate(zip(wave.prompts, first.pending.tolist())):  # one host read
        if call.emit(wave.outputs[s], wave.contexts[s], [token]):
            wave.final_positions[s] = len(prompt)
        else:
            active.append(s)
    if not active:
        return
    rows = torch.tensor(active, **long)
    committed_len = torch.tensor([len(wave.prompts[s]) for s in active], **long)
    pending = first.pending[rows]
    block_table = decode_table(model, wave, rows, max(len(wave.prompts[s]) for s in active))
    draft_logits, draft_hidden = enter_draft(model, call.profiler, wave.tables, first, rows, pending, committed_len,
                                             block_table, rows)
    batch = ActiveBatch(active, rows, pending, committed_len, block_table, draft_logits, draft_hidden)
    cycle = model.chain_cycle
    while batch.size:
        if cycle is not None:  # a chain: propose, verify, accept and extend as one function (one graph when compiled)
            forced = None
            if model.forced_drafts is not None and model.speculates:  # a test oracle's tokens for the drafts
                forced = torch.as_tensor(model.forced_drafts(wave.contexts_of(batch), model.num_spec_tokens), **long)
            accepted_t, next_t, drafts, extend_logits, extend_hidden, features = cycle(
                model.executor, call.sampler, batch.pending, batch.committed_len, batch.block_table, batch.wave_rows,
                batch.draft_logits, batch.draft_hidden, tables=wave.tables, profiler=call.profiler,
                graph_by_graph=call.graph_by_graph, forced=forced)
            verified = Verified(accepted_t, next_t, drafts, features)
        else:  # a draft tree
            proposal = model.proposer.propose(model, call, wave, batch)
            verified = verify_tree(model, call, wave, batch, proposal)
        # the one host read of the cycle: accepted counts, next tokens, committed lengths, drafts
        size, width = batch.size, verified.drafted.shape[1]
        host = torch.cat([verified.accepted, verified.next_token, batch.committed_len,
                          verified.drafted.reshape(-1)]).tolist()
        accepted, next_token, committed = host[:size], host[size:2 * size], host[2 * size:3 * size]
        drafted = [host[3 * size + row * width:3 * size + (row + 1) * width] for row in range(size)]
        call.stats.record(accepted)
        if model.options.prefix_caching:  # features of [pending, accepted...] (past them: overwritten later)
            path_positions = batch.committed_len[:, None] + torch.arange(width + 1, **long)[None]
            model.kv_cache.keep_block_features(
                batch.block_table, torch.repeat_interleave(torch.arange(batch.size, **long), width + 1),
                path_positions.reshape(-1), verified.path_features.reshape(batch.size * (width + 1), -1))
        keep = []
        for row, s in enumerate(batch.seqs):
            new = drafted[row][:accepted[row]] + [next_token[row]]
            if not call.emit(wave.outputs[s], wave.contexts[s], new):
                keep.append(row)
            else:  # base K/V is final up to committed + accepted; the draft's up to committed - 1 (+1 unshifted)
                wave.final_positions[s] = committed[row] + model.draft_offset
        if not keep:
            break
        if cycle is not None:  # the cycle extended every sequence already: keep the ones still decoding
            all_kept = len(keep) == batch.size  # then no row selection (a few small ops fewer per cycle)
            kept = slice(None) if all_kept else torch.tensor(keep, **long)
            batch = replace(batch, seqs=batch.seqs if all_kept else [batch.seqs[row] for row in keep],
                            wave_rows=batch.wave_rows[kept], pending=next_t[kept],
                            committed_len=(batch.committed_len + accepted_t + 1)[kept],
                            draft_logits=extend_logits[kept], draft_hidden=extend_hidden[kept])
        else:
            batch = extend_draft(model, call, wave, batch, verified, keep)
            all_kept = False
        longest = max(committed[row] + accepted[row] + 1 for row in keep)
        batch = replace(batch, block_table=decode_table(model, wave, batch.wave_rows, longest,
                                                        previous=batch.block_table if all_kept else None))
