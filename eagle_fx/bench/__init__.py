"""`eagle-fx bench` (= `python examples/spec_decode.py`): vLLM's spec_decode example, for eagle_fx.

With no arguments it runs the bundled tiny pair (models/tiny-sharegpt) on held-out ShareGPT
prompts and prints vLLM's block of spec-decode figures. `--compare` adds, measured in the same
run and one prompt at a time: Hugging Face greedy `generate`, HF static cache + torch.compile,
HF assisted generation with the bundled assistant, and eagle_fx: tokens/s, speedup over HF
greedy, and whether each one's output equals HF greedy on every prompt. `--draft-tree` runs
EAGLE-2 dynamic trees instead of a chain; `--tree-vs-chain` measures a tree against chains at
equal verify width and at equal depth, side by side in one run. `--throughput-batch-sizes 1,4,16`
measures tokens/s at each batch size against HF's padded batches; `--long-context 2048,8192,32768`
peak memory and equality with HF at long prompts.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle_fx.bench.args import add_args, check_args, resolved_backend
from eagle_fx.bench.modes import (kv_share, long_context, main as main_mode, multiturn, random_mm, real_proportions,
                                  shift_table, throughput, tree_vs_chain)
from eagle_fx.bench.prompts import load_prompts
from eagle_fx.bundled import BUNDLED, check_pair_dirs, load_pair, pair_dirs

__all__ = ["BUNDLED", "add_args", "main", "run"]


def header(args, model_dir, eagle_dir, base, draft, backend: str) -> str:
    """What this run measures, in one block: pair, k, backend, dtype, batch, dataset, decoding, checks."""
    c = base.config.get_text_config()
    decoding = "greedy" if args.temp == 0 else f"sampling (temperature {args.temp}, top-p {args.top_p}, top-k {args.top_k})"
    dataset = (f"random, {args.input_len} tokens" if args.dataset_name == "random" else args.dataset_name) + \
        f", {args.num_prompts} prompts, up to {args.output_len} new tokens"
    if args.long_context:
        from eagle_fx.bench.modes.long_context import new_tokens

        dataset = (f"one random prompt of each of {','.join(map(str, args.long_context))} tokens, "
                   f"{new_tokens(args)} new tokens")
    checked = ("outputs checked against HF greedy" if args.compare or args.throughput_batch_sizes or args.long_context
               else "outputs not checked against HF here (add --compare)")
    chain = f"tree {args.draft_tree}" if args.draft_tree else f"k={args.num_spec_tokens}"
    return (f"eagle-fx bench: base {model_dir} ({c.model_type}, {c.num_hidden_layers} layers, "
            f"{str(next(base.parameters()).dtype).removeprefix('torch.')}), draft {eagle_dir} ({draft.method}); {chain}, "
            f"backend {backend}, batch {args.max_num_seqs}; {dataset}; {decoding}; {checked}")


def run(args) -> dict:
    """Check the flags, load the pair, run the mode they pick; returns (and with --json writes) the result."""
    check_args(args)
    torch.manual_seed(args.seed)
    backend = resolved_backend(args)
    if args.synthetic_acceptance is not None:  # its own random base: the pair's folders are not read
        return _finish(args, real_proportions.run(args, backend))
    model_dir, eagle_dir = pair_dirs(args.model_dir, args.eagle_dir, args.method)
    check_pair_dirs(model_dir, eagle_dir)
    tokenizer, base, draft = load_pair(model_dir, eagle_dir)
    if draft.method != args.method:
        raise SystemExit(f"eagle-fx bench: {eagle_dir} holds an {draft.method} draft but --method is {args.method}")
    print(header(args, model_dir, eagle_dir, base, draft, backend), flush=True)
    eos = tokenizer.eos_token_id
    if args.long_context:
        result = long_context.run(args, model_dir, eagle_dir, base.config.vocab_size, backend)
    elif args.dataset_name == "sharegpt-multiturn":
        result = multiturn.run(args, base, draft, tokenizer, backend)
    elif args.dataset_name == "random-mm":
        result = random_mm.run(args, base, eagle_dir, tokenizer, backend)
    else:
        prompts = load_prompts(args, tokenizer, base.config.vocab_size)
        if args.shift_table:
            result = shift_table.run(args, base, draft, prompts, eos, backend)
        elif args.kv_share is not None:
            result = kv_share.run(args, base, draft, prompts, eos, backend)
        elif args.tree_vs_chain:
            result = tree_vs_chain.run(args, base, draft, prompts, eos, backend)
        elif args.throughput_batch_sizes:
            result = throughput.run(args, model_dir, base, draft, tokenizer, prompts, backend)
        elif args.response_format is not None:
            from eagle_fx.bench.modes import structured  # (xgrammar: the optional 'structured' extra)

            result = structured.run(args, tokenizer, base, draft, prompts, backend)
        else:
            result = main_mode.run(args, model_dir, eagle_dir, tokenizer, base, draft, prompts, backend)
    return _finish(args, result)


def _finish(args, result: dict) -> dict:
    """The run's flags and figures (with --json written to that file)."""
    result = {"config": dict(vars(args)), **result}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.json}")
    return result


def main(argv=None) -> None:
    ap = add_args(argparse.ArgumentParser(prog="eagle-fx bench", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter))
    run(ap.parse_args(argv))
