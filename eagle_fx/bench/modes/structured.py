"""`eagle-fx bench --response-format FILE`: structured output under speculation, side by side with
free text on the same model and prompts.

Each batch of prompts is generated twice in turn, with the grammar and without it (so machine load
falls on both alike); the figures are tokens/s and mean acceptance length of each, their ratio,
how many outputs parse (JSON grammars) and the host's seconds in the grammar matchers per cycle
(xgrammar filling each draft's and verify row's mask). FILE holds a JSON schema, or an OpenAI
response_format object ({"type": "json_schema", ...} / {"type": "json_object"}).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm


def load_response_format(path: str):
    """The response_format of FILE (checked: an error names the file)."""
    from eagle_fx.structured.response_format import grammar_spec

    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"eagle-fx bench: --response-format {path}: {e}") from None
    try:
        return grammar_spec(value)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"eagle-fx bench: --response-format {path}: {e}") from None


def run(args, tokenizer, base, draft, prompts, backend: str) -> dict:
    import eagle_fx
    from eagle_fx.structured.grammar import GrammarError

    spec = load_response_format(args.response_format)
    eos = tokenizer.eos_token_id
    max_len = max(len(p) for p in prompts) + args.output_len
    t0 = time.perf_counter()
    model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, backend=backend,
                             max_batch_size=args.max_num_seqs, max_seq_len=max_len)
    runs = {"free text": {}, "grammar": dict(response_format=spec, tokenizer=tokenizer)}
    try:  # warm-up: compiles the cycles of one sequence and of several; a bad grammar is an error here
        for kwargs in runs.values():
            for warm in ([prompts[0]], prompts[:min(2, args.max_num_seqs)]):
                model.generate(warm, max_new_tokens=min(8, args.output_len), eos_token_id=eos, **kwargs)
    except GrammarError as e:
        raise SystemExit(f"eagle-fx bench: --response-format {args.response_format}: {e}") from None
    model.reset()
    setup_s = time.perf_counter() - t0
    stats = {name: model.new_stats() for name in runs}
    outputs = {name: [] for name in runs}
    batch = args.max_num_seqs
    for i in tqdm(range(0, len(prompts), batch), desc="free text / grammar", unit="batch", leave=False):
        for name, kwargs in runs.items():
            started = time.perf_counter()
            out = model.generate(prompts[i:i + batch], max_new_tokens=args.output_len, eos_token_id=eos, **kwargs)
            stats[name].wall_time_s += time.perf_counter() - started
            stats[name].merge(out.stats)
            outputs[name] += out.sequences
            model.reset()
    result = {"response_format": args.response_format, "kind": spec.kind, "setup_s": setup_s}
    for name, st in stats.items():
        result[name] = {**st.as_dict(), "tokens_per_s": st.total_num_output_tokens / st.wall_time_s}
    g = stats["grammar"]
    result.update(tokens_per_s_ratio=result["grammar"]["tokens_per_s"] / result["free text"]["tokens_per_s"],
                  mask_host_us_per_cycle=1e6 * g.grammar_mask_s / max(g.grammar_cycles, 1),
                  mask_host_share=g.grammar_mask_s / g.wall_time_s)
    if spec.kind in ("json_schema", "json_object"):
        complete = [o[:-1] for o in outputs["grammar"] if o and o[-1] == eos]
        result["complete_outputs"] = len(complete)
        result["complete_outputs_that_parse"] = sum(_parses(tokenizer.decode(o)) for o in complete)
    _print(result, len(prompts), args)
    return result


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _print(result: dict, num_prompts: int, args) -> None:
    print(f"{'':12} {'tokens/s':>10} {'mean acceptance length':>24}")
    for name in ("free text", "grammar"):
        print(f"{name:12} {result[name]['tokens_per_s']:>10.1f} {result[name]['mean_acceptance_length']:>24.2f}")
    print(f"grammar ({result['kind']}): {result['tokens_per_s_ratio']:.2f}x free text's tokens/s; the matchers' host "
          f"time {result['mask_host_us_per_cycle']:.0f} µs per cycle ({result['mask_host_share']:.1%} of the grammar "
          f"run)")
    if "complete_outputs" in result:
        print(f"{result['complete_outputs']} of {num_prompts} outputs complete within {args.output_len} tokens, "
              f"{result['complete_outputs_that_parse']} of them parse as JSON")
