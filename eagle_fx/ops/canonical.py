"""Canonical eagle_fx ops: schemas, torch reference implementations, fake (shape) implementations.

`eagle_fx::attention` is what `canonicalize_attention` turns every SDPA of a captured model into:
causal self-attention over one packed row of tokens, grouped-query heads kept un-repeated.

`eagle_fx::cached_attention` is what `insert_kv_cache` turns it into: the token's K/V are written
into a paged pool through a slot mapping, and each query attends to its own sequence's keys read
back through a block table. The pool is a graph input that the op mutates (declared in the schema).

`eagle_fx::shared_cached_attention` is a KV-sharing draft's attention (passes/alias_draft_kv.py,
kv_share=LAYER): keys and values of the positions a sequence has committed (< committed_len[s], the
tokens in the base's KV) are read from layer `base_layer` of the base's pool; those of later
positions (speculated tokens) from `spec_kv`, a small ring the op writes: row spec_rows[s], slot
position % R. Only rows at positions >= committed_len are written; k and v may be None when every
row is committed (the draft prefill), and then nothing is written.

`eagle_fx::tree_cached_attention` is cached attention for a draft tree (passes/insert_tree_mask.py,
EAGLE-2): each sequence's tree occupies W cache slots from logical index tree_start[s] (slot
tree_start + i holds tree node i), and a query sees every key below tree_start (within the
sliding window, by position) plus the tree slots its row of tree_mask [T, W] marks (its ancestors
and itself). A query's `positions` entry (its RoPE position, tree_start + depth) only bounds the
window; which tree slots it sees is the mask's.

`eagle_fx::rowwise_linear` is `F.linear` one row at a time (see passes/batch_invariant.py).

Two query layouts (cached_attention and shared_cached_attention's `uniform_queries`, set by
passes/mark_uniform_queries.py on the decode-step graphs):
  uniform_queries=True   every sequence has T // B query rows, back to back (a draft step: 1, a
                         verify or padded extend: k+1). Device-side only: no value is read on the
                         host and no shape depends on data; every sequence reads the keys of its
                         whole block-table row (block_table.shape[1] * block_size, the runtime
                         passes a table as wide as the batch's longest sequence needs) and masks by
                         position, so the mask is [B, T // B, S]: linear in S.
  uniform_queries=False  ragged rows (prefill): the host reads the sequence bounds once per call and
                         attends per sequence (a fresh sequence from position 0 without a window:
                         the causal kernel, no mask). A call whose scores would pass SCORE_LIMIT
                         (a prefill chunk over a long cached context) runs in query tiles x key
                         chunks with an online softmax, reading one key chunk's blocks at a time,
                         heads grouped by kv head: its transient memory is bounded by the tiles,
                         not by the context, and no [T, S] mask is ever built (equal rows per
                         sequence with a mask of at most UNIFORM_MASK_LIMIT entries per sequence,
                         e.g. many short prompts: batched).
tree_cached_attention's rows are always uniform (a tree's nodes per sequence) and device-side.
batch_invariant=True keeps the row-by-row host loop (bit-identical chunking over speed).

Layouts:
  q            [1, H, T, D]    (T = all tokens of all sequences of the step, packed)
  k, v         [1, KVH, T, D]
  kv_pool      [L, 2, num_blocks, block_size, KVH, D]
  slot_mapping [T]             int64, block * block_size + offset for each token
  block_table  [B, max_blocks] int64, the blocks of each sequence in position order
  query_start_loc [B + 1]      int64, token t belongs to sequence s if qsl[s] <= t < qsl[s+1]
  positions    [1, T]          int64, position of each token in its sequence
  spec_kv      [2, S, R, KVH, D]  a KV-sharing draft's own K/V, R >= the speculated positions per sequence
  spec_rows, committed_len [B] int64
sliding_window 0 means full attention; otherwise key j is visible to query i when
0 <= i - j < sliding_window (the Hugging Face convention).

The ops are defined with `torch.library.Library` (schema + CompositeExplicitAutograd kernel +
`register_fake`): the same contract as `custom_op`, with less Python on every call, which matters
for the one-token decode steps on the CPU. They work in eager, under torch.compile and torch.export.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

_lib = torch.library.Library("eagle_fx", "DEF")  # noqa: TOR901 - the op namespace, defined once
_lib.define("attention(Tensor q, Tensor k, Tensor v, float scale, int sliding_window) -> Tensor")
_lib.define(
    "cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_pool, int layer, Tensor slot_mapping, "
    "Tensor block_table, Tensor query_start_loc, Tensor positions, float scale, int sliding_window, "
    "bool batch_invariant=False, bool uniform_queries=False) -> Tensor"
)
_lib.define(
    "shared_cached_attention(Tensor q, Tensor? k, Tensor? v, Tensor kv_pool, int base_layer, Tensor(a!) spec_kv, "
    "Tensor spec_rows, Tensor committed_len, Tensor block_table, Tensor query_start_loc, Tensor positions, "
    "float scale, int sliding_window, bool uniform_queries=False) -> Tensor"
)
_lib.define(
    "tree_cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_pool, int layer, Tensor slot_mapping, "
    "Tensor block_table, Tensor query_start_loc, Tensor positions, Tensor tree_mask, Tensor tree_start, float scale, "
    "int sliding_window, bool batch_invariant=False) -> Tensor"
)
_lib.define("rowwise_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")


QUERY_TILE = 256  # tiled ragged attention: query rows per tile
SCORE_LIMIT = 1 << 22  # ragged attention: scores (heads x rows x keys) of one call, else tiles of at most this many
UNIFORM_MASK_LIMIT = 1 << 16  # ragged call with equal rows per sequence: batched when a mask is this small
KV_READ_LIMIT = 1 << 20  # device-side attention, not compiled: K/V elements read at once (longer: key chunks)


def visible_keys(q_pos: Tensor, num_keys: int, sliding_window: int, first_key: int = 0) -> Tensor:
    """Bool mask [..., num_keys]: key position first_key + j is visible to a query at position p (q_pos [...])."""
    dist = q_pos[..., None] - torch.arange(first_key, first_key + num_keys, device=q_pos.device)
    mask = dist >= 0
    if sliding_window > 0:
        mask &= dist < sliding_window
    return mask


def attention_ref(q: Tensor, k: Tensor, v: Tensor, scale: float, sliding_window: int) -> Tensor:
    """Causal attention over one sequence per batch row (the model's own, uncached semantics)."""
    t = q.shape[-2]
    mask = visible_keys(torch.arange(t, device=q.device), t, sliding_window)
    # enable_gqa=True also for equal head counts: a constant where a size comparison is symbolic (a
    # traced backward with dynamic shapes)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _write_kv(kv_pool: Tensor, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """k/v [1, KVH, T, D] into layer `layer` of kv_pool [layers, 2, blocks, block_size, KVH, D] at
    slot_mapping [T], in place.

    Traced into a compiled graph: one index_put_ into the pool input itself, indexed on its own
    dimensions (layer, side, block, offset). A graph that writes the pool more than once (a cycle:
    every layer, the verify and the draft) then stays in place; an index_put_ into a view of the
    pool (flattened, or one layer's) made inductor copy the whole pool in and out on every call
    (measured: a 256 MB pool, 4 layers: 0.4 ms in place, 140 ms with the copies). Run eagerly:
    one index_put_ into a flattened view, which is in place there and takes fewer small ops."""
    kvh, d, block_size, n = k.shape[1], k.shape[3], kv_pool.shape[3], slot_mapping.shape[0]
    values = torch.cat([k[0].transpose(0, 1), v[0].transpose(0, 1)]).to(kv_pool.dtype)  # [2T, KVH, D]: K rows, V rows
    if torch.compiler.is_compiling():
        blocks, offsets = (slot_mapping // block_size).repeat(2), (slot_mapping % block_size).repeat(2)
        sides = torch.arange(2, device=slot_mapping.device).repeat_interleave(n)
        kv_pool.index_put_((torch.full_like(blocks, layer), sides, blocks, offsets), values)
        return
    side = kv_pool.shape[2] * block_size  # slots per layer and side
    first = layer * 2 * side
    kv_pool.view(-1, kvh, d).index_put_((torch.cat([slot_mapping + first, slot_mapping + (first + side)]),), values)


def _paged_keys(pool: Tensor, block_table: Tensor, dtype: torch.dtype) -> Tensor:
    """Every sequence's whole block-table row of one layer's pool: [2, B, S, KVH, D], S = blocks * block_size."""
    kv = pool[:, block_table].flatten(2, 3)
    return kv if kv.dtype == dtype else kv.to(dtype)


def _key_chunk_blocks(pool: Tensor, block_table: Tensor) -> int:
    """Blocks per key chunk for the device-side attention over one layer's pool [2, blocks,
    block_size, KVH, D]: the whole table at once while compiling (a loop over a dynamic width
    would specialise the graph) or while the table's K/V fit KV_READ_LIMIT elements; else as many
    blocks as fit it."""
    if torch.compiler.is_compiling():
        return block_table.shape[1]
    per_block = 2 * block_table.shape[0] * pool.shape[2] * pool.shape[3] * pool.shape[4]
    return max(1, KV_READ_LIMIT // per_block)


def _uniform_in_key_chunks(q: Tensor, pool: Tensor, block_table: Tensor, q_pos: Tensor, scale: float,
                           sliding_window: int, chunk_blocks: int) -> Tensor:
    """The device-side attention (B sequences of P = T // B rows at positions q_pos [B, P]) over
    key chunks of `chunk_blocks` table columns, merged by log-sum-exp: reads one chunk's K/V at a
    time instead of every sequence's whole table. Loops over a shape, never over a value: no host
    read."""
    heads, total, d = q.shape[1], q.shape[2], q.shape[3]
    num_seqs, width = block_table.shape
    per_seq, block_size, kv_heads = total // num_seqs, pool.shape[2], pool.shape[3]
    group = heads // kv_heads
    qg = q[0].reshape(kv_heads, group, num_seqs, per_seq, d).permute(2, 0, 1, 3, 4)
    qg = qg.reshape(num_seqs, kv_heads, group * per_seq, d)  # [B, KVH, G P, D]: heads grouped by kv head
    attend = CHUNK_ATTENTION.get(q.device.type, _chunk_attention_softmax)
    acc = lse = None
    for j in range(0, width, chunk_blocks):
        kv = _paged_keys(pool, block_table[:, j:j + chunk_blocks], q.dtype).transpose(2, 3)  # [2, B, KVH, c, D]
        visible = visible_keys(q_pos, kv.shape[3], sliding_window, first_key=j * block_size)  # [B, P, c]
        visible = visible.repeat(1, group, 1)[:, None]  # [B, 1, G P, c]
        part, part_lse = attend(qg, kv[0], kv[1], visible, scale)
        acc, lse = _merge_chunk(acc, lse, part, part_lse, visible)
    out = acc.view(num_seqs, kv_heads, group, per_seq, d).permute(1, 2, 0, 3, 4).reshape(1, heads, total, d)
    return torch.empty_like(q).copy_(out)  # in q's layout, as the ops' fake kernels (empty_like(q)) promise


def _uniform_sdpa(q: Tensor, kv: Tensor, mask: Tensor, scale: float) -> Tensor:
    """q [1, H, T, D] as B sequences of T // B rows against kv [2, B, S, KVH, D] under mask [B, T // B, S]."""
    heads, total, d = q.shape[1], q.shape[2], q.shape[3]
    num_seqs = kv.shape[1]
    per_seq = total // num_seqs
    # contiguous: inductor's SDPA lowering cannot re-stride these views when a size is the constant 1
    # (a compiled single-sequence cycle)
    qs = q[0].reshape(heads, num_seqs, per_seq, d).transpose(0, 1).contiguous()  # [B, H, P, D]
    keys, values = kv[0].transpose(1, 2).contiguous(), kv[1].transpose(1, 2).contiguous()  # [B, KVH, S, D]
    # enable_gqa=True also for equal head counts (groups of one): a constant, where the comparison
    # of two sizes would be symbolic in a compiled graph
    out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    # in q's layout, as the ops' fake kernels (empty_like(q)) promise
    return torch.empty_like(q).copy_(out.transpose(0, 1).reshape(1, heads, total, d))


KeyReader = Callable[[int, int], Tensor]  # (lo, hi) -> keys and values of positions lo..hi-1: [2, KVH, hi - lo, D]


def _ragged_sdpa(q: Tensor, read_kv: KeyReader, kv_heads: int, num_keys: int, q_pos: Tensor, first: int,
                 scale: float, sliding_window: int) -> Tensor:
    """One sequence's queries q [1, H, n, D] at the consecutive positions q_pos = first..first+n-1
    (first known on the host) over its keys 0..num_keys-1, read through `read_kv`. Small calls are
    one SDPA (the causal kernel for a fresh sequence from position 0 without a window); a call
    whose scores (heads x rows x keys) would exceed SCORE_LIMIT is attended in tiles with an online
    softmax (_tiled_attention), so its transient memory does not grow with the context."""
    heads, n = q.shape[1], q.shape[2]
    if first == 0 and n == num_keys and sliding_window == 0:
        kv = read_kv(0, num_keys)
        return F.scaled_dot_product_attention(q, kv[0][None], kv[1][None], is_causal=True, scale=scale,
                                              enable_gqa=kv.shape[1] != heads)
    if heads * n * num_keys > SCORE_LIMIT:
        return _tiled_attention(q, read_kv, kv_heads, q_pos, first, scale, sliding_window)
    kv = read_kv(0, num_keys)
    mask = None
    if n > 1 or 0 < sliding_window < num_keys:  # else the one query sees every key
        mask = visible_keys(q_pos, num_keys, sliding_window)
    return F.scaled_dot_product_attention(q, kv[0][None], kv[1][None], attn_mask=mask, scale=scale,
                                          enable_gqa=kv.shape[1] != heads)


def _tiled_attention(q: Tensor, read_kv: KeyReader, kv_heads: int, q_pos: Tensor, first: int, scale: float,
                     sliding_window: int) -> Tensor:
    """Attention of q [1, H, n, D] (consecutive positions from `first`) in tiles: query tiles of at
    most QUERY_TILE rows, each over the key chunks it can see (causal, window), each chunk's result
    merged by its log-sum-exp (as flash attention's online softmax does). Query heads are grouped
    by their kv head, so keys are never repeated for GQA, and a chunk's scores or mask stay within
    SCORE_LIMIT: the transient memory is bounded by the tiles, not by the context."""
    heads, n, d = q.shape[1], q.shape[2], q.shape[3]
    out = torch.empty_like(q)
    rows = min(n, QUERY_TILE)
    group = heads // kv_heads
    attend = CHUNK_ATTENTION.get(q.device.type, _chunk_attention_softmax)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        lo_pos, hi_pos = first + a, first + b - 1  # the tile's first and last query positions
        key_lo = max(0, lo_pos + 1 - sliding_window) if sliding_window > 0 else 0
        qg = q[0, :, a:b].reshape(1, kv_heads, group * (b - a), d)  # heads grouped by kv head (h // group)
        chunk = max(1, SCORE_LIMIT // (heads * (b - a)))
        acc = lse = None
        for c0 in range(key_lo, hi_pos + 1, chunk):
            c1 = min(hi_pos + 1, c0 + chunk)
            kv = read_kv(c0, c1)  # [2, KVH, c, D]
            visible = None
            if c1 - 1 > lo_pos or (sliding_window > 0 and c0 <= hi_pos - sliding_window):  # some key hidden
                visible = visible_keys(q_pos[a:b], c1 - c0, sliding_window, first_key=c0).repeat(group, 1)[None, None]
            part, part_lse = attend(qg, kv[0][None], kv[1][None], visible, scale)  # [1, KVH, G r, D], [.., 1]
            acc, lse = _merge_chunk(acc, lse, part, part_lse, visible)
        out[0, :, a:b] = acc.view(heads, b - a, d).to(out.dtype)
    return out


def _chunk_attention_softmax(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
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


def _chunk_attention_flash_cpu(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
                               scale: float) -> tuple[Tensor, Tensor]:
    """_chunk_attention_softmax through the CPU flash-attention kernel, which returns the
    log-sum-exp with its output (about 4x faster than the explicit softmax; its mask is additive)."""
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                           scale=scale)[:2]
    return out.float(), lse[..., None]


def _merge_chunk(acc: Tensor | None, lse: Tensor | None, part: Tensor, part_lse: Tensor,
                 visible: Tensor | None) -> tuple[Tensor, Tensor]:
    """Fold one key chunk's attention (part, part_lse; visible: its mask) into the running result."""
    if visible is not None:  # rows that see no key of this chunk add nothing
        part_lse = part_lse.masked_fill(~visible.any(-1, keepdim=True), float("-inf"))
    if acc is None:
        return part, part_lse
    new_lse = torch.logaddexp(lse, part_lse)
    # a row that has seen no key in either (both -inf) keeps 0 and -inf
    acc = acc * torch.exp(lse - new_lse).nan_to_num(0.0) + part * torch.exp(part_lse - new_lse).nan_to_num(0.0)
    return acc, new_lse


# a device type's chunk attention for the tiled path (others: the explicit softmax)
CHUNK_ATTENTION = {"cpu": _chunk_attention_flash_cpu}


def _paged_reader(pool: Tensor, blocks: Tensor, dtype: torch.dtype) -> KeyReader:
    """A KeyReader over one sequence's blocks (`blocks`, in position order) of one layer's pool
    [2, num_blocks, block_size, KVH, D]: reads only the blocks that hold positions lo..hi-1."""
    block_size, kvh, d = pool.shape[2], pool.shape[3], pool.shape[4]

    def read(lo: int, hi: int) -> Tensor:
        b0, b1 = lo // block_size, -(-hi // block_size)
        kv = pool[:, blocks[b0:b1]].view(2, (b1 - b0) * block_size, kvh, d)
        kv = kv[:, lo - b0 * block_size:hi - b0 * block_size].transpose(1, 2)
        return kv if kv.dtype == dtype else kv.to(dtype)

    return read


def cached_attention_ref(q: Tensor, k: Tensor, v: Tensor, kv_pool: Tensor, layer: int, slot_mapping: Tensor,
                         block_table: Tensor, query_start_loc: Tensor, positions: Tensor, scale: float,
                         sliding_window: int, batch_invariant: bool = False, uniform_queries: bool = False) -> Tensor:
    """Write k/v at their slots, then attend each query to its sequence's cached keys.

    uniform_queries=True: device-side only (see the module docstring). batch_invariant=True attends
    one query row at a time, so a row's result does not depend on how many rows share the call
    (chunked prefill then gives bit-identical KV to unchunked prefill).
    """
    pool = kv_pool[layer]  # [2, blocks, block_size, kvh, d]
    _write_kv(kv_pool, layer, k, v, slot_mapping)
    pos = positions.reshape(-1)
    if uniform_queries and not batch_invariant:
        num_seqs = block_table.shape[0]
        chunk_blocks = _key_chunk_blocks(pool, block_table)
        if chunk_blocks < block_table.shape[1]:
            return _uniform_in_key_chunks(q, pool, block_table, pos.view(num_seqs, -1), scale, sliding_window,
                                          chunk_blocks)
        kv = _paged_keys(pool, block_table, q.dtype)
        mask = visible_keys(pos.view(num_seqs, -1), kv.shape[2], sliding_window)
        return _uniform_sdpa(q, kv, mask, scale)
    kvh, block_size = k.shape[1], kv_pool.shape[3]
    out = torch.empty_like(q)
    n_seq = query_start_loc.shape[0] - 1
    # one host read for all sequences: query bounds, each sequence's first and last query position
    meta = torch.cat([query_start_loc, pos[query_start_loc[:-1].clamp(max=max(pos.numel() - 1, 0))],
                      pos[(query_start_loc[1:] - 1).clamp(min=0)]]).tolist()
    bounds, firsts, ends = meta[:n_seq + 1], meta[n_seq + 1:2 * n_seq + 1], meta[2 * n_seq + 1:]
    gqa = kvh != q.shape[1]
    per_seq = bounds[1]
    if (not batch_invariant and n_seq > 1 and per_seq * (max(ends) + 1) <= UNIFORM_MASK_LIMIT
            and all(bounds[s + 1] - bounds[s] == per_seq for s in range(n_seq))):
        # equal rows per sequence and a small mask (many short prompts): one attention for all
        nb = -(-(max(ends) + 1) // block_size)
        kv = _paged_keys(pool, block_table[:, :nb], q.dtype)
        return _uniform_sdpa(q, kv, visible_keys(pos.view(n_seq, per_seq), kv.shape[2], sliding_window), scale)
    for s in range(n_seq):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        num_keys = ends[s] + 1  # a sequence's queries are its last positions
        read = _paged_reader(pool, block_table[s], q.dtype)
        if batch_invariant:
            kv = read(0, num_keys)
            kt, vt = kv[0][None], kv[1][None]
            for i, p in enumerate(pos[a:b].tolist(), start=a):
                lo = max(0, p + 1 - sliding_window) if sliding_window > 0 else 0
                out[:, :, i:i + 1] = F.scaled_dot_product_attention(
                    q[:, :, i:i + 1], kt[:, :, lo:p + 1], vt[:, :, lo:p + 1], scale=scale, enable_gqa=gqa)
            continue
        out[:, :, a:b] = _ragged_sdpa(q[:, :, a:b], read, kvh, num_keys, pos[a:b], firsts[s], scale, sliding_window)
    return out


def shared_cached_attention_ref(q: Tensor, k: Tensor | None, v: Tensor | None, kv_pool: Tensor, base_layer: int,
                                spec_kv: Tensor, spec_rows: Tensor, committed_len: Tensor, block_table: Tensor,
                                query_start_loc: Tensor, positions: Tensor, scale: float, sliding_window: int,
                                uniform_queries: bool = False) -> Tensor:
    """Write the uncommitted rows' k/v into the ring, then attend each query to its sequence's keys:
    the base layer's below committed_len, the ring's from there on. uniform_queries=True:
    device-side only (a sequence's rows then span at most the ring's size in positions)."""
    kvh, ring = spec_kv.shape[-2], spec_kv.shape[2]
    pos = positions.reshape(-1)
    if uniform_queries:
        num_seqs, total = block_table.shape[0], pos.shape[0]
        seq = torch.arange(total, device=pos.device) // (total // num_seqs)
        if k is not None and v is not None:  # committed rows write back what the ring holds
            own = (pos >= committed_len[seq])[None, :, None, None]
            rows, slots = spec_rows[seq], pos % ring
            new = torch.stack([k[0], v[0]]).transpose(1, 2).to(spec_kv.dtype)  # [2, T, kvh, d]
            spec_kv[:, rows, slots] = torch.where(own, new, spec_kv[:, rows, slots])
        base = _paged_keys(kv_pool[base_layer], block_table, q.dtype)  # [2, B, S, kvh, d]
        key_pos = torch.arange(base.shape[2], device=pos.device)
        ring_kv = spec_kv[:, spec_rows][:, :, key_pos % ring].to(q.dtype)  # [2, B, S, kvh, d]
        committed = (key_pos[None] < committed_len[:, None])[None, :, :, None, None]
        kv = torch.where(committed, base, ring_kv)
        mask = visible_keys(pos.view(num_seqs, -1), base.shape[2], sliding_window)
        return _uniform_sdpa(q, kv, mask, scale)
    n_seq = query_start_loc.shape[0] - 1
    meta = torch.cat([query_start_loc, pos[query_start_loc[1:] - 1], committed_len, spec_rows]).tolist()
    bounds, ends = meta[:n_seq + 1], meta[n_seq + 1:2 * n_seq + 1]
    committed, rows = meta[2 * n_seq + 1:3 * n_seq + 1], meta[3 * n_seq + 1:]
    seq = torch.repeat_interleave(torch.arange(n_seq, device=pos.device), query_start_loc.diff())
    own = pos >= committed_len[seq]
    if k is None or v is None:
        if bool(own.any()):
            raise ValueError("eagle_fx.shared_cached_attention: rows at positions >= committed_len need their k/v")
    else:
        r = own.nonzero().squeeze(1)
        if r.numel():
            new = torch.stack([k[0][:, r], v[0][:, r]]).transpose(1, 2).to(spec_kv.dtype)  # [2, r, kvh, d]
            spec_kv[:, spec_rows[seq[r]], pos[r] % ring] = new
    out = torch.empty_like(q)
    for s in range(n_seq):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        num_keys = ends[s] + 1
        c = min(committed[s], num_keys)
        if num_keys - c > ring:
            raise ValueError(f"eagle_fx.shared_cached_attention: {num_keys - c} uncommitted positions > ring size {ring}")
        first = ends[s] + 1 - (b - a)
        read = _shared_reader(_paged_reader(kv_pool[base_layer], block_table[s], q.dtype), spec_kv[:, rows[s]], c,
                              q.dtype)
        out[:, :, a:b] = _ragged_sdpa(q[:, :, a:b], read, kvh, num_keys, pos[a:b], first, scale, sliding_window)
    return out


def _shared_reader(base: KeyReader, ring: Tensor, committed: int, dtype: torch.dtype) -> KeyReader:
    """A KeyReader for a KV-sharing draft: positions below `committed` from the base's blocks
    (`base`), later ones from the sequence's ring [2, R, KVH, D] at slot position % R."""
    def read(lo: int, hi: int) -> Tensor:
        parts = [base(lo, min(hi, committed))] if lo < committed else []
        if hi > committed:
            slots = torch.arange(max(lo, committed), hi, device=ring.device) % ring.shape[1]
            parts.append(ring[:, slots].transpose(1, 2).to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    return read


def tree_visible_keys(q_pos: Tensor, tree_rows: Tensor, tree_start: Tensor, num_keys: int,
                      sliding_window: int) -> Tensor:
    """Bool mask [B, P, num_keys] for B sequences of P tree queries at positions q_pos [B, P]: keys
    below tree_start [B] by position (and window), then the W tree slots from tree_start that each
    query's row of tree_rows [B, P, W] marks. A row marks the query's ancestors and itself, which in
    slot order sit at depths 0, 1, ..., so its j-th marked slot is at position tree_start + j: the
    sliding window applies to them by that position."""
    width = tree_rows.shape[-1]
    key = torch.arange(num_keys, device=q_pos.device)
    start = tree_start[:, None, None]
    past = visible_keys(q_pos, num_keys, sliding_window) & (key < start)
    slot = key - start  # [B, 1, S]: the tree slot a key is, when 0 <= slot < W
    in_tree = (slot >= 0) & (slot < width)
    index = slot.clamp(0, width - 1).expand(-1, q_pos.shape[1], -1)
    tree = tree_rows.bool()
    marked = tree.gather(2, index) & in_tree
    if sliding_window > 0:
        slot_pos = start + tree.long().cumsum(2) - 1  # [B, P, W]
        marked &= q_pos[..., None] - slot_pos.gather(2, index) < sliding_window
    return past | marked


def tree_cached_attention_ref(q: Tensor, k: Tensor, v: Tensor, kv_pool: Tensor, layer: int, slot_mapping: Tensor,
                              block_table: Tensor, query_start_loc: Tensor, positions: Tensor, tree_mask: Tensor,
                              tree_start: Tensor, scale: float, sliding_window: int,
                              batch_invariant: bool = False) -> Tensor:
    """Write k/v at their slots, then attend each query to its sequence's keys below tree_start and
    to the tree slots its tree_mask row marks. Device-side only; batch_invariant=True: one query
    row at a time."""
    pool = kv_pool[layer]
    _write_kv(kv_pool, layer, k, v, slot_mapping)
    num_seqs, width = block_table.shape[0], tree_mask.shape[1]
    kv = _paged_keys(pool, block_table, q.dtype)
    q_pos = positions.reshape(num_seqs, -1)
    mask = tree_visible_keys(q_pos, tree_mask.view(num_seqs, -1, width), tree_start, kv.shape[2], sliding_window)
    if not batch_invariant:
        return _uniform_sdpa(q, kv, mask, scale)
    heads, total = q.shape[1], q.shape[2]
    per_seq = total // num_seqs
    out = torch.empty_like(q)
    gqa = kv.shape[-2] != heads
    for i in range(total):
        s, r = divmod(i, per_seq)
        out[:, :, i:i + 1] = F.scaled_dot_product_attention(
            q[:, :, i:i + 1], kv[0, s].transpose(0, 1)[None], kv[1, s].transpose(0, 1)[None],
            attn_mask=mask[s, r:r + 1], scale=scale, enable_gqa=gqa)
    return out


def rowwise_linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear one row at a time: each row's result is independent of how many rows there are."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    out = torch.cat([F.linear(r, weight, bias) for r in rows.split(1)])
    return out.reshape(*x.shape[:-1], weight.shape[0])


for _name, _fn in (("attention", attention_ref), ("cached_attention", cached_attention_ref),
                   ("shared_cached_attention", shared_cached_attention_ref),
                   ("tree_cached_attention", tree_cached_attention_ref), ("rowwise_linear", rowwise_linear_ref)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


@torch.library.register_fake("eagle_fx::attention", lib=_lib)
def _(q, k, v, scale, sliding_window):
    return torch.empty_like(q)


@torch.library.register_fake("eagle_fx::cached_attention", lib=_lib)
def _(q, k, v, kv_pool, layer, slot_mapping, block_table, query_start_loc, positions, scale, sliding_window,
      batch_invariant=False, uniform_queries=False):
    return torch.empty_like(q)


@torch.library.register_fake("eagle_fx::shared_cached_attention", lib=_lib)
def _(q, k, v, kv_pool, base_layer, spec_kv, spec_rows, committed_len, block_table, query_start_loc, positions, scale,
      sliding_window, uniform_queries=False):
    return torch.empty_like(q)


@torch.library.register_fake("eagle_fx::tree_cached_attention", lib=_lib)
def _(q, k, v, kv_pool, layer, slot_mapping, block_table, query_start_loc, positions, tree_mask, tree_start, scale,
      sliding_window, batch_invariant=False):
    return torch.empty_like(q)


@torch.library.register_fake("eagle_fx::rowwise_linear", lib=_lib)
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# eagle_fx::attention's autograd formula: the backward of the SDPA it stands for, recomputed from
# the saved q, k, v (no logsumexp kept), so a graph rewritten by canonicalize_attention still trains
def _attention_setup_context(ctx, inputs, output):
    q, k, v, scale, sliding_window = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scale, ctx.sliding_window = scale, sliding_window


def _attention_backward(ctx, grad_out):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = attention_ref(q_, k_, v_, ctx.scale, ctx.sliding_window)
        dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), grad_out)
    return dq, dk, dv, None, None


torch.library.register_autograd("eagle_fx::attention", _attention_backward, setup_context=_attention_setup_context,
                                lib=_lib)
