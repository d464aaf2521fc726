"""--dataset-name sharegpt-multiturn: turn 2 = turn 1 + the model's own answer + the next question,
prefix caching on, shifted and unshifted draft prefill side by side (prefix hits, prefill tokens computed)."""
from __future__ import annotations

import time

from tqdm.auto import tqdm

from eagle_fx.bench.prompts import multiturn_prompts


def run(args, base, draft, tokenizer, backend: str) -> dict:
    import eagle_fx

    eos = tokenizer.eos_token_id
    pairs = multiturn_prompts(args, tokenizer)
    if not pairs:
        raise SystemExit("eagle-fx bench: no held-out multi-turn conversations fit --max-prompt-len")
    max_len = max(len(first) + len(second) for first, second in pairs) + 2 * args.output_len + 1
    turn2 = {}
    for shift in (True, False):
        scheme = "shifted" if shift else "unshifted"
        model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, prefill_shift=shift,
                                 backend=backend, max_batch_size=1, max_seq_len=max_len, prefix_caching=True,
                                 block_size=16, prefill_chunk_size=args.prefill_chunk_size)
        stats = model.new_stats()
        t0 = time.perf_counter()
        for first, second in tqdm(pairs, desc=f"multi-turn {scheme}", leave=False):
            answer = model.generate([first], max_new_tokens=args.output_len, eos_token_id=eos).sequences[0]
            stats.merge(model.generate([first + answer + second], max_new_tokens=args.output_len, eos_token_id=eos).stats)
        stats.wall_time_s = time.perf_counter() - t0
        turn2[scheme] = stats
    print("-" * 86)
    print(f"multi-turn, turn 2 with prefix caching ({len(pairs)} conversations, block 16)")
    print(f"{'scheme':<12}{'hit base':>10}{'hit draft':>11}{'computed base':>15}{'computed draft':>16}{'mean acc len':>14}")
    for scheme, st in turn2.items():
        print(f"{scheme:<12}{st.prefix_hit_tokens_base:>10}{st.prefix_hit_tokens_draft:>11}{st.prefill_tokens_computed_base:>15}"
              f"{st.prefill_tokens_computed_draft:>16}{st.mean_acceptance_length:>14.2f}")
    return {"multiturn": {scheme: st.as_dict() for scheme, st in turn2.items()}}
