"""Attention over key chunks merged by their log-sum-exp (flash attention's online softmax): the one
loop every bounded-memory attention path runs (ragged prefill tiles, the device-side decode and
verify, trees, and the same decode traced into a compiled graph).

A path supplies its queries with heads grouped by kv head (`group_heads`: keys are never
repeated for GQA) and a *chunk source*: a function from a chunk index to that chunk's keys,
values and visibility mask. `attend_in_chunks` folds the chunks one at a time, so only one
chunk's K/V and scores exist at once:

    acc, lse = 0, -inf
    for i in range(num_chunks):
        part, part_lse = attention of q over chunk i (rows that see none of its keys: lse -inf)
        lse' = logaddexp(lse, part_lse);  acc = acc * exp(lse - lse') + part * exp(part_lse - lse')

Eagerly the loop is a Python loop. Traced (torch.compile) with a chunk count that is a dynamic
size (the block table's width), a Python loop would specialise the graph on the count, so it is a
`torch.while_loop` whose body reads chunk `i` through a tensor index: one compiled graph for
every table width, and memory bounded by one chunk. (`torch.ops.higher_order.scan` over the
reshaped table would say the same, but inductor cannot lower it with a dynamic length here.)
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from eagle_fx.ops.limits import attention_limits_now

# chunk index (an int, or a 0-d int64 tensor in a traced loop) -> (k [B, KVH, c, D], v [B, KVH, c, D],
# visible [B, 1, M, c] bool, or None when every query sees every key of the chunk)
ChunkSource = Callable[[int | Tensor], tuple[Tensor, Tensor, Tensor | None]]


def group_heads(q: Tensor, num_seqs: int, kv_heads: int) -> Tensor:
    """q [1, H, T, D] (B sequences of P = T // B rows) -> [B, KVH, G P, D]: query head h next to
    the others of its kv head (h // G), so one chunk's keys serve the whole group."""
    heads, total, d = q.shape[1], q.shape[2], q.shape[3]
    per_seq, group = total // num_seqs, heads // kv_heads
    qg = q[0].reshape(kv_heads, group, num_seqs, per_seq, d).permute(2, 0, 1, 3, 4)
    return qg.reshape(num_seqs, kv_heads, group * per_seq, d)


def ungroup_heads(acc: Tensor, like: Tensor) -> Tensor:
    """group_heads' inverse: [B, KVH, G P, D] -> a tensor in q's (`like`'s) layout [1, H, T, D]
    (the ops' fake kernels promise empty_like(q))."""
    heads, total, d = like.shape[1], like.shape[2], like.shape[3]
    num_seqs, kv_heads = acc.shape[0], acc.shape[1]
    per_seq = total // num_seqs
    out = acc.view(num_seqs, kv_heads, heads // kv_heads, per_seq, d).permute(1, 2, 0, 3, 4)
    return torch.empty_like(like).copy_(out.reshape(1, heads, total, d))


def chunk_attention_softmax(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
                            scale: float) -> tuple[Tensor, Tensor]:
    """q [B, KVH, M, D] over k, v [B, KVH, c, D] under visible [B, 1, M, c] (None: all): (out
    [B, KVH, M, D] in fp32, log-sum-exp of the scores [B, KVH, M, 1]); a row that sees no key gets 0."""
    q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q * scale, k.transpose(-1, -2))
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0))
    return torch.matmul(probs, v), lse


def chunk_attention_flash_cpu(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
                              scale: float) -> tuple[Tensor, Tensor]:
    """chunk_attention_softmax through the CPU flash-attention kernel, which returns the
    log-sum-exp with its output (about 4x faster than the explicit softmax; its mask is additive)."""
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                           scale=scale)[:2]
    return out.float(), lse[..., None].float()


# a device type's fused chunk attention (others, or AttentionLimits.fused_chunk_kernel=False: the explicit softmax)
FUSED_CHUNK_ATTENTION = {"cpu": chunk_attention_flash_cpu}


def chunk_attention_for(device: torch.device) -> Callable[..., tuple[Tensor, Tensor]]:
    if attention_limits_now().fused_chunk_kernel:
        return FUSED_CHUNK_ATTENTION.get(device.type, chunk_attention_softmax)
    return chunk_attention_softmax


def fold_chunk(acc: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor,
               visible: Tensor | None) -> tuple[Tensor, Tensor]:
    """Fold one key chunk's attention (part, part_lse; visible: its mask) into the running result
    (acc, lse); the first fold starts from acc = 0, lse = -inf."""
    if visible is not None:  # rows that see no key of this chunk add nothing
        part_lse = part_lse.masked_fill(~visible.any(-1, keepdim=True), float("-inf"))
    new_lse = torch.logaddexp(lse, part_lse)
    # a row that has seen no key in either (both -inf) keeps 0 and -inf
    acc = acc * torch.exp(lse - new_lse).nan_to_num(0.0) + part * torch.exp(part_lse - new_lse).nan_to_num(0.0)
    return acc, new_lse


def attend_in_chunks(qg: Tensor, chunk_at: ChunkSource, num_chunks: int, scale: float,
                     traced: bool = False) -> Tensor:
    """The attention of qg [B, KVH, M, D] over the keys of chunks 0..num_chunks-1 of `chunk_at`:
    [B, KVH, M, D] in fp32 (a row that sees no key: 0). traced=True: one torch.while_loop whose
    count may be a dynamic size (chunk_at then gets a 0-d int64 tensor); else a Python loop."""
    attend = chunk_attention_for(qg.device)
    acc = qg.new_zeros(qg.shape, dtype=torch.float32)
    lse = qg.new_full((*qg.shape[:-1], 1), float("-inf"), dtype=torch.float32)

    def step(i, acc, lse):
        k, v, visible = chunk_at(i)
        part, part_lse = attend(qg, k, v, visible, scale)
        return fold_chunk(acc, lse, part, part_lse, visible)

    if not traced:
        for i in range(num_chunks):
            acc, lse = step(i, acc, lse)
        return acc
    # the counter lives on the host: the loop's test reads no device value
    count = torch.full((), num_chunks, dtype=torch.int64)

    def more(i, acc, lse):
        return i < count

    def body(i, acc, lse):
        return (i + 1, *step(i.to(qg.device), acc, lse))

    _, acc, _ = torch.while_loop(more, body, (torch.zeros((), dtype=torch.int64), acc, lse))
    return acc
