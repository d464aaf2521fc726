"""--synthetic-acceptance P --base-config NAME: speed at a real model's proportions.

The bundled pairs are tiny (4M and 13M parameters), so their steps are dominated by per-op
overhead. This mode builds a randomly initialised base from a real model's configuration (its
layer sizes, with a 32k vocabulary so fp32 fits next to the other runs in memory) and a fresh EAGLE-1
draft shaped for it, and runs the draft and the verify for real; only the acceptance is decided by
a seeded coin of probability P per draft position instead of by matching (random weights would
accept nothing), so the mean acceptance length is tau = 1 + P + ... + P^k.

Rows, each prompt one at a time (random prompts of --input-len tokens, --output-len new tokens):
HF greedy, CTranslate2 fp32 (in a process of its own), eagle_fx k=0 (exact: checked against HF
greedy) and eagle_fx k with synthetic acceptance, whose output is NOT the base's greedy decode (so
it is not compared). Also the price of speculation per cycle: the k-cycle (draft steps, the
(k+1)-row verify, the extend) against the k=0 cycle (a 1-row decode), in graph time.
"""
from __future__ import annotations

import sys
import time

import torch

from eagle_fx.runtime.stats import CHAIN_CYCLE

# sizes of the real models (vocabulary cut to 32k: the real ones are 151,936 and 128,256)
BASE_CONFIGS = {
    "qwen2.5-0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                                         rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "llama-1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                                     rms_norm_eps=1e-5, tie_word_embeddings=True)),
}
VOCAB = 32000


def expected_tau(p: float, k: int) -> float:
    return sum(p ** i for i in range(k + 1))


def build_base(name: str, seed: int):
    """The random base (fp32, eval) for BASE_CONFIGS[name]."""
    import transformers

    class_name, sizes = BASE_CONFIGS[name]
    config = getattr(transformers, class_name)(vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=1,
                                               eos_token_id=2, pad_token_id=0, **sizes)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                         attn_implementation="sdpa").eval()


