"""The draft's catch-up after cycles at k = 0, or after a prompt whose draft prefill was deferred
(the engine's lazy draft prefill): one draft-prefill call over the tokens the draft has not seen.

A request decoded at k = 0 commits tokens the draft never processed. Unshifted (draft slot p holds
(t_p, f_{p-1})), the draft of a request whose draft last processed slot u and whose committed
length is m (x_m pending) misses slots u+1..m: tokens x_{u+1}..x_m with base features f_u..f_{m-1}.
Those features came out of the k = 0 verifies (the engine keeps them in a ring per slot, indexed by
position mod its length); the draft prefill graph takes them as a chunk [u+1, m+1) with carry f_u,
exactly as a prompt chunk (eagle_fx.runtime.prefill), and its output at x_m is the draft's state
for the next cycle: what d_1 is drawn from. After a lazy prefill u = c - 1 (c prompt tokens from
the prefix cache, whose draft K/V is there) and the ring holds the prompt's base features from the
base prefill and, at u, the prefill's carry: the base feature at c - 1, or the bootstrap for u = -1.
"""
from __future__ import annotations

import torch

from eagle_fx.runtime.kv_cache import slot_mapping


def catch_up_draft(model, requests, ring: torch.Tensor, slots: list[int], tables: torch.Tensor, window: int):
    """draft_logits, draft_hidden [len(requests), ...] after the draft has seen every committed token
    and the pending one of each request (r.draft_upto = u, r.committed = m, r.context the tokens)."""
    device = model.device
    long = dict(dtype=torch.long, device=device)
    spans = [(r.draft_upto + 1, r.committed + 1) for r in requests]
    lengths = torch.tensor([end - begin for begin, end in spans], **long)
    query_start_loc = torch.zeros(len(requests) + 1, **long)
    query_start_loc[1:] = lengths.cumsum(0)
    tokens = [t for r, (begin, end) in zip(requests, spans) for t in r.context[begin:end]]
    positions = torch.cat([torch.arange(begin, end, **long) for begin, end in spans])
    seq = torch.repeat_interleave(torch.arange(len(requests), **long), lengths)
    rows = torch.tensor(slots, **long)
    # features at positions begin..end-1: f_begin..f_{m-1} from the ring, the last (f_m) not yet known
    # and not read (the graph shifts features right by one within each sequence)
    ring_positions = torch.where(positions < rows.new_tensor([end - 1 for _, end in spans])[seq],
                                 positions, torch.zeros_like(positions)) % window
    features = ring[rows[seq], ring_positions]
    carry = ring[rows, torch.tensor([r.draft_upto % window for r in requests], **long)]
    table = tables[rows, :model.kv_cache.table_width(max(end for _, end in spans) + model.lookahead)].contiguous()
    return model.executor.prefill(
        "draft_prefill", None, None, input_ids=torch.tensor(tokens, **long)[None], positions=positions[None],
        features=features, logits_indices=query_start_loc[1:] - 1, next_tokens=None, carry_features=carry,
        query_start_loc=query_start_loc, slot_mapping=slot_mapping(table, seq, positions, model.options.block_size),
        block_table=table, spec_rows=rows, committed_len=torch.tensor([end for _, end in spans], **long))
