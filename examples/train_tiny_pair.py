"""Train the bundled tiny pair on ShareGPT, on the CPU: tokenizer, base, EAGLE-1/EAGLE-3 drafts,
and a small plain causal LM to serve as Hugging Face's `assistant_model`.

    python examples/train_tiny_pair.py --out models/tiny-sharegpt
    python examples/train_tiny_pair.py --out models/tiny-sharegpt-deep --base-layers 16 \
        --tokenizer-from models/tiny-sharegpt/base --no-assistant --methods eagle

Writes (fp16 safetensors, configs, tokenizer):
    OUT/base        LlamaForCausalLM + tokenizer (the bench's --model-dir)
    OUT/eagle       EAGLE-1 draft, SafeAILab layout (--eagle-dir)
    OUT/eagle3      EAGLE-3 draft, SafeAILab layout
    OUT/assistant   a 2-layer LlamaForCausalLM + tokenizer (HF assisted generation)
    OUT/TRAINING.json  commands, sizes, wall times, held-out perplexity
The bench's prompts are held-out conversations (eagle_fx.data.is_held_out), never trained on.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eagle_fx.data import load_conversations, split
from eagle_fx.drafts import load_draft
from eagle_fx.train import lr_at, pack_tokens, render, train_draft

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ '<|eos|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def train_tokenizer(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def train_lm(model, rows, steps, batch_size, lr, minutes, desc, seed=0):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    order = list(range(rows.shape[0]))
    random.Random(seed).shuffle(order)
    deadline = time.monotonic() + 60 * minutes
    bar = tqdm(total=steps, desc=desc, unit="step")
    step = 0
    while step < steps and time.monotonic() < deadline:
        batch = rows[[order[(step * batch_size + j) % len(order)] for j in range(batch_size)]]
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, steps, lr, 50)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    return model.eval(), step


@torch.no_grad()
def perplexity(model, rows, max_rows=64):
    model.eval()
    losses = [model(input_ids=rows[i:i + 8], labels=rows[i:i + 8]).loss.item() for i in range(0, min(len(rows), max_rows), 8)]
    return math.exp(sum(losses) / len(losses))


def lm_config(vocab, hidden, layers, heads, kv_heads, inter, max_pos):
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)


def save_lm(model, tokenizer, path: Path):
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    model.to(torch.float16).save_pretrained(path)
    model.float()
    tokenizer.save_pretrained(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tiny-sharegpt")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--train-tokens", type=int, default=6_000_000, help="tokens of ShareGPT tokenised for training")
    ap.add_argument("--base-steps", type=int, default=1500)
    ap.add_argument("--base-minutes", type=float, default=10.0)
    ap.add_argument("--draft-steps", type=int, default=1200)
    ap.add_argument("--draft-minutes", type=float, default=6.0)
    ap.add_argument("--assistant-steps", type=int, default=1200)
    ap.add_argument("--assistant-minutes", type=float, default=3.0)
    ap.add_argument("--only", choices=["all", "drafts"], default="all", help="'drafts': reuse OUT/base, retrain drafts")
    ap.add_argument("--base-layers", type=int, default=4, help="decoder layers of the base (hidden 256 either way)")
    ap.add_argument("--tokenizer-from", default=None, metavar="DIR",
                    help="reuse DIR's tokenizer instead of training one (a pair sharing another pair's vocabulary)")
    ap.add_argument("--no-assistant", action="store_true", help="skip the HF assistant model")
    ap.add_argument("--methods", default="eagle,eagle3", help="drafts to train (comma-separated)")
    ap.add_argument("--kv-share", type=int, default=None, metavar="LAYER",
                    help="train KV-sharing drafts reading base layer LAYER's K/V, written to OUT/<method>-kvshare")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(["python examples/train_tiny_pair.py"] + list(sys.argv[1:] if argv is None else argv)), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads"}
    t_all = time.monotonic()

    convs = load_conversations()
    train, held = split(convs)
    random.Random(0).shuffle(train)
    report["conversations"] = {"complete": len(convs), "train": len(train), "held_out": len(held)}

    if args.only == "all" and args.tokenizer_from is None:
        t = time.monotonic()
        texts = (render(None, c["turns"]) for c in train[:4000])
        tokenizer = train_tokenizer(texts, args.vocab_size)
        report["tokenizer_s"] = round(time.monotonic() - t, 1)
    elif args.tokenizer_from is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer_from)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "base")
    rows = pack_tokens(tokenizer, train, args.seq_len, max_tokens=args.train_tokens)
    held_rows = pack_tokens(tokenizer, held, args.seq_len, max_tokens=200_000)
    report["train_rows"] = list(rows.shape)

    if args.only == "all":
        t = time.monotonic()
        base = LlamaForCausalLM(lm_config(len(tokenizer), 256, args.base_layers, 4, 2, 704, 2048))
        base, steps = train_lm(base, rows, args.base_steps, 16, 3e-3, args.base_minutes, "train base")
        report["base"] = {"params": sum(p.numel() for p in base.parameters()), "steps": steps, "batch": 16,
                          "train_s": round(time.monotonic() - t, 1), "held_out_ppl": round(perplexity(base, held_rows), 2)}
        save_lm(base, tokenizer, out / "base")

    if args.only == "all" and not args.no_assistant:
        t = time.monotonic()
        asst = LlamaForCausalLM(lm_config(len(tokenizer), 128, 2, 2, 1, 352, 2048))
        asst, steps = train_lm(asst, rows, args.assistant_steps, 16, 3e-3, args.assistant_minutes, "train assistant", seed=1)
        report["assistant"] = {"params": sum(p.numel() for p in asst.parameters()), "steps": steps, "batch": 16,
                               "train_s": round(time.monotonic() - t, 1), "held_out_ppl": round(perplexity(asst, held_rows), 2)}
        save_lm(asst, tokenizer, out / "assistant")

    base = LlamaForCausalLM.from_pretrained(out / "base", dtype=torch.float32).eval()
    for method in args.methods.split(","):
        t = time.monotonic()
        name = method + ("-kvshare" if args.kv_share is not None else "")
        draft = train_draft(base, rows, out / name, method=method, steps=args.draft_steps, minutes=args.draft_minutes,
                            batch_size=8, lr=3e-3, checkpoint_every=200, kv_share=args.kv_share)
        (out / name / "train_state.pt").unlink(missing_ok=True)  # resume state is not bundled
        from eagle_fx.drafts import save_draft

        save_draft(draft, out / name, dtype=torch.float16)
        load_draft(out / name, base)  # the bundled files load
        report[name] = {"params": sum(p.numel() for n, p in draft.named_parameters() if "embed_tokens" not in n),
                          "train_s": round(time.monotonic() - t, 1), "budget": {"steps": args.draft_steps,
                                                                                 "minutes": args.draft_minutes}}
    report["total_s"] = round(time.monotonic() - t_all, 1)
    prev = json.loads((out / "TRAINING.json").read_text()) if (out / "TRAINING.json").exists() else {}
    report["commands"] = prev.get("commands", []) + [report.pop("command")]
    report["total_s"] = {**(prev.get("total_s") if isinstance(prev.get("total_s"), dict) else {}),
                         report["commands"][-1]: report["total_s"]}
    prev.update(report)
    (out / "TRAINING.json").write_text(json.dumps(prev, indent=2))
    print(json.dumps(prev, indent=2))


if __name__ == "__main__":
    main()
