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

import torch
import torch.nn.functional as F
from torch import Tensor

_lib = torch.library.Library("eagle_fx", "DEF")  # noqa: TOR901 - the op namespace, defined once
_lib.define("attention(Tensor q, Tensor k, Tensor v, float scale, int sliding_window) -> Tensor")
_lib.define(
    "cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_pool, int layer, Tensor slot_mapping, "
    "Tensor block_table, Tensor query_start_loc, Tensor positions, float scale, int sliding_window, "
    "bool batch_invariant=False) -> Tensor"
)
_lib.define(
    "shared_cached_attention(Tensor q, Tensor? k, Tensor? v, Tensor kv_pool, int base_layer, Tensor(a!) spec_kv, "
    "Tensor spec_rows, Tensor committed_len, Tensor block_table, Tensor query_start_loc, Tensor positions, "
    "float scale, int sliding_window) -> Tensor"
)
_lib.define(
    "tree_cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_pool, int layer, Tensor slot_mapping, "
    "Tensor block_table, Tensor query_start_loc, Tensor positions, Tensor tree_mask, Tensor tree_start, float scale, "
    "int sliding_window, bool batch_invariant=False) -> Tensor"
)
_lib.define("rowwise_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")


def visible_keys(q_pos: Tensor, num_keys: int, sliding_window: int) -> Tensor:
    """Bool mask [Tq, num_keys]: key position j is visible to a query at position p."""
    dist = q_pos[:, None] - torch.arange(num_keys, device=q_pos.device)[None, :]
    mask = dist >= 0
    if sliding_window > 0:
        mask &= dist < sliding_window
    return mask


