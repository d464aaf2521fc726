"""Cycle costs measured before serving: for adaptive speculation, the seconds of one cycle at each
candidate k and batch sizes 1, 2, 4, ... up to the slots, on blocks taken from (and given back
to) the engine's own pool, at a short and a long context: their difference is what a key of the
attention costs at that k and batch size (StepCosts' slope), the rest the cycle's cost at no keys.
Each first call also compiles the cycle for that k (inductor), so serving never compiles inside a
request's latency."""
from __future__ import annotations

import statistics
import time

import torch

from eagle_fx.runtime.scheduler import decode_width
from eagle_fx.runtime.static_buffers import buckets


@torch.no_grad()
def measure_cycle_costs(engine, batch_sizes=None, repeats: int = 4, contexts: tuple[int, int] = (64, 512)) -> dict:
    """Seconds of 2 x `repeats` cycles per (k, batch size, context) into engine.costs (each one a
    measurement: it keeps their median; with both contexts measured, the seconds per key first);
    returns the costs at no keys. A context whose blocks the pool cannot give at a batch size is
    not measured there (a batch size with neither: not at all)."""
    model, kv = engine.model, engine.kv
    batch_sizes = batch_sizes or buckets(model.options.max_batch_size)
    longest = model.options.max_seq_len - model.lookahead - model.draft_offset - 1
    contexts = sorted({min(c, longest) for c in contexts})
    for batch in batch_sizes:
        samples: dict[int, dict[int, list[float]]] = {k: {} for k in engine.ks}  # k -> keys -> seconds
        for context in contexts:
            width = max(decode_width(model, context), 2)
            try:
                blocks = kv.allocator.allocate(batch * width)
            except RuntimeError:
                continue  # a pool too small for this many sequences at this context: not measured
            try:
                args = cycle_inputs(engine, blocks, batch, context)
                for k in engine.ks:  # compiles (first time) and warms
                    engine.cycles[k](model.executor, _greedy(), *args)[0].tolist()
                keys = batch * width * model.options.block_size
                for _ in range(repeats):  # the ks in turn (a drift of the machine moves them alike),
                    for k in engine.ks:  # each warmed by an untimed cycle, as a k runs on in service
                        engine.cycles[k](model.executor, _greedy(), *args)[0].tolist()
                        for _ in range(2):
                            started = time.perf_counter()
                            engine.cycles[k](model.executor, _greedy(), *args)[0].tolist()
                            samples[k].setdefault(keys, []).append(time.perf_counter() - started)
            finally:
                kv.allocator.release(blocks)
        for k, by_keys in samples.items():
            if len(by_keys) == 2:
                (few, short), (many, long) = sorted(by_keys.items())
                engine.costs.set_slope(k, batch, (statistics.median(long) - statistics.median(short)) / (many - few))
            for keys, seconds in by_keys.items():
                for s in seconds:
                    engine.costs.observe(k, batch, s, keys=keys, prior=True)
    return engine.costs.measured()


def cycle_keys(model, committed: list[int]) -> int:
    """Keys per layer the attention of a cycle of sequences at `committed` tokens reads: its rows x
    its table's width in tokens (what StepCosts' slope is per)."""
    return len(committed) * decode_width(model, max(committed)) * model.options.block_size if committed else 0


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
