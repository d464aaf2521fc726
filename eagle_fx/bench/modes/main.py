"""The main bench: one eagle_fx model over the prompts, vLLM's block of spec-decode figures, where
the time goes, and (--compare) the HF baselines side by side.

The timed run is not profiled (profile=True times every graph call, synchronising with the
device on a GPU): the profile comes from a separate run over the first batch of prompts."""
from __future__ import annotations

import time

from eagle_fx.bench.modes import compare
from eagle_fx.bench.timing import timed


def print_block(stats) -> None:
    """vLLM's spec_decode example block."""
    print("-" * 50)
    print(f"total_num_output_tokens: {stats.total_num_output_tokens}")
    print(f"num_drafts: {stats.num_drafts}")
    print(f"num_draft_tokens: {stats.num_draft_tokens}")
    print(f"num_accepted_tokens: {stats.num_accepted_tokens}")
    print(f"mean acceptance length: {stats.mean_acceptance_length:.2f}")
    print("-" * 50)
    for i, a in enumerate(stats.acceptance_at):
        print(f"acceptance at token {i}: {a:.2f}")


def profile_run(model, prompts, output_len: int, eos, sampling: dict):
    """The stats of one generate with profile=True (each graph call timed) on fresh pools."""
    model.reset()
    stats = model.generate(prompts, max_new_tokens=output_len, eos_token_id=eos, profile=True, **sampling).stats
    model.reset()
    return stats


def run(args, model_dir, eagle_dir, tokenizer, base, draft, prompts, backend: str) -> dict:
    import eagle_fx

    eos = tokenizer.eos_token_id
    max_len = max(len(p) for p in prompts) + args.output_len
    t0 = time.perf_counter()
    model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, prefill_shift=args.prefill_shift,
                             backend=backend, max_batch_size=args.max_num_seqs, max_seq_len=max_len,
                             prefix_caching=args.prefix_caching, prefill_chunk_size=args.prefill_chunk_size,
                             draft_tree=args.draft_tree)
    sampling = dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    model.generate([prompts[0]], max_new_tokens=min(8, args.output_len), eos_token_id=eos)  # warm-up (compiles)
    model.reset()  # empty pools and prefix cache: the warm-up must not give the timed run free hits
    setup_s = time.perf_counter() - t0
    stats = model.new_stats()

    def generate_batch(batch):
        out = model.generate(batch, max_new_tokens=args.output_len, eos_token_id=eos, **sampling)
        stats.merge(out.stats)
        return out.sequences

    sequences, seconds = timed(generate_batch, prompts, "eagle_fx", args.max_num_seqs)
    stats.wall_time_s = seconds
    print_block(stats)
    tokens_per_s = stats.total_num_output_tokens / seconds
    profiled = profile_run(model, prompts[:args.max_num_seqs], args.output_len, eos, sampling)
    prof = profiled.profile()
    result = {"model_dir": str(model_dir), "eagle_dir": str(eagle_dir), "num_prompts": len(prompts),
              "mean_prompt_len": sum(map(len, prompts)) / len(prompts),
              "eagle_fx": {**stats.as_dict(), "tokens_per_s": tokens_per_s, "setup_s": setup_s, "backend": backend,
                           "profile_s": prof, "profiled_prompts": min(len(prompts), args.max_num_seqs)}}
    share = {part: s / max(profiled.wall_time_s, 1e-9) for part, s in prof.items()}
    print(f"eagle_fx: {tokens_per_s:.1f} tokens/s ({seconds:.1f}s; compile + warm-up {setup_s:.1f}s); where the time "
          f"goes (a separate profiled run of {result['eagle_fx']['profiled_prompts']} prompt(s)): prefill "
          f"{share['prefill']:.0%}, draft {share['draft']:.0%}, verify {share['verify']:.0%}, whole cycles (draft + "
          f"verify + acceptance as one function) {share['cycle']:.0%}, host {share['host']:.0%}")

    if backend == "eager":
        print("note: the default, --backend inductor, compiles each speculative cycle into one graph with frozen "
              "weights and decodes several times faster")
    if args.compare:
        result["compare"] = compare.run(args, model_dir, base, tokenizer, prompts, sequences, seconds, model,
                                        stats.mean_acceptance_length, backend)
    if args.plot:
        from eagle_fx.bench.plot import write

        rates = {row["method"]: row["tokens_per_s"] for row in result.get("compare", []) if "method" in row}
        rates = rates or {f"eagle_fx ({backend})": tokens_per_s}
        path = write(args.plot, stats.acceptance_at, rates,
                     f"{model_dir} + {eagle_dir}, k={args.num_spec_tokens}, {backend}, {len(prompts)} prompts")
        print(f"wrote {path}")
    if args.print_output:
        for prompt, output in zip(prompts, sequences):
            print("-" * 50)
            print(f"prompt: {tokenizer.decode(prompt)!r}")
            print(f"output: {tokenizer.decode(output)!r}")
    return result