def save_for_peer(base, name: str, seed: int):
    """The base saved (with a word-level tokenizer of its vocabulary, which CTranslate2's converter
    reads) under the bench cache, for the CTranslate2 row; reused while it exists."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from eagle_fx.bench.ctranslate2_peer import cache_root

    folder = cache_root().parent / "synthetic-bases" / f"{name}-seed{seed}"
    if not (folder / "config.json").exists():
        vocab = {f"<t{i}>": i for i in range(VOCAB)}
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<t0>")),
                                            unk_token="<t0>", bos_token="<t1>", eos_token="<t2>", pad_token="<t0>")
        tokenizer.save_pretrained(folder)
        base.save_pretrained(folder)
    return folder


def cycle_ms(model, prompts, output_len: int) -> float:
    """Milliseconds of decode-graph time per cycle (profiled) over the prompts: the compiled cycle
    timed as one, or (a cycle run over the executor) its draft steps, verify and extend."""
    calls = seconds = 0
    for prompt in prompts:
        stats = model.generate([prompt], max_new_tokens=output_len, eos_token_id=None, profile=True).stats
        calls += stats.graph_calls.get(CHAIN_CYCLE, 0) or stats.graph_calls.get("verify", 0)
        seconds += stats.time_cycle_s + stats.time_draft_s + stats.time_verify_s
    return 1000 * seconds / max(calls, 1)


def run(args, backend: str) -> dict:
    import eagle_fx
    from eagle_fx.bench.ctranslate2_peer import peer_rows
    from eagle_fx.bench.hf_baselines import hf_greedy
    from eagle_fx.bench.timing import timed
    from eagle_fx.drafts import new_draft

    p, k = args.synthetic_acceptance, args.num_spec_tokens
    print(f"real proportions: a random {args.base_config} base ({VOCAB}-token vocabulary) and a fresh EAGLE-1 draft; "
          f"acceptance by a coin of P={p} per draft position (tau = {expected_tau(p, k):.2f} expected at k={k}): "
          "the speculative rows' output is NOT the base's greedy decode", flush=True)
    base = build_base(args.base_config, args.seed)
    n_params = sum(t.numel() for t in base.parameters())
    draft = new_draft(base, "eagle", seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, VOCAB, (args.input_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    max_len = args.input_len + args.output_len
    n_tokens = lambda seqs: sum(map(len, seqs))  # noqa: E731
    rows = []

    started = time.perf_counter()
    model = eagle_fx.compile(base, draft, num_spec_tokens=k, backend=backend, max_batch_size=1, max_seq_len=max_len)
    plain = model.replace(num_spec_tokens=0)
    model.chain_cycle.use_synthetic_acceptance(p, seed=args.seed)  # before the warm-up: its cycle is the one compiled
    for m in (plain, model):
        m.generate([prompts[0]], max_new_tokens=min(8, args.output_len), eos_token_id=None)  # compile, warm up
        m.reset()
    setup_s = time.perf_counter() - started

    def eagle_rows(m):
        return lambda batch: m.generate(batch, max_new_tokens=args.output_len, eos_token_id=None).sequences

    outputs, seconds = timed(eagle_rows(plain), prompts, "eagle_fx k=0")
    rows.append((f"eagle_fx without speculation (k=0, {backend})", outputs, seconds))
    stats = model.new_stats()

    def speculative(batch):
        out = model.generate(batch, max_new_tokens=args.output_len, eos_token_id=None)
        stats.merge(out.stats)
        return out.sequences

    outputs, seconds = timed(speculative, prompts, f"eagle_fx k={k}")
    rows.append((f"eagle_fx (k={k}, {backend}, synthetic acceptance P={p})", outputs, seconds))
    # the price of speculation per cycle: a k-cycle (k-1 draft steps, the (k+1)-row verify, the extend)
    # against a k=0 cycle (a 1-row verify), graph time; the verify alone costs less than the k-cycle
    cycle_k, cycle_0 = cycle_ms(model, prompts[:2], args.output_len), cycle_ms(plain, prompts[:2], args.output_len)

    greedy = hf_greedy(base, None, 0, args.output_len)
    greedy([prompts[0]])  # warm-up
    reference, seconds = timed(greedy, prompts, "HF greedy")
    rows.insert(0, ("HF generate (greedy)", reference, seconds))
    folder = save_for_peer(base, args.base_config, args.seed)
    rows[1:1] = peer_rows(folder, prompts, args.output_len, None, compute_types=("float32",))

    table = []
    peer_tps = next((n_tokens(o) / s for name, o, s in rows if name == "CTranslate2 fp32"), None)
    print("-" * 100)
    print(f"{'method':<58}{'tokens':>8}{'tok/s':>9}{'vs HF':>8}{'vs CT2':>8}{'== HF greedy':>14}")
    hf_tps = n_tokens(reference) / rows[0][2]
    for name, outputs, seconds in rows:
        tps = n_tokens(outputs) / seconds
        synthetic = "synthetic" in name
        same = "n/a" if synthetic else f"{sum(a == b for a, b in zip(outputs, reference))}/{len(prompts)}"
        vs_peer = f"{tps / peer_tps:.2f}x" if peer_tps else "-"
        print(f"{name:<58}{n_tokens(outputs):>8}{tps:>9.2f}{tps / hf_tps:>7.2f}x{vs_peer:>8}{same:>14}")
        table.append({"method": name, "tokens_per_s": tps, "speedup_vs_hf_greedy": tps / hf_tps,
                      "vs_ctranslate2_fp32": tps / peer_tps if peer_tps else None,
                      "prompts_equal_hf": None if synthetic else same})
    print(f"mean acceptance length {stats.mean_acceptance_length:.2f} (expected {expected_tau(p, k):.2f}); a k={k} cycle "
          f"({k - 1} draft steps + {k + 1}-row verify + extend) costs {cycle_k / cycle_0:.2f}x a k=0 cycle (1-row "
          f"decode): {cycle_k:.1f} vs {cycle_0:.1f} ms; base {n_params / 1e6:.0f}M parameters; compile + warm-up "
          f"{setup_s:.0f} s")
    if peer_tps is None:
        print("note: no CTranslate2 row (not installed)", file=sys.stderr)
    return {"real_proportions": {"base_config": args.base_config, "parameters": n_params, "vocab_size": VOCAB,
                                 "synthetic_acceptance": p, "mean_acceptance_length": stats.mean_acceptance_length,
                                 "expected_tau": expected_tau(p, k), "cycle_ms": cycle_k,
                                 "decode_ms": cycle_0, "cycle_over_decode": cycle_k / cycle_0,
                                 "setup_s": setup_s, "rows": table}}
