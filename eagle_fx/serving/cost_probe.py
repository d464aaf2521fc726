"""Cycle costs measured before serving: for adaptive speculation, the seconds of one cycle at each
candidate k and batch sizes 1, 2, 4, ... up to the slots, on blocks taken from (and given back
to) the engine's own pool, at a context of `context` tokens. Each first call also compiles the
cycle for that k (inductor), so serving never compiles inside a request's latency."""
from __future__ import annotations

import time

import torch

from eagle_fx.runtime.static_buffers import buckets


@torch.no_grad()
def measure_cycle_costs(engine, batch_sizes=None, repeats: int = 5, context: int = 64) -> dict:
    """Seconds of `repeats` cycles per (k, batch size) into engine.costs (each one a measurement: it
    keeps their median); returns the table."""
    model, kv = engine.model, engine.kv
    slots = model.options.max_batch_size
    batch_sizes = batch_sizes or buckets(slots)
    context = min(context, model.options.max_seq_len - 1)
    width = max(kv.table_width(context + model.lookahead + model.draft_offset), 2)
    for batch in batch_sizes:
        try:
            blocks = kv.allocator.allocate(batch * width)
        except RuntimeError:
            continue  # a pool too small for this many sequences at this context: not measured
        try:
            for k in engine.ks:
                cycle = engine.cycles[k]
                args = cycle_inputs(engine, blocks, batch, context)
                cycle(model.executor, _greedy(), *args)  # compiles (first time) and warms
                for _ in range(repeats):
                    started = time.perf_counter()
                    out = cycle(model.executor, _greedy(), *args)
                    out[0].tolist()
                    engine.costs.observe(k, batch, time.perf_counter() - started)
        finally:
            kv.allocator.release(blocks)
    return engine.costs.measured()


def cycle_inputs(engine, blocks: list[int], batch: int, context: int) -> tuple:
    """A cycle's inputs (pending, committed_len, block_table, spec_rows, draft_logits, draft_hidden)
    for `batch` sequences at `context` committed tokens, on `blocks` (batch * table width of them,
    taken from the engine's pool by the caller): for probing and compiling, outside any request."""
    long = dict(dtype=torch.long, device=engine.device)
    return (torch.zeros(batch, **long), torch.full((batch,), context, **long),
            torch.tensor(blocks, **long).view(batch, -1), torch.arange(batch, **long),
            engine.draft_logits[:batch].clone(), engine.draft_hidden[:batch].clone())


def _greedy():
    from eagle_fx.runtime.sampling import Sampler

    return Sampler()
