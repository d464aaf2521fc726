"""Where a decode step's time goes: per-token costs of eagle_fx's plain decode (k=0) and of each
part of a k-cycle, graph time against host time, the top ops by self time, next to CTranslate2's
time per token on the same base and prompts.

    python bench/step_costs.py --backend inductor                      # the bundled pair
    python bench/step_costs.py --model-dir models/tiny-sharegpt-deep/base --eagle-dir models/tiny-sharegpt-deep/eagle

Batch 1, greedy, the bench's held-out ShareGPT prompts, every eagle_fx run in this process on the
same prompts (CTranslate2 in a child process of its own, as the bench runs it). It prints:

- per new token, k=0 and k: wall time, time inside the one-function cycle (graph time), prefill,
  and the rest (host: the generate loop's Python and tensor bookkeeping between cycles);
- the parts of a k-cycle, each step graph timed on its own (the graph-by-graph runtime over the
  same backend's graphs, which keep their weights as inputs: with inductor they cost more than
  inside the frozen cycle): a draft step, the (k+1)-row verify, the draft extend, and the 1-row
  decode of the k=0 cycle;
- the top ops by self time (torch.profiler) of k=0 and of k, per cycle;
- the ceiling of a chain over an equally efficient plain decoder, tau / (1 + (k-1) r + e) with r the
  draft step's share of a verify and e the extend's, and decode / cycle in graph time, which speedup
  / tau approaches when host and prefill time are nil.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from eagle_fx.runtime.stats import CHAIN_CYCLE


def mean_latency(stats, graph: str) -> float:
    calls = stats.graph_calls.get(graph, 0)
    return stats.graph_time_s.get(graph, 0.0) / calls if calls else 0.0


def per_token(model, prompts, output_len: int, eos) -> dict:
    """Wall, cycle (graph), prefill and host milliseconds per new token of `model` (warm) over the
    prompts, one at a time; cycles per token; mean acceptance length."""
    wall = cycle = prefill = 0.0
    tokens = cycles = 0
    stats = model.new_stats()
    for prompt in prompts:
        started = time.perf_counter()
        out = model.generate([prompt], max_new_tokens=output_len, eos_token_id=eos, profile=True)
        wall += time.perf_counter() - started
        tokens += len(out.sequences[0])
        cycle += out.stats.graph_time_s.get(CHAIN_CYCLE, 0.0)
        cycles += out.stats.graph_calls.get(CHAIN_CYCLE, 0)
        prefill += out.stats.time_prefill_s
        stats.merge(out.stats)
    ms = lambda s: 1000 * s / tokens  # noqa: E731
    return {"tokens": tokens, "wall_ms": ms(wall), "cycle_ms": ms(cycle), "prefill_ms": ms(prefill),
            "host_ms": ms(wall - cycle - prefill), "cycles_per_token": cycles / tokens,
            "ms_per_cycle": 1000 * cycle / max(cycles, 1), "mean_acceptance_length": stats.mean_acceptance_length}


def top_ops(model, prompts, output_len: int, eos, count: int) -> list[dict]:
    """The ops with the most self CPU time over generates of the prompts, per cycle."""
    from torch.profiler import ProfilerActivity, profile

    cycles = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for prompt in prompts:
            out = model.generate([prompt], max_new_tokens=output_len, eos_token_id=eos)
            cycles += out.stats.num_drafts or (len(out.sequences[0]) - 1)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    return [{"op": e.key, "self_us_per_cycle": e.self_cpu_time_total / max(cycles, 1),
             "calls_per_cycle": e.count / max(cycles, 1)} for e in rows]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="HF base model folder (default: the bundled base)")
    ap.add_argument("--eagle-dir", default=None, help="EAGLE draft folder (default: the bundled EAGLE-1 draft)")
    ap.add_argument("--backend", choices=["eager", "inductor"], default="inductor")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--top", type=int, default=8, help="ops listed per profile")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    if args.num_prompts < 1 or args.output_len < 2 or args.num_spec_tokens < 1 or args.top < 1:
        raise SystemExit("step_costs: --num-prompts, --num-spec-tokens and --top must be >= 1, --output-len >= 2")

    import eagle_fx
    from eagle_fx.bench import ctranslate2_peer
    from eagle_fx.bench.prompts import load_prompts
    from eagle_fx.bundled import load_pair, pair_dirs

    model_dir, eagle_dir = pair_dirs(args.model_dir, args.eagle_dir, "eagle")
    tokenizer, base, draft = load_pair(model_dir, eagle_dir)
    eos = tokenizer.eos_token_id
    k = args.num_spec_tokens
    prompts = load_prompts(argparse.Namespace(dataset_name="sharegpt", dataset_path=None, num_prompts=args.num_prompts,
                                              max_prompt_len=512, seed=0), tokenizer, base.config.vocab_size)
    max_len = max(map(len, prompts)) + args.output_len
    started = time.perf_counter()
    model = eagle_fx.compile(base, draft, num_spec_tokens=k, max_batch_size=1, backend=args.backend, max_seq_len=max_len)
    plain = model.replace(num_spec_tokens=0)
    for m in (model, plain):  # compile (lazily compiled cycles) and warm up on every prompt's shapes
        for prompt in prompts:
            m.generate([prompt], max_new_tokens=args.output_len, eos_token_id=eos)
    setup_s = time.perf_counter() - started

    result = {"model_dir": str(model_dir), "backend": args.backend, "num_prompts": len(prompts), "k": k,
              "setup_s": round(setup_s, 1), "k0": per_token(plain, prompts, args.output_len, eos),
              f"k{k}": per_token(model, prompts, args.output_len, eos)}

    # the parts of a cycle, each graph on its own (profile="graphs": the cycle through the executor, same graphs)
    model.generate(prompts[:1], max_new_tokens=8, eos_token_id=eos, profile="graphs")
    timed = model.generate(prompts, max_new_tokens=args.output_len, eos_token_id=eos, profile="graphs").stats
    draft_step, verify, extend = (mean_latency(timed, g) for g in ("draft_step", "verify", "draft_extend"))
    decode = result["k0"]["ms_per_cycle"] / 1000
    tau = result[f"k{k}"]["mean_acceptance_length"]
    result["parts_ms"] = {"draft_step": 1000 * draft_step, f"verify_{k + 1}_rows": 1000 * verify,
                          "draft_extend": 1000 * extend, "decode_1_row (k=0 cycle)": 1000 * decode}
    result["verify_over_decode"] = verify / decode
    result["ceiling_vs_plain_decoder"] = tau / (1 + (k - 1) * draft_step / verify + extend / verify)
    result["speedup_over_tau_graph_time"] = decode / (result[f"k{k}"]["ms_per_cycle"] / 1000)
    result["top_ops"] = {"k0": top_ops(plain, prompts[:5], args.output_len, eos, args.top),
                         f"k{k}": top_ops(model, prompts[:5], args.output_len, eos, args.top)}

    missing = ctranslate2_peer.available()
    if missing is None:
        outputs, seconds = ctranslate2_peer.run_peer(model_dir, prompts, args.output_len, eos)
        result["ctranslate2_fp32_ms_per_token"] = 1000 * seconds / sum(map(len, outputs))
    else:
        print(f"note: {missing}", file=sys.stderr)

    report(result, k)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def report(result: dict, k: int) -> None:
    print(f"{result['model_dir']}, backend {result['backend']}, {result['num_prompts']} prompts, batch 1, greedy "
          f"(compile + warm-up {result['setup_s']} s)")
    print(f"{'per new token, ms':<22}{'wall':>8}{'cycle':>8}{'prefill':>9}{'host':>8}{'cycles/tok':>12}{'ms/cycle':>10}")
    for name in ("k0", f"k{k}"):
        r = result[name]
        print(f"{'eagle_fx ' + name.replace('k', 'k='):<22}{r['wall_ms']:>8.3f}{r['cycle_ms']:>8.3f}{r['prefill_ms']:>9.3f}"
              f"{r['host_ms']:>8.3f}{r['cycles_per_token']:>12.3f}{r['ms_per_cycle']:>10.3f}")
    if "ctranslate2_fp32_ms_per_token" in result:
        ct2 = result["ctranslate2_fp32_ms_per_token"]
        print(f"{'CTranslate2 fp32':<22}{ct2:>8.3f}   (eagle_fx k=0 / CTranslate2: "
              f"{result['k0']['wall_ms'] / ct2:.2f}x the time per token; k={k}: {result[f'k{k}']['wall_ms'] / ct2:.2f}x)")
    print("parts of a cycle, each graph timed alone (the graph-by-graph runtime: weights as inputs, not frozen as in "
          "the cycle, so they cost more): " + ", ".join(f"{n} {v:.3f} ms" for n, v in result["parts_ms"].items()))
    print(f"that {k + 1}-row verify costs {result['verify_over_decode']:.2f}x the 1-row decode of the cycle; mean acceptance length "
          f"{result[f'k{k}']['mean_acceptance_length']:.2f}; ceiling over an equally efficient plain decoder "
          f"{result['ceiling_vs_plain_decoder']:.2f}x; decode / cycle in graph time (what speedup / tau approaches "
          f"without host and prefill time): {result['speedup_over_tau_graph_time']:.2f}")
    for name, ops in result["top_ops"].items():
        print(f"top ops by self time, {name.replace('k', 'k=')}, per cycle:")
        for op in ops:
            print(f"  {op['self_us_per_cycle']:>9.1f} us  {op['calls_per_cycle']:>6.1f} calls  {op['op'][:70]}")


if __name__ == "__main__":
    main()
