"""The device-side attention traced into a compiled graph (what passes/inline_uniform_attention.py
makes of a decode step) reads a long block table in key chunks: a torch.while_loop over chunks of
COMPILED_KEY_CHUNK keys, so one graph serves every table width and its memory does not grow with
the context. Oracle: the masked softmax over each sequence's gathered keys."""
import math

import pytest
import torch
import torch.nn.functional as F

from eagle_fx.ops.canonical import attention_limits, cached_attention_ref, visible_keys
from eagle_fx.runtime.compiled import compile_dynamic  # the runtime's settings: every size dynamic

HEADS, KV_HEADS, D, BLOCK, SEQS = 4, 2, 16, 16, 2
CHUNK_KEYS = 64  # 4 blocks: the test's contexts are 4 and 16 chunks long


def _decode_step(context: int, rows: int = 1, seed: int = 0):
    """SEQS sequences at `context` cached keys each (slightly different lengths), `rows` new query rows each."""
    g = torch.Generator().manual_seed(seed)
    width = context // BLOCK
    pool = torch.randn(1, 2, SEQS * width + 1, BLOCK, KV_HEADS, D, generator=g)
    table = torch.randperm(SEQS * width, generator=g).view(SEQS, width)
    pos = torch.cat([torch.arange(context - rows - 3 * s, context - 3 * s) for s in range(SEQS)])
    seq = torch.arange(SEQS).repeat_interleave(rows)
    slots = table[seq, pos // BLOCK] * BLOCK + pos % BLOCK
    q, k, v = (torch.randn(1, h, SEQS * rows, D, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    return q, k, v, pool, slots, table, torch.arange(SEQS + 1) * rows, pos[None]


def _formula(q, pool, table, pos, window):
    """Each sequence's rows over its table's keys (after the step's write), masked by position."""
    keys = pool[0][:, table].flatten(2, 3).transpose(2, 3)  # [2, B, KVH, S, D]
    q_pos = pos.view(SEQS, -1)
    qs = q[0].view(HEADS, SEQS, -1, D).transpose(0, 1)  # [B, H, P, D]
    mask = visible_keys(q_pos, keys.shape[3], window)[:, None]
    out = F.scaled_dot_product_attention(qs, keys[0], keys[1], attn_mask=mask, scale=0.25, enable_gqa=True)
    return out.transpose(0, 1).reshape(1, HEADS, -1, D)


def _step(q, k, v, pool, slots, table, qsl, pos, window):
    return cached_attention_ref(q, k, v, pool, 0, slots, table, qsl, pos, 0.25, window, uniform_queries=True)


def _largest_tensor_seen(fn) -> int:
    """The most elements of any tensor an op called by fn receives (the profiler's recorded
    shapes): in a compiled step, what its extern kernels (the attention) read at once. Inductor's
    own buffers are not profiler allocations, so this, not the allocation sizes, shows a read of
    the whole table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return max(math.prod(shape) for e in prof.events() for shape in e.input_shapes if shape)


def test_compiled_verify_reads_long_tables_in_chunks_with_one_graph():
    """Two contexts (4 and 16 chunks), a verify-like step of 3 rows per sequence, GQA, and a
    sliding window (40: rows that see none of a chunk's keys): the compiled step == the formula,
    writes the pool as eager does, and the second width runs the first's graph (no recompile)."""
    window = 40
    compiled = compile_dynamic(_step, fullgraph=True)
    with attention_limits(compiled_key_chunk=CHUNK_KEYS):
        for i, context in enumerate((4 * CHUNK_KEYS, 16 * CHUNK_KEYS)):
            q, k, v, pool, slots, table, qsl, pos = _decode_step(context, rows=3, seed=i)
            eager_pool = pool.clone()
            want = _step(q, k, v, eager_pool, slots, table, qsl, pos, window)
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                got = compiled(q, k, v, pool, slots, table, qsl, pos, window)
            torch.testing.assert_close(pool, eager_pool)
            torch.testing.assert_close(got, _formula(q, pool, table, pos, window), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_decode_memory_does_not_grow_with_the_context():
    """The compiled one-row decode step (no window) == the formula, and its largest tensor is the
    same for a context 4x longer, with no recompile (a chunk's keys), far below the table's keys
    (a read of the whole table at once, the compiled path before, hands the attention the whole
    table's K: this measure then gives table_keys)."""
    def largest(compiled, context, chunk_keys, stance="default"):
        q, k, v, pool, slots, table, qsl, pos = _decode_step(context)
        with attention_limits(compiled_key_chunk=chunk_keys), torch.compiler.set_stance(stance):
            got = compiled(q, k, v, pool, slots, table, qsl, pos, 0)  # compiles outside the profile
            torch.testing.assert_close(got, _formula(q, pool, table, pos, 0), rtol=1e-5, atol=1e-5)
            return _largest_tensor_seen(lambda: compiled(q, k, v, pool, slots, table, qsl, pos, 0))

    short, long = 8 * CHUNK_KEYS, 32 * CHUNK_KEYS
    table_keys = SEQS * long * KV_HEADS * D  # elements of the long context's K
    chunked = compile_dynamic(_step, fullgraph=True)
    assert largest(chunked, short, CHUNK_KEYS) == largest(chunked, long, CHUNK_KEYS, "fail_on_recompile")
    assert largest(chunked, long, CHUNK_KEYS) < table_keys / 8
