"""A pruned draft vocabulary: the draft's logits over the N tokens the base emits most often.

Each draft step ends in an lm_head over the whole vocabulary (EAGLE-1: the base's own; EAGLE-3:
the draft's), and a k-step chain reads it k times a cycle: on a small base those reads are a large
share of the bytes a speculation cycle streams (the bundled pair: 2 MB of the draft's ~5.6 MB a
step). FR-Spec (Zhao et al., 2025) keeps the rows of the most frequent tokens only; here they are
ranked by what the base itself emits, its greedy continuations of training prompts, not by corpus
frequency (on the bundled pair the 256 most frequent corpus tokens cover 83% of the base's greedy
output tokens on held-out prompts; its own outputs' 256 most frequent, 99.6-100%).

Exactness: a token outside the set is never drafted, so the draft proposes the best token it
may, and the base verifies every draft as before: outputs are unchanged (greedy is still the
base's greedy; sampling still the base's distribution); only acceptance can drop, where the base's
next token falls outside the set.

    counts = base_output_counts(base, prompts, max_new_tokens=96, eos=eos_ids)
    keep = most_frequent(counts, 256, always=eos_ids)
    pruned = prune_draft_vocab(draft, base, keep)    # a draft of the same class, with d2t
    save_draft(pruned, out)                           # load_draft reads it back

The pruned draft maps its ids back with d2t (target = draft id + d2t[draft id]), EAGLE-3's
convention, so the runtime treats both alike (`eagle-fx prune-draft-vocab` writes one).
"""
from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

from eagle_fx.drafts import Draft, Eagle1Draft, Eagle3Draft
from eagle_fx.runtime.pair import eos_ids


@torch.no_grad()
def base_output_counts(base, prompts: list[list[int]], max_new_tokens: int, eos: Iterable[int] = (),
                       pad_token_id: int = 0, batch_size: int = 16, progress: bool = True) -> Counter:
    """How often each token id appears in the base's greedy continuations of `prompts` (HF
    `generate`, left-padded batches of similar lengths), each counted up to its first eos (`eos`, else
    the base's generation_config eos: where generate stops)."""
    eos = tuple(eos) or eos_ids(base)
    device = next(base.parameters()).device
    counts: Counter = Counter()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc="base outputs", unit="batch", disable=not progress):
        longest = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, longest - len(prompts[i]):] = 1
        out = base.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                            min_new_tokens=0, do_sample=False, pad_token_id=pad_token_id,
                            eos_token_id=list(eos) or None)
        for row in out[:, longest:].tolist():
            for token in row:
                counts[token] += 1
                if token in eos:
                    break
    return counts


def most_frequent(counts: Counter, size: int, always: Iterable[int] = (), vocab_size: int | None = None) -> torch.Tensor:
    """`size` token ids, ascending: `always` (eos), then the most frequent in `counts` (ties: lower
    id first), then, when fewer were seen, the lowest ids not yet taken (below vocab_size)."""
    always = list(dict.fromkeys(always))
    if size < max(1, len(always)):
        raise ValueError(f"a draft vocabulary of {size} tokens cannot hold the {len(always)} always kept ({always})")
    keep = dict.fromkeys(always)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) == size:
            break
        keep.setdefault(token)
    filler = iter(range(vocab_size)) if vocab_size is not None else itertools.count()
    while len(keep) < size:
        keep.setdefault(next(filler))
    return torch.tensor(sorted(keep), dtype=torch.long)


def coverage(counts: Counter, keep: torch.Tensor) -> float:
    """The share of the counted tokens that `keep` holds."""
    total = sum(counts.values())
    kept = set(keep.tolist())
    return sum(n for token, n in counts.items() if token in kept) / total if total else 0.0


def prune_draft_vocab(draft: Draft, base, keep: torch.Tensor) -> Draft:
    """A copy of `draft` whose logits cover the target ids `keep` only (ascending, distinct), with
    d2t mapping its ids back: an EAGLE-1 draft gets its own lm_head, those rows of the base's; an
    EAGLE-3 draft (or one pruned before) keeps those rows of its lm_head."""
    keep = torch.as_tensor(keep, dtype=torch.long).cpu()
    vocab = base.config.get_text_config().vocab_size
    if keep.ndim != 1 or len(keep) == 0 or not bool((keep[1:] > keep[:-1]).all()):
        raise ValueError("keep must be a non-empty 1-D tensor of distinct target ids, ascending")
    if int(keep[0]) < 0 or int(keep[-1]) >= vocab:
        raise ValueError(f"keep holds ids outside the base vocab (0..{vocab - 1})")
    if len(keep) >= vocab:
        raise ValueError(f"keep holds {len(keep)} ids, the whole base vocab ({vocab}): nothing to prune")
    if isinstance(draft, Eagle1Draft) and draft.lm_head is None:
        head = base.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("the base's lm_head has a bias: pruning an EAGLE-1 draft over it is not supported")
        rows, weight = keep, head.weight
    else:
        targets = draft.to_target(torch.arange(draft.draft_vocab_size, device=draft.d2t.device)).cpu()
        position = {int(t): i for i, t in enumerate(targets.tolist())}
        missing = [int(t) for t in keep if int(t) not in position]
        if missing:
            raise ValueError(f"{len(missing)} kept ids are not in the draft's vocabulary (first: {missing[:5]})")
        rows, weight = torch.tensor([position[int(t)] for t in keep]), draft.lm_head.weight
    config = copy.deepcopy(draft.config)
    config.draft_vocab_size = len(keep)
    embed = draft.embed_tokens if draft.shares_base_embeddings else None
    if isinstance(draft, Eagle1Draft):
        pruned = Eagle1Draft(config, embed=embed)
    else:
        pruned = Eagle3Draft(config, draft.target_hidden_size, draft.aux_layer_ids, len(keep),
                             draft.midlayer.norm_before_residual, embed=embed)
    state = {k: v for k, v in draft.state_dict().items() if k not in ("lm_head.weight", "d2t")}
    state["lm_head.weight"] = weight.detach()[rows.to(weight.device)]
    state["d2t"] = keep - torch.arange(len(keep))
    pruned.load_state_dict(state)  # strict: every key of the pruned draft, no other
    p = draft.fc.weight
    return pruned.to(device=p.device, dtype=p.dtype).eval()
