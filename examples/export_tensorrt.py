"""The deployment path, end to end: compile, check, export, load, (TensorRT).

    python examples/export_tensorrt.py --out /tmp/eagle_fx_export [--target exported_program|aoti|tensorrt]

Steps, and what each needs:
  1. eagle_fx.compile(base, draft)      torch + transformers; any device. The step graphs, after passes.
  2. model.generate(...)                 the reference output, in memory.
  3. eagle_fx.export(model, out, target)
       exported_program  torch only: OUT/<graph>.pt2 (torch.export.save) + manifest.json
       aoti              a C++ compiler (CPU) or CUDA toolchain: AOTInductor packages (.aoti.pt2)
       tensorrt          CUDA, TensorRT and torch_tensorrt: engines built by torch_tensorrt.dynamo,
                         saved as ExportedPrograms (.trt.pt2); eagle_fx's ops run as PyTorch fallbacks
  4. eagle_fx.load_exported(out)         the same eagle_fx and torch versions (the manifest is checked);
                                         no transformers model, no draft module: the graphs and the manifest.
  5. compare: the loaded model's tokens and accepted drafts equal the in-memory model's.
Defaults to the bundled tiny pair; --target tensorrt stops with what is missing on a machine
without CUDA/torch_tensorrt.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import eagle_fx
from eagle_fx.bundled import BUNDLED
from eagle_fx.export import ExportError


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="eagle_fx_export")
    ap.add_argument("--target", choices=["exported_program", "aoti", "tensorrt"], default="tensorrt")
    ap.add_argument("--model-dir", default=str(BUNDLED / "base"))
    ap.add_argument("--eagle-dir", default=str(BUNDLED / "eagle"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"1. compile ({args.model_dir} + {args.eagle_dir}, {args.device})")
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(args.device).eval()
    draft = eagle_fx.load_draft(args.eagle_dir, base)
    model = eagle_fx.compile(base, draft, max_batch_size=2, max_seq_len=256)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = [tok("<|user|>How do I sort a list in Python?<|assistant|>")["input_ids"],
               tok("<|user|>Write a haiku about the sea.<|assistant|>")["input_ids"]]
    print("2. reference generate, in memory")
    ref = model.generate(prompts, max_new_tokens=48)
    print(f"3. export -> {args.out} (target {args.target})")
    t = time.perf_counter()
    try:
        out = eagle_fx.export(model, args.out, target=args.target)
    except ExportError as e:
        sys.exit(f"   cannot export here: {e}")
    print(f"   {time.perf_counter() - t:.1f}s: " + ", ".join(sorted(p.name for p in Path(out).iterdir())))
    print("4. load_exported")
    loaded = eagle_fx.load_exported(out)
    got = loaded.generate(prompts, max_new_tokens=48)
    same = got.sequences == ref.sequences and got.stats.num_accepted_tokens == ref.stats.num_accepted_tokens
    print(f"5. same tokens and accepted drafts as in memory: {same} "
          f"(mean acceptance length {got.stats.mean_acceptance_length:.2f})")
    print("   " + tok.decode(got.sequences[0], skip_special_tokens=True)[:200])
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
