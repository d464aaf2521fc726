"""Drafting of an EAGLE-2 tree (eagle_fx.draft_tree) per sequence. (A chain drafts inside its
cycle: eagle_fx.runtime.chain_cycle.)

A TreeProposer is passed in (SpeculativeModel(..., proposer=) or model.replace(proposer=)); its
`override` hook lets a test oracle replace the tree's tokens (the runtime then continues from the
replaced tokens, as if the draft had proposed them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_fx.draft_tree import rerank
from eagle_fx.runtime.kv_cache import slot_mapping


@dataclass
class Proposal:
    tokens: torch.Tensor  # [A, N] a tree's nodes in candidate order
    parents: torch.Tensor  # [A, N] each node's parent node (-1: the root)


class TreeProposer:
    """An EAGLE-2 dynamic tree per sequence (eagle_fx.draft_tree): layer 1 is the top_k of the last
    draft call; each of depth-1 draft steps expands the top_k best nodes of the layer (each attending
    to its ancestors only); the total_tokens best candidates are kept.

    override(contexts, tokens [A, N], parents [A, N]) -> tokens: replaces the tree's tokens;
    on_path(path [A, depth+1], accepted [A]): told each verify's accepted path (node indices into
    [root, nodes], eagle_fx.runtime.verifier.greedy_walk), after its K/V was compacted."""

    def __init__(self, override=None, on_path=None):
        self.override, self.on_path = override, on_path

    def propose(self, model, call, wave, batch) -> Proposal:
        tokens, parents = self.grow(model, call, wave, batch)
        if self.override is not None:
            tokens = self.override(wave.contexts_of(batch), tokens, parents)
        return Proposal(tokens, parents)

    @staticmethod
    def grow(model, call, wave, batch) -> tuple[torch.Tensor, torch.Tensor]:
        tree, block_size, device = model.tree, model.options.block_size, model.device
        long = dict(dtype=torch.long, device=device)
        num_active, top_k, width = batch.size, tree.top_k, batch.draft_hidden.shape[-1]
        temperature = tree.score_temperature
        top = torch.log_softmax(batch.draft_logits.float() / temperature, dim=-1).topk(top_k, dim=-1)
        cand_tokens, cand_scores = [model.spec.to_target(top.indices)], [top.values]
        cand_parents = [torch.full((num_active, top_k), -1, **long)]
        front_tokens, front_scores = cand_tokens[0], top.values
        front_cands = torch.arange(top_k, **long).expand(num_active, top_k)
        front_hidden = batch.draft_hidden[:, None].expand(num_active, top_k, width)
        draft_slots = tree.draft_slots
        front_mask = torch.zeros(num_active, top_k, draft_slots, dtype=torch.bool, device=device)
        tree_start = batch.committed_len + model.draft_offset  # the draft's first free slot: the tree's follow
        seq = torch.repeat_interleave(torch.arange(num_active, **long), top_k)
        rows = torch.arange(num_active * top_k, **long)
        num_cands = top_k
        for layer in range(tree.depth - 1):
            slot = layer * top_k + torch.arange(top_k, **long)
            front_mask[:, torch.arange(top_k, **long), slot] = True
            positions = (tree_start + layer)[:, None].expand(num_active, top_k).reshape(-1)
            draft_logits, hidden = model.executor.call(
                "draft_tree_step", wave.tables, call.profiler, input_ids=front_tokens.reshape(1, -1),
                positions=positions[None], features=front_hidden.reshape(num_active * top_k, width),
                logits_indices=rows, next_tokens=front_tokens[:, 0],
                query_start_loc=torch.arange(num_active + 1, **long) * top_k,
                slot_mapping=slot_mapping(batch.block_table, seq, (tree_start[:, None] + slot[None]).reshape(-1),
                                          block_size),
                block_table=batch.block_table, tree_mask=front_mask.reshape(num_active * top_k, draft_slots),
                tree_start=tree_start, spec_rows=batch.wave_rows, committed_len=batch.committed_len)
            child = torch.log_softmax(draft_logits.float() / temperature, dim=-1).view(num_active, top_k, -1).topk(top_k, dim=-1)
            child_scores = (front_scores[:, :, None] + child.values).reshape(num_active, top_k * top_k)
            cand_tokens.append(model.spec.to_target(child.indices).reshape(num_active, top_k * top_k))
            cand_scores.append(child_scores)
            cand_parents.append(front_cands[:, :, None].expand(num_active, top_k, top_k).reshape(num_active, top_k * top_k))
            if layer < tree.depth - 2:  # the next layer to expand: the top_k children by cumulative score
                best = torch.sort(-child_scores, dim=1, stable=True).indices[:, :top_k]
                parent_row = best // top_k
                front_tokens, front_scores = cand_tokens[-1].gather(1, best), child_scores.gather(1, best)
                front_cands = num_cands + best
                front_hidden = hidden.view(num_active, top_k, width).gather(1, parent_row[..., None].expand(-1, -1, width))
                front_mask = front_mask.gather(1, parent_row[..., None].expand(-1, -1, draft_slots))
            num_cands += top_k * top_k
        return rerank(torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1), tree.total_tokens)
