"""Write a tiny *random* Llama base and a random EAGLE-1 draft for it, to try eagle_fx without
training anything (random drafts are rarely accepted: this shows mechanics, not speed).

    python examples/random_tiny_pair.py --out /tmp/random-pair
    eagle-fx bench --model-dir /tmp/random-pair/base --eagle-dir /tmp/random-pair/eagle \
        --dataset-name random --num-prompts 20 --output-len 64 --compare
"""
import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eagle_fx.bundled import BUNDLED
from eagle_fx.drafts import new_draft, save_draft


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(BUNDLED / "base")  # any tokenizer; the bundled one is local
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    base = LlamaForCausalLM(cfg).eval()
    base.save_pretrained(out / "base")
    tok.save_pretrained(out / "base")
    save_draft(new_draft(base, "eagle", seed=args.seed), out / "eagle")
    print(f"wrote {out}/base and {out}/eagle")


if __name__ == "__main__":
    main()
