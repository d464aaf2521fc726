"""The tiny pair bundled with the repository (models/tiny-sharegpt), and the loader of a base + draft pair."""
from __future__ import annotations

from pathlib import Path

import torch

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "tiny-sharegpt"


def pair_dirs(model_dir=None, eagle_dir=None, method: str = "eagle") -> tuple[Path, Path]:
    """The base and draft folders: those given, else the bundled base and the bundled draft for `method`."""
    return (Path(model_dir) if model_dir else BUNDLED / "base",
            Path(eagle_dir) if eagle_dir else BUNDLED / method)


def load_pair(model_dir: Path, eagle_dir: Path):
    """(tokenizer, base, draft): the HF base in float32 with SDPA attention, in eval mode, and its EAGLE draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_fx.drafts import load_draft

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return tokenizer, base, load_draft(eagle_dir, base)