def attention_ref(q: Tensor, k: Tensor, v: Tensor, scale: float, sliding_window: int) -> Tensor:
    """Causal attention over one sequence per batch row (the model's own, uncached semantics)."""
    t = q.shape[-2]
    mask = visible_keys(torch.arange(t, device=q.device), t, sliding_window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def cached_attention_ref(q: Tensor, k: Tensor, v: Tensor, kv_pool: Tensor, layer: int, slot_mapping: Tensor,
                         block_table: Tensor, query_start_loc: Tensor, positions: Tensor, scale: float,
                         sliding_window: int, batch_invariant: bool = False) -> Tensor:
    """Write k/v at their slots, then attend each query to its sequence's cached keys.

    batch_invariant=True attends one query row at a time, so a row's result does not depend on how
    many rows share the call (chunked prefill then gives bit-identical KV to unchunked prefill).
    """
    kvh, d = k.shape[1], k.shape[3]
    block_size = kv_pool.shape[3]
    pool = kv_pool[layer]  # [2, blocks, block_size, kvh, d]
    pool.view(2, -1, kvh, d).index_copy_(1, slot_mapping, torch.stack([k[0], v[0]]).transpose(1, 2).to(kv_pool.dtype))

    out = torch.empty_like(q)
    pos = positions.reshape(-1)
    n_seq = query_start_loc.shape[0] - 1
    # one host sync for all sequences: query bounds, and each sequence's last query position
    meta = torch.cat([query_start_loc, pos[query_start_loc[1:] - 1]]).tolist()
    bounds, ends = meta[:n_seq + 1], meta[n_seq + 1:]
    gqa = kvh != q.shape[1]
    if not batch_invariant and n_seq > 1 and all(bounds[s + 1] - bounds[s] == bounds[1] for s in range(n_seq)):
        return _uniform_cached_attention(q, pool, block_table, pos, n_seq, max(ends) + 1, scale, sliding_window, gqa)
    for s in range(n_seq):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        num_keys = ends[s] + 1  # a sequence's queries are its last positions
        nb = -(-num_keys // block_size)
        kv = pool[:, block_table[s, :nb]].view(2, nb * block_size, kvh, d)[:, :num_keys].transpose(1, 2)
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        kt, vt = kv[0][None], kv[1][None]
        if batch_invariant:
            for i, p in enumerate(pos[a:b].tolist(), start=a):
                lo = max(0, p + 1 - sliding_window) if sliding_window > 0 else 0
                out[:, :, i:i + 1] = F.scaled_dot_product_attention(
                    q[:, :, i:i + 1], kt[:, :, lo:p + 1], vt[:, :, lo:p + 1], scale=scale, enable_gqa=gqa)
            continue
        if b - a == 1 and (sliding_window == 0 or num_keys <= sliding_window):
            mask = None  # one query at the end of its sequence: every cached key is visible
        else:
            mask = visible_keys(pos[a:b], num_keys, sliding_window)
        out[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b], kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out


def _uniform_cached_attention(q: Tensor, pool: Tensor, block_table: Tensor, pos: Tensor, n_seq: int, num_keys: int,
                              scale: float, sliding_window: int, gqa: bool) -> Tensor:
    """Every sequence of the call has the same number of queries (a decode step, a verify, a batch
    of equal-length prompts): one attention over all of them, each sequence's keys gathered up to
    the longest one's and the rest masked out by position."""
    kvh, d, block_size = pool.shape[-2], pool.shape[-1], pool.shape[2]
    heads, total = q.shape[1], q.shape[2]
    per_seq = total // n_seq
    nb = -(-num_keys // block_size)
    kv = pool[:, block_table[:, :nb]].view(2, n_seq, nb * block_size, kvh, d)[:, :, :num_keys].transpose(2, 3)
    if kv.dtype != q.dtype:
        kv = kv.to(q.dtype)
    query_pos = pos.view(n_seq, per_seq)
    mask = (torch.arange(num_keys, device=q.device)[None, None, :] <= query_pos[:, :, None])
    if sliding_window > 0:
        mask &= query_pos[:, :, None] - torch.arange(num_keys, device=q.device)[None, None, :] < sliding_window
    qs = q[0].reshape(heads, n_seq, per_seq, d).transpose(0, 1)  # [B, H, Tq, D]
    out = F.scaled_dot_product_attention(qs, kv[0], kv[1], attn_mask=mask[:, None], scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1).reshape(1, heads, total, d)


def shared_cached_attention_ref(q: Tensor, k: Tensor | None, v: Tensor | None, kv_pool: Tensor, base_layer: int,
                                spec_kv: Tensor, spec_rows: Tensor, committed_len: Tensor, block_table: Tensor,
                                query_start_loc: Tensor, positions: Tensor, scale: float, sliding_window: int) -> Tensor:
    """Write the uncommitted rows' k/v into the ring, then attend each query to its sequence's keys:
    the base layer's below committed_len, the ring's from there on."""
    kvh, d = spec_kv.shape[-2], spec_kv.shape[-1]
    ring, block_size = spec_kv.shape[2], kv_pool.shape[3]
    pos = positions.reshape(-1)
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
    base = kv_pool[base_layer]
    gqa = kvh != q.shape[1]
    for s in range(n_seq):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        num_keys = ends[s] + 1
        c = min(committed[s], num_keys)
        if num_keys - c > ring:
            raise ValueError(f"eagle_fx.shared_cached_attention: {num_keys - c} uncommitted positions > ring size {ring}")
        nb = -(-c // block_size)
        kv = base[:, block_table[s, :nb]].reshape(2, nb * block_size, kvh, d)[:, :c]
        if num_keys > c:
            kv = torch.cat([kv, spec_kv[:, rows[s], torch.arange(c, num_keys, device=pos.device) % ring]], dim=1)
        kv = kv.transpose(1, 2)
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        if b - a == 1 and (sliding_window == 0 or num_keys <= sliding_window):
            mask = None
        else:
            mask = visible_keys(pos[a:b], num_keys, sliding_window)
        out[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b], kv[0][None], kv[1][None], attn_mask=mask,
                                                        scale=scale, enable_gqa=gqa)
    return out


def tree_visible_keys(q_pos: Tensor, tree_rows: Tensor, tree_start: int, sliding_window: int) -> Tensor:
    """Bool mask [Tq, tree_start + W]: keys below tree_start by position (and window), then the tree
    slots each query's row of the tree mask [Tq, W] marks. A row marks the query's ancestors and
    itself, which in slot order sit at depths 0, 1, ..., so its j-th marked slot is at position
    tree_start + j: the sliding window applies to them by that position."""
    tree = tree_rows.bool()
    past = visible_keys(q_pos, tree_start, sliding_window) if tree_start else tree.new_zeros(len(q_pos), 0)
    if sliding_window > 0:
        key_pos = tree_start + tree.long().cumsum(1) - 1
        tree = tree & (q_pos[:, None] - key_pos < sliding_window)
    return torch.cat([past, tree], dim=1)


def tree_cached_attention_ref(q: Tensor, k: Tensor, v: Tensor, kv_pool: Tensor, layer: int, slot_mapping: Tensor,
                              block_table: Tensor, query_start_loc: Tensor, positions: Tensor, tree_mask: Tensor,
                              tree_start: Tensor, scale: float, sliding_window: int,
                              batch_invariant: bool = False) -> Tensor:
    """Write k/v at their slots, then attend each query to its sequence's keys below tree_start and
    to the tree slots its tree_mask row marks. batch_invariant=True: one query row at a time."""
    kvh, d = k.shape[1], k.shape[3]
    block_size, width = kv_pool.shape[3], tree_mask.shape[1]
    pool = kv_pool[layer]
    pool.view(2, -1, kvh, d).index_copy_(1, slot_mapping, torch.stack([k[0], v[0]]).transpose(1, 2).to(kv_pool.dtype))
    out = torch.empty_like(q)
    pos = positions.reshape(-1)
    n_seq = query_start_loc.shape[0] - 1
    meta = torch.cat([query_start_loc, tree_start]).tolist()
    bounds, starts = meta[:n_seq + 1], meta[n_seq + 1:]
    gqa = kvh != q.shape[1]
    for s in range(n_seq):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        num_keys = starts[s] + width
        nb = -(-num_keys // block_size)
        kv = pool[:, block_table[s, :nb]].view(2, nb * block_size, kvh, d)[:, :num_keys].transpose(1, 2)
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        mask = tree_visible_keys(pos[a:b], tree_mask[a:b], starts[s], sliding_window)
        if batch_invariant:
            for i in range(a, b):
                out[:, :, i:i + 1] = F.scaled_dot_product_attention(
                    q[:, :, i:i + 1], kv[0][None], kv[1][None], attn_mask=mask[i - a:i - a + 1], scale=scale, enable_gqa=gqa)
            continue
        out[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b], kv[0][None], kv[1][None], attn_mask=mask,
                                                        scale=scale, enable_gqa=gqa)
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
      batch_invariant=False):
    return torch.empty_like(q)


@torch.library.register_fake("eagle_fx::shared_cached_attention", lib=_lib)
def _(q, k, v, kv_pool, base_layer, spec_kv, spec_rows, committed_len, block_table, query_start_loc, positions, scale,
      sliding_window):
    return torch.empty_like(q)


@torch.library.register_fake("eagle_fx::tree_cached_attention", lib=_lib)
def _(q, k, v, kv_pool, layer, slot_mapping, block_table, query_start_loc, positions, tree_mask, tree_start, scale,
      sliding_window, batch_invariant=False):
    return torch.empty_like(q)


@torch.library.register_fake("eagle_fx::rowwise_linear", lib=_lib)
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
