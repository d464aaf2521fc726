"""Continuous batching vs wave admission, offline (in-process, no server).

One compiled model (k=3, --backend, --max-batch-size 16, prefix caching off so no run reuses an
earlier run's blocks) and one set of --num-requests held-out ShareGPT prompts with MIXED output
lengths (max_tokens drawn from --lengths, ignore_eos, greedy), all submitted at once, are run
through `Engine(model, tok, speculation=3, admission="waves")` (requests admitted only when
nothing runs, up to max_batch_size at once: every wave waits for its longest request) and
`Engine(..., admission="continuous")` (a request joins as soon as a slot frees), alternating
A/B/A/B (--repeats each, after an untimed warm-up run of each). Reported: output tok/s of each run (output
tokens / wall from the first add_request to the last output), the medians and their ratio, and
greedy-exact n/n of every run (each output against HF `generate(do_sample=False)` of its prompt).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from serve_common import REPO, held_out_prompts, hf_greedy, log  # noqa: F401 - REPO puts the repository on sys.path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " (see the module docstring)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--backend", choices=["eager", "inductor"], default="inductor", help="compile backend")
    ap.add_argument("--max-batch-size", type=int, default=16, help="the model's max_batch_size (the wave size)")
    ap.add_argument("--num-spec-tokens", type=int, default=3,
                    help="the model's k: both engines' fixed k (0: the pair compiled without its draft), or the "
                         "largest k adaptive speculation chooses")
    ap.add_argument("--speculation", choices=["fixed", "adaptive"], default="fixed",
                    help="both engines at the fixed k, or adaptive speculation (k in 0, 1 and --num-spec-tokens; "
                         "each engine measures its startup costs before its run, outside the timing)")
    ap.add_argument("--num-requests", type=int, default=48, help="requests, all submitted at once")
    ap.add_argument("--lengths", default="8,32,128", help="comma list max_tokens is drawn from (uniformly)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each admission (alternated A/B/A/B)")
    ap.add_argument("--max-prompt-len", type=int, default=256, help="skip longer held-out prompts (tokens)")
    ap.add_argument("--max-seq-len", type=int, default=512, help="the model's max_seq_len")
    ap.add_argument("--seed", type=int, default=0, help="seed of the length draw")
    ap.add_argument("--out", default="waves_vs_continuous.json", help="JSON results")
    return ap.parse_args(argv)


def run_engine(model, tok, prompts, lengths, admission: str, k: int | str) -> dict:
    from eagle_fx.serving.engine import Engine
    from eagle_fx.serving.requests import SamplingParams

    engine = Engine(model, tok, speculation=k, admission=admission)
    before = engine.metrics()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    final, steps, batch_sizes = {}, 0, []
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        batch_sizes.append(engine.num_running)
        for o in outs:
            if o.finished:
                final[o.request_id] = list(o.token_ids)
    wall = time.perf_counter() - t0
    after = engine.metrics()
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    outputs = [final.get(i) for i in ids]
    tokens = sum(len(o or []) for o in outputs)
    return {"admission": admission, "wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall, "steps": steps,
            "mean_running": sum(batch_sizes) / max(1, len(batch_sizes)),
            "acceptance": 1 + accepted / drafts if drafts else None, "outputs": outputs,
            "kv_blocks_used_after": after["kv_blocks_used"],
            "cycles_by_k": {key: n - before["cycles_by_k"].get(key, 0) for key, n in after["cycles_by_k"].items()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    setting = "adaptive" if args.speculation == "adaptive" else args.num_spec_tokens
    if setting == "adaptive" and args.num_spec_tokens < 1:  # (before the references and the compile)
        raise SystemExit("--speculation adaptive needs --num-spec-tokens >= 1")
    import torch

    import eagle_fx
    from eagle_fx.bundled import load_pair, pair_dirs

    log(f"waves vs continuous: {args.num_requests} requests, lengths {args.lengths}, backend {args.backend}, "
        f"max batch {args.max_batch_size}, {args.speculation} k={args.num_spec_tokens}, torch threads {torch.get_num_threads()}")
    tok, base, draft = load_pair(*pair_dirs())
    prompts = held_out_prompts(tok, args.num_requests, args.max_prompt_len)
    choices = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(args.seed)
    lengths = [rng.choice(choices) for _ in prompts]
    longest = hf_greedy(base, prompts, max(lengths))  # a shorter request's reference is a prefix of it
    refs = [longest[tuple(p)][:n] for p, n in zip(prompts, lengths)]
    t0 = time.perf_counter()
    model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, backend=args.backend,
                             max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, prefix_caching=False)
    log(f"compiled ({args.backend}) in {time.perf_counter() - t0:.0f} s")
    for admission in ("waves", "continuous"):  # untimed: the compiled cycle's first calls (batch of 1, of many)
        warm = run_engine(model, tok, prompts[:args.max_batch_size + 2], lengths[:args.max_batch_size + 2], admission,
                          setting)
        log(f"warm-up run ({admission}): {warm['tok_s']:.1f} tok/s ({warm['wall_s']:.1f} s)")
    runs = []
    for rep in range(args.repeats):
        for admission in ("waves", "continuous"):
            r = run_engine(model, tok, prompts, lengths, admission, setting)
            r["exact"] = sum(1 for o, want in zip(r["outputs"], refs) if o == want)
            r["repeat"] = rep
            runs.append(r)
            log(f"{admission} #{rep + 1}: {r['tok_s']:.1f} tok/s ({r['output_tokens']} tokens in {r['wall_s']:.1f} s, "
                f"{r['steps']} steps, mean running {r['mean_running']:.1f}, acceptance {r['acceptance'] or 1:.2f}, cycles by k "
                f"{r['cycles_by_k']}), greedy-exact {r['exact']}/{len(refs)}, KV blocks used after {r['kv_blocks_used_after']}")
    med = {a: statistics.median(r["tok_s"] for r in runs if r["admission"] == a) for a in ("waves", "continuous")}
    summary = {"args": vars(args), "lengths": lengths, "runs": [{k: v for k, v in r.items() if k != "outputs"}
                                                               for r in runs],
               "median_tok_s": med, "ratio_continuous_over_waves": med["continuous"] / med["waves"]}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    log(f"wrote {args.out}")
    print(f"{'admission':<11} {'run':>3} {'tok/s':>8} {'wall s':>7} {'steps':>6} {'mean run':>8} {'accept':>6} {'exact':>7}")
    for r in runs:
        print(f"{r['admission']:<11} {r['repeat'] + 1:>3} {r['tok_s']:>8.1f} {r['wall_s']:>7.1f} {r['steps']:>6} "
              f"{r['mean_running']:>8.1f} {r['acceptance'] or 1:>6.2f} {r['exact']:>3}/{len(refs)}")
    print(f"median tok/s: waves {med['waves']:.1f}, continuous {med['continuous']:.1f}; continuous / waves "
          f"{summary['ratio_continuous_over_waves']:.2f}x ({args.backend}, {args.speculation} k={args.num_spec_tokens}, "
          f"max batch {args.max_batch_size}, {args.num_requests} requests, lengths {choices})")
    exact = all(r["exact"] == len(refs) for r in runs)
    print(f"greedy-exact in every run: {exact}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
