"""Minimal eagle_fx demo: a tiny random Llama, a random EAGLE-1 draft, greedy generate vs HF.

    python examples/spec_decode.py

Random drafts are rarely accepted; this shows the API and the losslessness check, not speed.
"""
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import eagle_fx
from eagle_fx.drafts import new_draft


def main():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    base = LlamaForCausalLM(cfg).eval()
    draft = new_draft(base, "eagle", seed=0)
    model = eagle_fx.compile(base, draft, num_spec_tokens=3)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (17, 40, 8)]
    out = model.generate(prompts, max_new_tokens=64)

    t = time.perf_counter()
    ref = []
    with torch.no_grad():
        for p in prompts:
            o = base.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, pad_token_id=0)
            ref.append(o[0, len(p):].tolist())
    hf_s = time.perf_counter() - t
    st = out.stats
    print("\n".join(model.graphs.pass_log))
    print(f"equal to HF greedy: {out.sequences == ref}")
    print(f"mean acceptance length {st.mean_acceptance_length:.2f}, acceptance at token {[round(a, 2) for a in st.acceptance_at]}")
    print(f"eagle_fx {st.total_num_output_tokens / st.wall_time_s:.1f} tok/s, HF greedy {sum(map(len, ref)) / hf_s:.1f} tok/s")


if __name__ == "__main__":
    main()
