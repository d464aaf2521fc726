"""`eagle-fx bench --long-context 2048,8192,32768`: one long random prompt per length, HF greedy
generate against eagle_fx with whole-prompt and chunked prefill: seconds, peak resident memory,
the KV pool's bytes, and equality with HF.

Each run is a process of its own (spawned), so each peak RSS (`ru_maxrss`) is that run's alone:
model, runtime, activations and KV pool together. Every method runs twice: once as is, for its
seconds (and its peak under glibc's default allocator settings), and once with
MALLOC_MMAP_THRESHOLD_ fixed at 1 MiB, for its peak memory. With the default, glibc raises its
mmap threshold as buffers are freed and then keeps freed buffers in the heap, so the peaks of two
identical runs differ by up to ~100 MB; with the threshold fixed, every buffer of 1 MiB or more is
returned when freed, and the peak is what the run holds at once (those runs are slower, by their
page faults, so their seconds are not reported). The growth line compares how much each method's
peak grows from one length to the next with how much eagle_fx's KV pool grows.
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import time

import torch

METHODS = ("HF generate", "eagle_fx", "eagle_fx chunked")
MMAP_THRESHOLD = 1 << 20  # bytes: the memory runs' MALLOC_MMAP_THRESHOLD_


def new_tokens(args) -> int:
    """Tokens each long-context run generates: --output-len, at most 16."""
    return min(args.output_len, 16)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def _one_run(model_dir, eagle_dir, method, prompt, new_tokens, chunk, backend, num_spec_tokens, queue) -> None:
    """In a fresh process: load the pair, run `method` on `prompt`, report tokens, seconds, peak RSS, pool bytes."""
    from eagle_fx.bundled import load_pair

    _, base, draft = load_pair(model_dir, eagle_dir)
    pool_bytes = 0
    started = time.perf_counter()
    if method == "HF generate":
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        seconds = time.perf_counter() - started
    else:
        import eagle_fx

        model = eagle_fx.compile(base, draft, num_spec_tokens=num_spec_tokens, backend=backend, max_batch_size=1,
                                 max_seq_len=len(prompt) + new_tokens, prefill_chunk_size=chunk)
        kv = model.kv_bytes()
        pool_bytes = kv["base"] + kv["draft"]
        started = time.perf_counter()
        out = model.generate([prompt], max_new_tokens=new_tokens, eos_token_id=None).sequences[0]
        seconds = time.perf_counter() - started
    queue.put({"tokens": out, "seconds": seconds, "peak_rss_mb": _peak_rss_mb(), "kv_pool_mb": pool_bytes / 2**20})


def spawned(target, *args, mmap_threshold: int | None = None) -> dict:
    """target(*args, queue) in a spawned process, returning what it puts on the queue;
    mmap_threshold: the process's glibc MALLOC_MMAP_THRESHOLD_ (read when it starts)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    try:
        proc.start()
    finally:
        if mmap_threshold is not None:
            if saved is None:
                del os.environ["MALLOC_MMAP_THRESHOLD_"]
            else:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    result = queue.get()
    proc.join()
    return result


def _timed_and_measured(*args) -> dict:
    """A method's seconds from a run as is, its peak RSS from a run with the mmap threshold fixed."""
    timed = spawned(_one_run, *args)
    measured = spawned(_one_run, *args, mmap_threshold=MMAP_THRESHOLD)
    return {**timed, "peak_rss_mb": measured["peak_rss_mb"], "peak_rss_default_malloc_mb": timed["peak_rss_mb"],
            "same_tokens_in_both_runs": measured["tokens"] == timed["tokens"]}


def run(args, model_dir, eagle_dir, vocab_size: int, backend: str) -> dict:
    lengths = args.long_context
    chunk = args.prefill_chunk_size or 2048
    new = new_tokens(args)
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for length in lengths:
        prompt = torch.randint(3, vocab_size, (length,), generator=g).tolist()
        row = {"prompt_len": length}
        for method in METHODS:
            print(f"  {length} tokens: {method} ...", flush=True)
            row[method] = _timed_and_measured(model_dir, eagle_dir, method, prompt, new,
                                              chunk if "chunked" in method else None, backend, args.num_spec_tokens)
        ref = row["HF generate"]["tokens"]
        row["equal_to_hf"] = {m: row[m]["tokens"] == ref for m in METHODS[1:]}
        rows.append(row)
    print(f"\nlong context: one random prompt per length, {new} new tokens, k={args.num_spec_tokens}, backend {backend}, "
          f"chunked prefill {chunk} tokens per chunk; seconds from a run as is, peak RSS (MB) of a second run "
          f"with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} (freed buffers leave the RSS), in brackets the first run's "
          f"peak under glibc's default settings (varies by up to ~100 MB between identical runs)")
    print(f"{'prompt':>8}{'HF s':>8}{'HF MB':>13}{'eagle_fx s':>12}{'MB':>13}{'chunked s':>11}{'MB':>13}"
          f"{'KV pool MB':>12}{'== HF':>10}")

    def mb(run):
        return f"{run['peak_rss_mb']:.0f} ({run['peak_rss_default_malloc_mb']:.0f})"

    for r in rows:
        e, c, h = r["eagle_fx"], r["eagle_fx chunked"], r["HF generate"]
        same = "/".join("yes" if r["equal_to_hf"][m] else "NO" for m in METHODS[1:])
        print(f"{r['prompt_len']:>8}{h['seconds']:>8.1f}{mb(h):>13}{e['seconds']:>12.1f}{mb(e):>13}"
              f"{c['seconds']:>11.1f}{mb(c):>13}{e['kv_pool_mb']:>12.1f}{same:>10}")
    growth = []
    for a, b in zip(rows, rows[1:]):
        pool = b["eagle_fx"]["kv_pool_mb"] - a["eagle_fx"]["kv_pool_mb"]
        entry = {"from": a["prompt_len"], "to": b["prompt_len"], "kv_pool_mb": pool}
        for m in METHODS:
            entry[m] = b[m]["peak_rss_mb"] - a[m]["peak_rss_mb"]
        growth.append(entry)
        print(f"{a['prompt_len']} -> {b['prompt_len']} tokens: KV pool +{pool:.0f} MB; peak RSS "
              + ", ".join(f"{m} +{entry[m]:.0f} MB" for m in METHODS)
              + (f" (chunked: {entry['eagle_fx chunked'] / pool:.2f}x the pool's growth)" if pool > 0 else ""))
    if not all(all(r["equal_to_hf"].values()) for r in rows):
        print("long context: some outputs differ from HF greedy (see == HF)")
    if not all(r[m]["same_tokens_in_both_runs"] for r in rows for m in METHODS):
        print("long context: a method's two runs (timed, measured) generated different tokens")
    for r in rows:
        for m in METHODS:
            r[m] = {k: v for k, v in r[m].items() if k != "tokens"}
    return {"long_context": rows, "growth": growth}
