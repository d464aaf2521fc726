"""A pair's step costs and the speedup they allow, measured on held-out ShareGPT prompts.

    python bench/step_costs.py --model-dir models/tiny-sharegpt-deep/base --eagle-dir models/tiny-sharegpt-deep/eagle

Runs one profiled generate graph by graph (so each step graph is timed on its own: the draft
step, the verify, the draft extend) and one plain generate with the one-function cycle, and
prints: mean seconds per draft step and per verify, their ratio r, the mean acceptance length
tau, and the ceiling of a chain of k drafts over a plain decoder that costs one verify-sized call
per token, tau / (1 + (k-1) r + e) with e the extend's share of a verify. Also tokens/s of the
one-function cycle.

Then speedup / tau against eagle_fx's own plain decode (num_spec_tokens=0, the issue's "vs own
k=0") in graph time: two profiled generates time the one-function cycle per call, with k=0 (one
token: a 1-row verify) and with k; their ratio, decode / cycle, is what speedup / tau approaches
when host and prefill time are nil (it moves with the prompts' lengths). A verify of k+1 rows
costs more than a 1-row decode where the matmuls are not purely bound by reading the weights
(this CPU: see verify_over_decode). Batch 1, greedy; every run on the same prompts, in one process.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def mean_latency(stats, graph: str) -> float:
    calls = stats.graph_calls.get(graph, 0)
    return stats.graph_time_s.get(graph, 0.0) / calls if calls else 0.0


def timed_cycle(model, prompts, output_len: int) -> float:
    """Mean seconds per one-function cycle call of `model` (already run on `prompts`, so a lazily
    compiled cycle has compiled for their shapes) over a profiled generate of `prompts`."""
    return mean_latency(model.generate(prompts, max_new_tokens=output_len, profile=True).stats, "chain_cycle")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="HF base model folder")
    ap.add_argument("--eagle-dir", required=True, help="EAGLE draft folder")
    ap.add_argument("--backend", choices=["eager", "inductor"], default="eager")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import eagle_fx
    from eagle_fx.bench.prompts import load_prompts
    from eagle_fx.runtime import ChainProposer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    draft = eagle_fx.load_draft(args.eagle_dir, base)
    k = args.num_spec_tokens
    started = time.perf_counter()
    model = eagle_fx.compile(base, draft, num_spec_tokens=k, max_batch_size=1, backend=args.backend)
    setup_s = time.perf_counter() - started
    prompts = load_prompts(argparse.Namespace(dataset_name="sharegpt", dataset_path=None, num_prompts=args.num_prompts,
                                              max_prompt_len=512, seed=0), tokenizer, model.vocab_size)
    stepwise = model.replace(proposer=ChainProposer(override=lambda contexts, j, tokens: tokens))
    stepwise.generate(prompts[:1], max_new_tokens=8)  # a lazily compiled graph compiles here, not in the timing
    timed = stepwise.generate(prompts, max_new_tokens=args.output_len, profile=True).stats
    draft_step, verify, extend = (mean_latency(timed, g) for g in ("draft_step", "verify", "draft_extend"))
    ratio, extend_share = draft_step / verify, extend / verify
    tau = timed.mean_acceptance_length
    model.generate(prompts[:1], max_new_tokens=8)
    started = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=args.output_len)
    seconds = time.perf_counter() - started
    cycle = timed_cycle(model, prompts, args.output_len)  # warm: the run above
    plain = model.replace(num_spec_tokens=0)
    plain.generate(prompts, max_new_tokens=args.output_len)  # its cycle compiles here, for every shape
    decode = timed_cycle(plain, prompts, args.output_len)
    result = {"model_dir": args.model_dir, "backend": args.backend, "num_prompts": len(prompts), "k": k,
              "decode_ms": 1000 * decode, "cycle_ms": 1000 * cycle, "verify_over_decode": verify / decode,
              "speedup_over_tau_graph_time": decode / cycle,
              "setup_s": round(setup_s, 1), "draft_step_ms": 1000 * draft_step, "verify_ms": 1000 * verify,
              "extend_ms": 1000 * extend, "draft_step_over_verify": ratio, "mean_acceptance_length": tau,
              "ceiling_vs_plain_decoder": tau / (1 + (k - 1) * ratio + extend_share),
              "tokens_per_s": out.stats.total_num_output_tokens / seconds}
    print(f"draft step {1000 * draft_step:.2f} ms, verify {1000 * verify:.2f} ms (draft/verify {ratio:.3f}), "
          f"extend {1000 * extend:.2f} ms; mean acceptance length {tau:.2f}; ceiling over a plain decoder "
          f"{result['ceiling_vs_plain_decoder']:.2f}x; one-function cycle {result['tokens_per_s']:.1f} tokens/s "
          f"({args.backend}, setup {setup_s:.1f}s)")
    print(f"plain decode (k=0 cycle) {1000 * decode:.2f} ms per token; k={k} cycle {1000 * cycle:.2f} ms; "
          f"a {k + 1}-row verify costs {verify / decode:.2f}x a 1-row decode; speedup / tau vs own k=0 in graph time (no host, no "
          f"prefill): {decode / cycle:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
