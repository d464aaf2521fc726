"""Every option of `eagle_fx.compile`, validated once with errors that say what to change."""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("eager", "inductor")


@dataclass(frozen=True)
class Options:
    num_spec_tokens: int = 3
    prefill_shift: bool = True
    backend: str = "eager"
    max_batch_size: int = 8
    max_seq_len: int = 2048
    block_size: int = 16

    def __post_init__(self):
        for name in ("num_spec_tokens", "max_batch_size", "max_seq_len", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.prefill_shift, bool):
            raise TypeError(f"prefill_shift must be a bool, got {self.prefill_shift!r}")
        if not self.prefill_shift:
            raise ValueError(
                "prefill_shift=False (the unshifted draft prefill) is not available yet: it comes with the "
                "drop_prefill_shift pass; use prefill_shift=True"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
