"""--throughput-batch-sizes 1,4,16: tokens/s at each batch size, the same prompts and the same
output lengths for every method (eos off: every prompt gets exactly --output-len tokens).

Per batch size B, consecutive batches of B prompts go to: HF generate over the left-padded batch
(greedy), the same with a static cache + torch.compile of the decode step, CTranslate2 over the same
batches (fp32 and int8, in a child process; skipped with a note when not installed), eagle_fx without
speculation (num_spec_tokens=0, same graphs and backend) and eagle_fx with max_batch_size=B.
"== HF" counts prompts whose output equals HF greedy on that prompt alone (the B=1 HF row): a padded
HF batch computes other shapes than a lone prompt, so in fp32 it may differ by a rounding flip."""
from __future__ import annotations

from eagle_fx.bench.ctranslate2_peer import peer_rows
from eagle_fx.bench.hf_baselines import hf_greedy, hf_static_compiled
from eagle_fx.bench.timing import timed


def run(args, model_dir, base, draft, tokenizer, prompts, backend: str) -> dict:
    import eagle_fx

    batch_sizes = sorted(set(args.throughput_batch_sizes))  # 1 first, when asked: its HF row is the reference
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_len = max(len(p) for p in prompts) + args.output_len
    model = eagle_fx.compile(base, draft, num_spec_tokens=args.num_spec_tokens, backend=backend,
                             max_batch_size=max(batch_sizes), max_seq_len=max_len)
    methods = {
        "HF generate (greedy, padded batch)": lambda b: hf_greedy(base, None, pad, args.output_len),
        "HF static cache + torch.compile": lambda b: hf_static_compiled(base, None, pad, args.output_len, max_len),
        "CTranslate2": None,  # fp32 and int8 rows, each in a process of its own
        f"eagle_fx without speculation (k=0, {backend})": lambda b: eagle_fx_batches(model, b, 0, args.output_len),
        f"eagle_fx ({args.method}, k={args.num_spec_tokens}, {backend})":
            lambda b: eagle_fx_batches(model, b, args.num_spec_tokens, args.output_len),
    }
    reference = None  # HF greedy on each prompt alone (eos off)
    if 1 not in batch_sizes:
        reference, _ = timed(hf_greedy(base, None, pad, args.output_len), prompts, "HF greedy, prompts alone")
    table = []
    print("-" * 86)
    print(f"{'method':<44}{'batch':>6}{'tokens':>8}{'tok/s':>10}{'vs HF':>9}{'== HF':>9}")
    for batch_size in batch_sizes:
        hf_tps = None
        for method, make in methods.items():
            if make is None:  # CTranslate2: warmed up and timed in its own process
                for peer, outputs, seconds in peer_rows(model_dir, prompts, args.output_len, None, batch_size):
                    table.append(row(peer, batch_size, outputs, seconds, hf_tps, reference))
                continue
            generate_batch = make(batch_size)
            generate_batch(prompts[:batch_size])  # warm-up (compiles for this batch size)
            outputs, seconds = timed(generate_batch, prompts, f"{method} B={batch_size}", batch_size)
            if reference is None and batch_size == 1:
                reference = outputs  # the B=1 HF row: each prompt alone
            hf_tps = hf_tps or sum(map(len, outputs)) / seconds
            table.append(row(method, batch_size, outputs, seconds, hf_tps, reference))
    return {"num_prompts": len(prompts), "throughput": table}


def row(method: str, batch_size: int, outputs, seconds: float, hf_tps: float, reference) -> dict:
    """One printed and returned row of the table."""
    tokens = sum(map(len, outputs))
    tps = tokens / seconds
    same = sum(a == b for a, b in zip(outputs, reference))
    print(f"{method:<44}{batch_size:>6}{tokens:>8}{tps:>10.1f}{tps / hf_tps:>8.2f}x{f'{same}/{len(reference)}':>9}")
    return {"method": method, "batch_size": batch_size, "output_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tps, "speedup_vs_hf_greedy": tps / hf_tps, "prompts_equal_hf": same}


def eagle_fx_batches(model, batch_size: int, num_spec_tokens: int, output_len: int):
    """batch -> outputs of `model` at this batch size and k (eos off)."""
    sized = model.replace(max_batch_size=batch_size, num_spec_tokens=num_spec_tokens)

    def generate_batch(batch):
        return sized.generate(batch, max_new_tokens=output_len, eos_token_id=None).sequences
    return generate_batch
