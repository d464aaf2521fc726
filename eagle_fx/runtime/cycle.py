"""One speculative cycle of a draft tree (a chain's is eagle_fx.runtime.chain_cycle): the
tree-masked verify, acceptance along the tree, then the draft's extend over the accepted path.
The positions are a chain's (below), with the accepted path's K/V compacted in front:

Positions, for a sequence whose base KV holds x_0..x_{m-1} (committed_len m) and whose last
sampled token x_m is pending (draft_offset o: 1 unshifted, where draft slot p holds (t_p, f_{p-1});
0 shifted, where it holds (t_{p+1}, f_p)):

  the last draft call proposed d_1;
  draft step j = 1..k-1: token d_j at position m-1+j+o, feature = the draft's previous output;
  verify: base on [x_m, d_1..d_k] at positions m..m+k -> accepted a, next token;
  extend: draft on [d_1..d_a, next] at positions m+o..m+a+o with the verified base features
          f_m..f_{m+a} -> the next d_1;  m += a + 1. (Padded to k+1 rows per sequence, so every
          step graph sees the same rows per sequence: see extend_draft.)

Stale K/V past a sequence's committed length (rejected proposals) are never read: attention is
bounded by each query's position, and later tokens overwrite those slots.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from eagle_fx.draft_tree import tree_mask
from eagle_fx.runtime.kv_cache import slot_mapping
from eagle_fx.runtime.step_inputs import extend_inputs
from eagle_fx.runtime.verifier import accept_tree


@dataclass
class ActiveBatch:
    """The sequences of a wave still decoding, in the order the graphs see them."""

    seqs: list[int]  # each one's index in the wave
    wave_rows: torch.Tensor  # the same as a tensor: each one's row of per-wave buffers (the spec_kv ring)
    pending: torch.Tensor  # [A] the last sampled token, not yet in the base KV
    committed_len: torch.Tensor  # [A] tokens in the base KV
    block_table: torch.Tensor  # [A, blocks per sequence]
    draft_logits: torch.Tensor  # [A, Vd] the draft's last call: what d_1 is drawn from
    draft_hidden: torch.Tensor  # [A, H] and its output feature

    @property
    def size(self) -> int:
        return len(self.seqs)


@dataclass
class Verified:
    accepted: torch.Tensor  # [A] drafts accepted per sequence
    next_token: torch.Tensor  # [A] the base's token after them (bonus or resampled)
    drafted: torch.Tensor  # [A, W] the accepted path's drafts (the first `accepted` count)
    path_features: torch.Tensor  # [A, W+1, F] the base's features at [pending, drafted...]


def verify_tree(model, call, wave, batch: ActiveBatch, proposal) -> Verified:
    """One tree-masked verify of [pending, nodes] per sequence, acceptance along the tree, and the
    accepted path's base K/V moved to the slots right after the committed ones."""
    block_size, depth = model.options.block_size, model.tree.depth
    long = dict(dtype=torch.long, device=model.device)
    num_active, num_nodes = proposal.tokens.shape
    mask = tree_mask(proposal.parents)  # [A, N+1, N+1] over [pending, nodes]
    node_depth = mask.sum(-1) - 1
    nodes = torch.cat([batch.pending[:, None], proposal.tokens], dim=1)
    seq = torch.repeat_interleave(torch.arange(num_active, **long), num_nodes + 1)
    slots = (batch.committed_len[:, None] + torch.arange(num_nodes + 1, **long)[None]).reshape(-1)
    logits, features = model.executor.call(
        "verify_tree", wave.tables, call.profiler, input_ids=nodes.reshape(1, -1),
        positions=(batch.committed_len[:, None] + node_depth).reshape(1, -1),
        logits_indices=torch.arange(num_active * (num_nodes + 1), **long),
        slot_mapping=slot_mapping(batch.block_table, seq, slots, block_size), block_table=batch.block_table,
        query_start_loc=torch.arange(num_active + 1, **long) * (num_nodes + 1),
        tree_mask=mask.reshape(num_active * (num_nodes + 1), num_nodes + 1), tree_start=batch.committed_len,
        seq_rows=batch.wave_rows)
    accepted, next_token, path = accept_tree(call.sampler, proposal.parents, proposal.tokens, logits, depth)
    model.kv_cache.compact_path(path, accepted, batch.committed_len, batch.block_table)
    if model.proposer.on_path is not None:
        model.proposer.on_path(path, accepted)
    features = features.view(num_active, num_nodes + 1, -1)
    path_features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
    return Verified(accepted, next_token, nodes.gather(1, path[:, 1:]), path_features)


def extend_draft(model, call, wave, batch: ActiveBatch, verified: Verified, keep: list[int]) -> ActiveBatch:
    """The draft over each kept sequence's W+1 verified positions, padded (step_inputs.extend_inputs);
    returns the kept sequences' batch, the next token pending and the accepted tokens committed."""
    kept = torch.tensor(keep, dtype=torch.long, device=model.device)
    next_token = verified.next_token[kept]
    inputs, committed_len = extend_inputs(
        verified.drafted[kept], verified.accepted[kept], next_token, verified.path_features[kept],
        batch.committed_len[kept], batch.block_table[kept], batch.wave_rows[kept], model.draft_offset,
        model.options.block_size)
    draft_logits, draft_hidden = model.executor.call("draft_extend", wave.tables, call.profiler, **inputs)
    return replace(batch, seqs=[batch.seqs[r] for r in keep], wave_rows=batch.wave_rows[kept], pending=next_token,
                   committed_len=committed_len, block_table=batch.block_table[kept], draft_logits=draft_logits,
                   draft_hidden=draft_hidden)
