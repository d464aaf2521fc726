"""--compare: HF greedy, HF static cache + torch.compile, HF assisted generation, CTranslate2 (fp32,
exact; int8, lossy; each in a process of its own), eagle_fx without speculation (num_spec_tokens=0:
the same graphs and backend, the base alone) and eagle_fx on the same prompts: tokens/s, speedup
over HF greedy, and outputs equal to HF greedy. The baselines run one prompt at a time, both
eagle_fx rows at --max-num-seqs. "Fastest baseline" is the fastest exact one: HF's rows and
CTranslate2 fp32 (int8 is shown, not counted: its outputs are not the base's greedy).

Speedup / tau: eagle_fx's speedup over its own plain decode divided by the mean acceptance length
tau (tokens per verify); 1 would be speculation at no cost beyond the verify of one token (vLLM
reports about 0.66 on GPUs)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from eagle_fx.bench.ctranslate2_peer import peer_rows
from eagle_fx.bench.hf_baselines import hf_assisted, hf_greedy, hf_static_compiled
from eagle_fx.bench.timing import timed
from eagle_fx.bundled import BUNDLED


def plain_decode(args, model, prompts, eos):
    """eagle_fx with num_spec_tokens=0 over the prompts (warmed up first): (outputs, seconds)."""
    plain = model.replace(num_spec_tokens=0)
    plain.generate([prompts[0]], max_new_tokens=min(8, args.output_len), eos_token_id=eos)  # warm-up (compiles)
    plain.reset()

    def generate_batch(batch):
        return plain.generate(batch, max_new_tokens=args.output_len, eos_token_id=eos).sequences

    return timed(generate_batch, prompts, "eagle_fx k=0", args.max_num_seqs)


def run(args, model_dir, base, tokenizer, prompts, eagle_sequences, eagle_seconds: float, model, tau: float,
        backend: str) -> list[dict]:
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    n_tokens = lambda seqs: sum(map(len, seqs))  # noqa: E731
    rows = []  # (method, output tokens, seconds, outputs, setup seconds)
    # eagle_fx's own plain decode first, next to the eagle_fx run: timed after HF's rows (their
    # torch.compile in this process among them) it once ran at about half its speed (bundled pair)
    plain_row = None
    if model.chain_cycle is not None:  # chains (greedy: check_args refuses --compare with --temp)
        outputs, seconds = plain_decode(args, model, prompts, eos)
        plain_row = (f"eagle_fx without speculation (k=0, {backend})", n_tokens(outputs), seconds, outputs, 0.0)

    greedy = hf_greedy(base, eos, pad, args.output_len)
    greedy([prompts[0]])  # warm-up
    reference, seconds = timed(greedy, prompts, "HF greedy")
    rows.append(("HF generate (greedy)", n_tokens(reference), seconds, reference, 0.0))

    static = hf_static_compiled(base, eos, pad, args.output_len, max(len(p) for p in prompts) + args.output_len)
    t0 = time.perf_counter()
    static([prompts[0]])  # warm-up: compiles
    static_setup_s = time.perf_counter() - t0
    outputs, seconds = timed(static, prompts, "HF static+compile")
    rows.append(("HF static cache + torch.compile", n_tokens(outputs), seconds, outputs, static_setup_s))

    assistant_dir = Path(args.assistant_dir) if args.assistant_dir else BUNDLED / "assistant"
    if assistant_dir.exists():
        assisted = hf_assisted(base, eos, pad, args.output_len, assistant_dir)
        assisted([prompts[0]])  # warm-up
        outputs, seconds = timed(assisted, prompts, "HF assisted")
        rows.append((f"HF assisted ({assistant_dir.name})", n_tokens(outputs), seconds, outputs, 0.0))
    else:
        print(f"note: no assistant model at {assistant_dir}; HF assisted generation skipped", file=sys.stderr)
    for method, outputs, seconds in peer_rows(model_dir, prompts, args.output_len, eos):
        rows.append((method, n_tokens(outputs), seconds, outputs, 0.0))
    tree = args.draft_tree
    drafting = f"k={args.num_spec_tokens}" if tree is None else f"tree {tree['top_k']},{tree['depth']},{tree['total_tokens']}"
    baseline_rows = [row for row in rows if not row[0].endswith("(lossy)")]
    if plain_row is not None:
        rows.append(plain_row)
    rows.append((f"eagle_fx ({args.method}, {drafting}, {backend})",
                 n_tokens(eagle_sequences), eagle_seconds, eagle_sequences, 0.0))

    greedy_tps = rows[0][1] / rows[0][2]
    fastest_name, fastest_tps = max(((name, ntok / secs) for name, ntok, secs, _, _ in baseline_rows),
                                    key=lambda row: row[1])
    table = []
    print("-" * 86)
    print(f"{'method':<44}{'tokens':>8}{'tok/s':>10}{'vs HF':>9}{'== HF greedy':>15}")
    for method, ntok, secs, outputs, setup_s in rows:
        tps = ntok / secs
        same = sum(a == b for a, b in zip(outputs, reference))
        print(f"{method:<44}{ntok:>8}{tps:>10.1f}{tps / greedy_tps:>8.2f}x{f'{same}/{len(reference)}':>15}")
        table.append({"method": method, "output_tokens": ntok, "seconds": secs, "tokens_per_s": tps,
                      "speedup_vs_hf_greedy": tps / greedy_tps, "equal_to_hf_greedy": same == len(reference),
                      "prompts_equal": same, "setup_s": setup_s})
    eagle_tps = rows[-1][1] / rows[-1][2]
    print(f"eagle_fx vs fastest baseline ({fastest_name}): {eagle_tps / fastest_tps:.2f}x")
    table.append({"eagle_fx_vs_fastest_baseline": eagle_tps / fastest_tps, "fastest_baseline": fastest_name})
    peer = next((row for row in rows if row[0] == "CTranslate2 fp32"), None)
    if peer is not None:
        peer_tps = peer[1] / peer[2]
        ratios = {"k=0": plain_row[1] / plain_row[2] / peer_tps if plain_row else None, "eagle_fx": eagle_tps / peer_tps}
        print("vs CTranslate2 fp32: " + ", ".join(f"{name} {r:.2f}x" for name, r in ratios.items() if r is not None))
        table.append({"vs_ctranslate2_fp32": ratios})
    if plain_row is not None:
        over_plain = eagle_tps / (plain_row[1] / plain_row[2])
        line = f"eagle_fx vs its own plain decode (k=0, same backend): {over_plain:.2f}x"
        print(f"{line}; speedup / tau = {over_plain:.2f} / {tau:.2f} = {over_plain / tau:.2f}")
        table.append({"eagle_fx_vs_own_plain_decode": over_plain, "speedup_over_tau": over_plain / tau})
    return table
