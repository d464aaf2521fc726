"""Where a draft's K/V live: the one spelling of the modes, chosen at compile (eagle_fx.api from the
kv_share option) and recorded in the CapturePlan (which passes run) and the PairSpec (how the runtime
lays out its pools)."""
from __future__ import annotations

from enum import StrEnum


class DraftKV(StrEnum):
    """OWN: a pool of its own (the draft_kv_pool input; the shifted scheme, other kv shapes, a
    sharded base). POOL: one more layer of the base's pool (alias_draft_kv; kv_share="pool").
    LAYER: the draft reads a base layer's K/V for committed positions and keeps only its speculated
    positions' K/V (alias_draft_kv + prune_draft_rows; kv_share=LAYER)."""

    OWN = "own"
    POOL = "pool"
    LAYER = "layer"

    @classmethod
    def of(cls, value, what: str) -> "DraftKV":
        """value as a DraftKV, or a ValueError naming `what` and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what}: draft_kv={value!r}; choose from {tuple(m.value for m in cls)}") from None

    def check_layer(self, kv_share_layer: int | None, what: str) -> None:
        """A base layer goes with LAYER and only with it."""
        if (self is DraftKV.LAYER) != (kv_share_layer is not None):
            raise ValueError(f"{what}: draft_kv={self.value!r} with kv_share_layer={kv_share_layer!r}; a base layer "
                             "goes with draft_kv='layer' and only with it")
