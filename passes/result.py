"""What every pass takes and returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the graph (eagle_fx.pipeline declares one per step graph).

    root: the nn.Module that was captured (to resolve `nn_module_stack` paths to modules).
    expected_attention_layers: canonicalize_attention's check: the number of attention layers the
        model has (a different number of matches is an error); None: no check.
    pool_name: the graph input insert_kv_cache adds for the KV pool.
    shared_pool_layer: the base pool layer alias_draft_kv moves the draft's attention to.
    kv_share_layer: alias_draft_kv with kv_share=LAYER: the base layer whose K/V the draft reads.
    all_rows_committed: every row of the graph is a committed position (the draft prefill), so a
        sharing draft needs none of its own k/v there.
    tensor_parallel: (rank, world size) shard_tensor_parallel cuts the base graph for.
    tensor_parallel_group: the torch.distributed group name its all-reduces use.
    """

    root: torch.nn.Module | None = None
    expected_attention_layers: int | None = None
    pool_name: str = "kv_pool"
    shared_pool_layer: int = 0
    kv_share_layer: int | None = None
    all_rows_committed: bool = False
    tensor_parallel: tuple[int, int] = (0, 1)
    tensor_parallel_group: str = ""


@dataclass
class PassResult:
    gm: torch.fx.GraphModule
    num_matches: int
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        extra = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"{self.num_matches} match(es){extra}"
