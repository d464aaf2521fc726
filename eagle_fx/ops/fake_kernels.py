"""The eagle_fx ops' fake (shape) kernels: what each op returns, for tracing without data. Every
attention returns q's layout (empty_like(q)), which the reference implementations honour
(tests/ops/test_opcheck.py holds them to it)."""
from __future__ import annotations

import torch


def attention_fake(q, k, v, scale, sliding_window):
    return torch.empty_like(q)


def cached_attention_fake(q, k, v, kv_pool, layer, slot_mapping, block_table, query_start_loc, positions, scale,
                          sliding_window, batch_invariant=False, uniform_queries=False):
    return torch.empty_like(q)


def shared_cached_attention_fake(q, k, v, kv_pool, base_layer, spec_kv, spec_rows, committed_len, block_table,
                                 query_start_loc, positions, scale, sliding_window, batch_invariant=False,
                                 uniform_queries=False):
    return torch.empty_like(q)


def tree_cached_attention_fake(q, k, v, kv_pool, layer, slot_mapping, block_table, query_start_loc, positions,
                               tree_mask, tree_start, scale, sliding_window, batch_invariant=False):
    return torch.empty_like(q)


def rowwise_linear_fake(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
