"""What the decode-step graphs of a chain are given, as plain tensor functions.

Both ways a chain cycle runs use them: op by op (eagle_fx.runtime.proposer / cycle, which also
serve trees and test hooks) and as one function (eagle_fx.runtime.chain_cycle, compiled as one
graph). Nothing here reads a value on the host, so they trace into a compiled graph as they are.

Every sequence of a call has the same number of rows (1 for a draft step, W+1 for a verify or an
extend), back to back, so the row bookkeeping is arithmetic on aranges.
"""
from __future__ import annotations

import torch

from eagle_fx.runtime.kv_cache import slot_mapping


def _rows(num_seqs: int, per_seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_start_loc [B+1], each row's sequence [B * per_seq]) for per_seq rows per sequence."""
    long = dict(dtype=torch.long, device=device)
    return (torch.arange(num_seqs + 1, **long) * per_seq,
            torch.arange(num_seqs * per_seq, **long) // per_seq)


def draft_step_inputs(token: torch.Tensor, position: torch.Tensor, hidden: torch.Tensor, block_table: torch.Tensor,
                      spec_rows: torch.Tensor, committed_len: torch.Tensor, block_size: int) -> dict:
    """The draft step on one token per sequence (token [B] at position [B], with the draft's own
    previous output feature hidden [B, H])."""
    query_start_loc, seq = _rows(token.shape[0], 1, token.device)
    return dict(input_ids=token[None], positions=position[None], features=hidden, logits_indices=seq,
                next_tokens=token, query_start_loc=query_start_loc,
                slot_mapping=slot_mapping(block_table, seq, position, block_size), block_table=block_table,
                spec_rows=spec_rows, committed_len=committed_len)


def verify_inputs(pending: torch.Tensor, drafts: torch.Tensor, committed_len: torch.Tensor, block_table: torch.Tensor,
                  block_size: int) -> dict:
    """The verify of [pending, d_1..d_k] per sequence at positions m..m+k (m = committed_len), logits
    at every row."""
    num_seqs, per_seq = drafts.shape[0], drafts.shape[1] + 1
    query_start_loc, seq = _rows(num_seqs, per_seq, drafts.device)
    positions = (committed_len[:, None] + torch.arange(per_seq, dtype=torch.long, device=drafts.device)).reshape(-1)
    return dict(input_ids=torch.cat([pending[:, None], drafts], dim=1).reshape(1, -1), positions=positions[None],
                logits_indices=torch.arange(num_seqs * per_seq, dtype=torch.long, device=drafts.device),
                slot_mapping=slot_mapping(block_table, seq, positions, block_size), block_table=block_table,
                query_start_loc=query_start_loc)


def extend_inputs(drafted: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor,
                  path_features: torch.Tensor, committed_len: torch.Tensor, block_table: torch.Tensor,
                  spec_rows: torch.Tensor, draft_offset: int, block_size: int) -> tuple[dict, torch.Tensor]:
    """The draft extend over each sequence's W+1 verified positions, padded to W+1 rows for every
    sequence: [d_1..d_a, next token, rest] at positions m+o..m+W+o with the base's features
    path_features [B, W+1, F] there, the output taken at row a. The rows past a (rejected drafts) are
    computed and discarded: their K/V slots lie past the committed positions, and every later call
    writes a slot before a query reaches it. Returns (inputs, the new committed_len m + a + 1)."""
    num_seqs, per_seq = drafted.shape[0], drafted.shape[1] + 1
    device = drafted.device
    query_start_loc, seq = _rows(num_seqs, per_seq, device)
    tokens = torch.cat([drafted, next_token[:, None]], dim=1).scatter(1, accepted[:, None], next_token[:, None])
    positions = (committed_len[:, None] + torch.arange(per_seq, dtype=torch.long, device=device)
                 + draft_offset).reshape(-1)
    committed_len = committed_len + accepted + 1  # the base KV now holds every accepted token; next is pending
    return dict(input_ids=tokens.reshape(1, -1), positions=positions[None],
                features=path_features.reshape(num_seqs * per_seq, path_features.shape[-1]),
                logits_indices=query_start_loc[:-1] + accepted,
                next_tokens=next_token, query_start_loc=query_start_loc,
                slot_mapping=slot_mapping(block_table, seq, positions, block_size), block_table=block_table,
                spec_rows=spec_rows, committed_len=committed_len), committed_len
