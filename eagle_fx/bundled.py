"""The tiny pair bundled with the repository (models/tiny-sharegpt), and the loader of a base + draft pair."""
from __future__ import annotations

from pathlib import Path

import torch

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "tiny-sharegpt"


def pair_dirs(model_dir=None, eagle_dir=None, method: str = "eagle") -> tuple[Path, Path]:
    """The base and draft folders: those given, else the bundled base and the bundled draft for `method`."""
    return (Path(model_dir) if model_dir else BUNDLED / "base",
            Path(eagle_dir) if eagle_dir else BUNDLED / method)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_pair_dirs(model_dir: Path, eagle_dir: Path | None, model_flag: str = "--model-dir") -> None:
    """A SystemExit naming what is missing, and the flag that named it, before any slow loading (a
    folder that is not there otherwise reaches transformers as a Hub repo id, a folder without a
    tokenizer as advice to install sentencepiece)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SystemExit(f"{model_flag} {model_dir}: no such folder, so not a Hugging Face model folder (one with "
                         "config.json)")
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"{model_flag} {model_dir}: no config.json there, so not a Hugging Face model folder; pass "
                         "the folder save_pretrained wrote")
    if not any((model_dir / f).exists() for f in TOKENIZER_FILES):
        raise SystemExit(f"{model_flag} {model_dir}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); save "
                         "the tokenizer next to the model (tokenizer.save_pretrained(model_dir))")
    if eagle_dir is not None and not (Path(eagle_dir) / "config.json").exists():
        raise SystemExit(f"--eagle-dir {eagle_dir}: no draft there (no config.json); pass an EAGLE draft folder "
                         "(eagle-fx train-draft writes one)")


def load_pair(model_dir: Path, eagle_dir: Path):
    """(tokenizer, base, draft): the HF base in float32 with SDPA attention, in eval mode, and its EAGLE draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_fx.drafts import load_draft

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return tokenizer, base, load_draft(eagle_dir, base)
