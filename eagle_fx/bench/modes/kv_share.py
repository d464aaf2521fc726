"""--kv-share LAYER: the KV-sharing draft (reads base layer LAYER's K/V) vs the normal draft (its own
KV), in one run: draft prefill seconds and FLOPs per prompt length, draft KV bytes per prompt token,
mean acceptance length, tokens/s."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from eagle_fx.bench.timing import timed
from eagle_fx.bundled import BUNDLED


def draft_prefill_cost(model, prompt: list[int], reps: int) -> dict:
    """Draft prefill of one prompt: seconds (mean of `reps` profiled runs on empty pools, after a
    warm-up) and FLOPs (matmuls counted by FlopCounterMode around one draft prefill graph call,
    plus attention by formula: 4 * heads * head_dim per query-key pair; the attention op is opaque
    to the counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    model.generate([prompt], max_new_tokens=1, eos_token_id=None)  # warm-up
    seconds = 0.0
    for _ in range(reps):
        model.reset()
        out = model.generate([prompt], max_new_tokens=1, eos_token_id=None, profile=True)
        seconds += out.stats.time_draft_prefill_s
    n = len(prompt)
    with FlopCounterMode(display=False) as counter:
        model.executor.call("draft_prefill", **model.example_inputs("draft_prefill", [n]))
    model.reset()  # that call wrote the example's K/V into the pools
    matmul = counter.get_total_flops()
    # the last row's query against every row (kv_share=LAYER: the other rows are pruned), else causal
    pairs = n if model.kv_cache.kv_mode == "layer" else n * (n + 1) // 2
    attention = 4 * model.spec.draft_heads * model.spec.draft_head_dim * pairs
    return {"seconds": seconds / reps, "flops": matmul + attention, "matmul_flops": matmul, "attention_flops": attention}


def run(args, base, draft, prompts, eos, backend: str) -> dict:
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
    options = dict(num_spec_tokens=args.num_spec_tokens, backend=backend, max_batch_size=args.max_num_seqs, max_seq_len=max_len)
    own, shared = "own KV", f"shares layer {args.kv_share}"
    try:
        models = {own: eagle_fx.compile(base, draft, kv_share="pool", **options),
                  shared: eagle_fx.compile(base, sharing, kv_share=args.kv_share, **options)}
    except ValueError as e:
        raise SystemExit(f"eagle-fx bench: --kv-share {args.kv_share}: {e}") from None

    g = torch.Generator().manual_seed(args.seed)
    cost = {name: {} for name in models}
    for n in tqdm(lengths, desc="draft prefill cost", leave=False):
        prompt = torch.randint(3, base.config.vocab_size, (n,), generator=g).tolist()
        for name, model in models.items():
            cost[name][n] = draft_prefill_cost(model, prompt, reps=5)

    runs = {}  # name -> (stats, output sequences, seconds)
    for name, model in models.items():
        model.generate([prompts[0]], max_new_tokens=args.output_len, eos_token_id=eos)  # warm-up (compiles)
        stats = model.new_stats()

        def generate_batch(batch, model=model, stats=stats):
            model.reset()
            out = model.generate(batch, max_new_tokens=args.output_len, eos_token_id=eos)
            stats.merge(out.stats)
            return out.sequences

        sequences, seconds = timed(generate_batch, prompts, name, args.max_num_seqs)
        stats.wall_time_s = seconds
        runs[name] = (stats, sequences, seconds)
    same = sum(a == b for a, b in zip(runs[own][1], runs[shared][1]))

    print("-" * 86)
    print("KV sharing: draft prefill per prompt (FLOPs = matmuls counted + attention 4*H*D per query-key pair)")
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
        stats, _, seconds = runs[name]
        kv_bytes = model.kv_bytes()
        tps = stats.total_num_output_tokens / seconds
        print(f"{name:<16}{kv_bytes['draft_per_token']:>20}{stats.mean_acceptance_length:>14.2f}{tps:>10.1f}"
              f"{(f'{same}/{len(prompts)}' if name == shared else 'ref'):>10}")
        rows[name] = {**stats.as_dict(), "tokens_per_s": tps, "kv_bytes": kv_bytes}
    print("(outputs: prompts whose output equals the own-KV run; both decode the base's greedy tokens)")
    return {"kv_share": {"prefill_cost": table, "runs": rows, "outputs_equal": same, "sharing_draft": str(share_dir)}}
