"""Wall-clock runners: one generator timed over batches of prompts, or several models interleaved
batch by batch so machine load falls on all of them alike."""
from __future__ import annotations

import time

from tqdm.auto import tqdm


def timed(generate_batch, prompts, desc: str, batch_size: int = 1):
    """generate_batch(prompts) -> outputs, called on consecutive batches. Returns (every output,
    seconds spent inside generate_batch)."""
    outputs, seconds = [], 0.0
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch" if batch_size > 1 else "prompt", leave=False):
        t0 = time.perf_counter()
        outputs += generate_batch(prompts[i:i + batch_size])
        seconds += time.perf_counter() - t0
    return outputs, seconds


def interleaved(models: list, prompts, batch_size: int, desc: str, per_prompt: dict | None = None, **generate_kwargs):
    """Every model generates each batch of prompts in turn. per_prompt: generate arguments with one
    entry per prompt (sliced like the prompts). Returns, per model, stats whose wall_time_s is its
    own generate time, and its output sequences."""
    stats = [model.new_stats() for model in models]
    sequences: list[list] = [[] for _ in models]
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", leave=False):
        rows = slice(i, i + batch_size)
        sliced = {name: values[rows] for name, values in (per_prompt or {}).items()}
        for model, st, seqs in zip(models, stats, sequences):
            t0 = time.perf_counter()
            out = model.generate(prompts[rows], **generate_kwargs, **sliced)
            st.wall_time_s += time.perf_counter() - t0
            st.merge(out.stats)  # (merge leaves wall_time_s alone)
            seqs += out.sequences
    return stats, sequences
