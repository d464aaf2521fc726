"""--shift-table: shifted vs unshifted draft prefill at k=3 and k=7 (the vLLM unshift PR's table)."""
from __future__ import annotations

import time

from tqdm.auto import tqdm


def run(args, base, draft, prompts, eos, backend: str) -> dict:
    import eagle_fx

    max_len = max(len(p) for p in prompts) + args.output_len
    rows = []
    for k in (3, 7):
        for shift in (True, False):
            scheme = "shifted" if shift else "unshifted"
            model = eagle_fx.compile(base, draft, num_spec_tokens=k, prefill_shift=shift, backend=backend,
                                     max_batch_size=args.max_num_seqs, max_seq_len=max_len)
            stats = model.new_stats()
            t0 = time.perf_counter()
            for i in tqdm(range(0, len(prompts), args.max_num_seqs), desc=f"k={k} {scheme}", leave=False):
                batch = prompts[i:i + args.max_num_seqs]
                stats.merge(model.generate(batch, max_new_tokens=args.output_len, eos_token_id=eos).stats)
            stats.wall_time_s = time.perf_counter() - t0
            rows.append({"k": k, "scheme": scheme, **stats.as_dict()})
    print("-" * 86)
    print(f"{'k':>3} {'scheme':<10}{'drafts':>8}{'draft tok':>10}{'accepted':>10}{'mean acc len':>14}  acceptance at token 0..")
    for r in rows:
        acceptance = " ".join(f"{a:.2f}" for a in r["acceptance_at"])
        print(f"{r['k']:>3} {r['scheme']:<10}{r['num_drafts']:>8}{r['num_draft_tokens']:>10}{r['num_accepted_tokens']:>10}"
              f"{r['mean_acceptance_length']:>14.2f}  {acceptance}")
    for k in (3, 7):
        shifted, unshifted = (next(r for r in rows if r["k"] == k and r["scheme"] == s) for s in ("shifted", "unshifted"))
        gain = (unshifted["mean_acceptance_length"] - shifted["mean_acceptance_length"]) / shifted["mean_acceptance_length"] * 100
        print(f"k={k}: unshifted mean acceptance length {gain:+.2f}% vs shifted")
    return {"shift_table": rows}
