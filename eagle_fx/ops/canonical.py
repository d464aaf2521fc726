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

The limits of those strategies are in limits.py (`attention_limits(...)` sets them).

Modules: this one defines the schemas and registers the kernels; reference.py holds the torch
implementations (ragged_attention.py / uniform_attention.py the strategies, online_softmax.py the
one chunked loop they share, paged_pool.py the KV write and reads, masks.py the visibility rules);
fake_kernels.py and attention_autograd.py what their names say.

The ops are defined with `torch.library.Library` (schema + CompositeExplicitAutograd kernel +
`register_fake`): the same contract as `custom_op`, with less Python on every call, which matters
for the one-token decode steps on the CPU. They work in eager, under torch.compile and torch.export.
"""
from __future__ import annotations

import torch

from eagle_fx.ops.attention_autograd import attention_backward, attention_setup_context
from eagle_fx.ops.fake_kernels import (attention_fake, cached_attention_fake, rowwise_linear_fake,
                                       shared_cached_attention_fake, tree_cached_attention_fake)
from eagle_fx.ops.limits import AttentionLimits, attention_limits, set_attention_limits  # noqa: F401
from eagle_fx.ops.masks import tree_visible_keys, visible_keys  # noqa: F401
from eagle_fx.ops.reference import (attention_ref, cached_attention_ref, rowwise_linear_ref,
                                    shared_cached_attention_ref, tree_cached_attention_ref)

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
    "float scale, int sliding_window, bool batch_invariant=False, bool uniform_queries=False) -> Tensor"
)
_lib.define(
    "tree_cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_pool, int layer, Tensor slot_mapping, "
    "Tensor block_table, Tensor query_start_loc, Tensor positions, Tensor tree_mask, Tensor tree_start, float scale, "
    "int sliding_window, bool batch_invariant=False) -> Tensor"
)
_lib.define("rowwise_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")

for _name, _impl, _fake in (
        ("attention", attention_ref, attention_fake),
        ("cached_attention", cached_attention_ref, cached_attention_fake),
        ("shared_cached_attention", shared_cached_attention_ref, shared_cached_attention_fake),
        ("tree_cached_attention", tree_cached_attention_ref, tree_cached_attention_fake),
        ("rowwise_linear", rowwise_linear_ref, rowwise_linear_fake)):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"eagle_fx::{_name}", _fake, lib=_lib)

torch.library.register_autograd("eagle_fx::attention", attention_backward, setup_context=attention_setup_context,
                                lib=_lib)

__all__ = ["attention_ref", "cached_attention_ref", "shared_cached_attention_ref", "tree_cached_attention_ref",
           "rowwise_linear_ref", "visible_keys", "tree_visible_keys", "AttentionLimits", "attention_limits",
           "set_attention_limits"]
