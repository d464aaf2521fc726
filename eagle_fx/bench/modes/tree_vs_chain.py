"""--draft-tree ... --tree-vs-chain: one tree model and chains over the same graphs (k = TOTAL: the
same verify width; k = DEPTH: the same longest path), each batch run by all of them in turn."""
from __future__ import annotations

import time

from eagle_fx.bench.timing import interleaved


def run(args, base, draft, prompts, eos, backend: str) -> dict:
    import eagle_fx

    tree = args.draft_tree
    max_len = max(len(p) for p in prompts) + args.output_len
    t0 = time.perf_counter()
    tree_model = eagle_fx.compile(base, draft, prefill_shift=args.prefill_shift, backend=backend,
                                  max_batch_size=args.max_num_seqs, max_seq_len=max_len, draft_tree=tree)
    setup_s = time.perf_counter() - t0
    width, depth, score_temp = tree["total_tokens"], tree["depth"], tree.get("score_temperature", 1.0)
    tree_name = f"tree {tree['top_k']},{depth},{width}"
    drafts = [(f"chain k={width} (verify width {width + 1})", tree_model.replace(draft_tree=None, num_spec_tokens=width))]
    if depth != width:
        drafts.append((f"chain k={depth} (depth {depth})", tree_model.replace(draft_tree=None, num_spec_tokens=depth)))
    if score_temp != 1.0:  # EAGLE-2's own scores too
        drafts.append((f"{tree_name} score temp 1 (verify width {width + 1})",
                       tree_model.replace(draft_tree=tree | {"score_temperature": 1.0})))
    drafts.append((f"{tree_name} score temp {score_temp:g} (verify width {width + 1})", tree_model))
    sampling = dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    for _, model in drafts:
        model.generate([prompts[0]], max_new_tokens=min(8, args.output_len), eos_token_id=eos, **sampling)  # warm-up
        model.reset()
    models = [model for _, model in drafts]
    stats, outputs = interleaved(models, prompts, args.max_num_seqs, "tree vs chain",
                                 max_new_tokens=args.output_len, eos_token_id=eos, **sampling)
    rows = []
    chain_tps = stats[0].total_num_output_tokens / stats[0].wall_time_s
    print("-" * 100)
    print(f"{'draft':<52}{'mean acc len':>13}{'tok/s':>9}{'vs chain k=' + str(width):>16}{'== chain':>10}")
    for (name, _), st, seqs in zip(drafts, stats, outputs):
        tps = st.total_num_output_tokens / st.wall_time_s
        same = sum(a == b for a, b in zip(seqs, outputs[0]))
        equal = f"{same}/{len(seqs)}" if args.temp == 0 else "-"  # sampled outputs differ by design
        print(f"{name:<52}{st.mean_acceptance_length:>13.2f}{tps:>9.1f}{tps / chain_tps:>15.2f}x{equal:>10}")
        rows.append({"draft": name, **st.as_dict(), "tokens_per_s": tps, "speedup_vs_chain_equal_width": tps / chain_tps,
                     "outputs_equal_to_chain": same, "setup_s": setup_s})
    gain = rows[-1]["mean_acceptance_length"] - rows[0]["mean_acceptance_length"]
    print(f"tree - chain at equal verify width: mean acceptance length {gain:+.2f}")
    return {"tree_vs_chain": rows}
