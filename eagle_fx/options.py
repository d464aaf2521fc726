"""Every option of `eagle_fx.compile`, validated once with errors that say what to change."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_fx.draft_tree import DraftTree
from eagle_fx.rope_support import check_max_seq_len

BACKENDS = ("eager", "inductor", "triton", "tensorrt")


@dataclass(frozen=True)
class Options:
    num_spec_tokens: int = 3  # 0: no speculation, the base decodes alone on the same graphs (a baseline)
    prefill_shift: bool = False
    backend: str = "eager"
    max_batch_size: int = 8
    max_seq_len: int = 2048
    block_size: int = 16
    prefill_chunk_size: int | None = None
    prefix_caching: bool = False
    bootstrap: torch.Tensor | None = None  # unshifted: the feature before t_0 (zeros by default)
    num_blocks: int | None = None  # KV pool size in blocks (default: max_batch_size full-length sequences)
    batch_invariant: bool = False  # bit-identical numerics across chunkings/batchings (slower)
    # "pool": the draft's KV is one more layer of the base's pool; LAYER (int): the draft reads base
    # layer LAYER's K/V (a KV-sharing draft); "auto": the draft's trained LAYER if any, else "pool"
    kv_share: str | int | None = "auto"
    # the draft step and the verify step over per-batch-bucket static buffers, replayed as CUDA
    # graphs on a GPU when every op in them can be captured; None: on for backend="triton"
    static_steps: bool | None = None
    # EAGLE-2 dynamic draft tree: dict(top_k=, depth=, total_tokens=) (kept as a DraftTree); None: a chain
    draft_tree: DraftTree | dict | None = None
    # ranks the base is sharded over (shard_tensor_parallel; under torchrun, one process per rank)
    tensor_parallel: int = 1
    # backend="inductor" on a CPU: the compiled chain cycle benchmarks inductor's C++ GEMM template
    # against ATen for every matmul (faster decode; a cold compile takes minutes longer)
    gemm_autotune: bool = True

    def __post_init__(self):
        k = self.num_spec_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"num_spec_tokens must be an int >= 0 (0: the base alone, no speculation), got {k!r}")
        for name in ("max_batch_size", "max_seq_len", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("prefill_chunk_size", "num_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be None or a positive int, got {v!r}")
        if self.static_steps is not None and not isinstance(self.static_steps, bool):
            raise TypeError(f"static_steps must be a bool or None, got {self.static_steps!r}")
        for name in ("prefill_shift", "prefix_caching", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.bootstrap is not None:
            if not isinstance(self.bootstrap, torch.Tensor) or self.bootstrap.dim() != 1:
                raise TypeError("bootstrap must be a 1-D tensor (one feature vector) or None")
            if self.prefill_shift:
                raise ValueError("bootstrap is the unshifted scheme's first feature; it has no use with prefill_shift=True")
        ks = self.kv_share
        if not (ks in ("auto", "pool", None) or (isinstance(ks, int) and not isinstance(ks, bool))):
            raise ValueError(f"kv_share must be 'auto', 'pool', None or a base layer index (int), got {ks!r}")
        if self.draft_tree is not None:
            object.__setattr__(self, "draft_tree", DraftTree.of(self.draft_tree))
            if self.num_spec_tokens == 0:
                raise ValueError("num_spec_tokens=0 (the base alone) runs without a draft tree: drop draft_tree=")
            if isinstance(ks, int) and not isinstance(ks, bool):
                raise ValueError(f"draft_tree does not run with kv_share=LAYER (here {ks}; kv_share='auto' takes a "
                                 "sharing draft's trained layer): the draft's speculated K/V ring is a chain; pass "
                                 "kv_share=None (the draft keeps its own K/V) or 'pool' with a tree")
        if not isinstance(self.gemm_autotune, bool):
            raise ValueError(f"gemm_autotune must be True or False, got {self.gemm_autotune!r}")
        tp = self.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel must be an int >= 1, got {tp!r}")
        if tp > 1 and self.backend not in ("eager", "inductor"):
            raise ValueError(f"tensor_parallel={tp} runs with backend 'eager' or 'inductor', not {self.backend!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "triton" and self.block_size & (self.block_size - 1):
            raise ValueError(f"backend='triton' needs a power-of-two block_size (the kernels tile by block), got {self.block_size}")

    def check_for_pair(self, vision_language: bool, rope_limit: int | None) -> None:
        """The checks that need to know the pair, run once per way a model is made: by compile
        (before the capture), replace() and load_exported. vision_language: the base takes images;
        rope_limit: the longest sequence its RoPE is exact for (rope_support.pair_rope_limit)."""
        if vision_language:
            if isinstance(self.kv_share, int) and not isinstance(self.kv_share, bool):
                raise ValueError("kv_share=LAYER is not supported with a vision-language base; use kv_share='pool' "
                                 "or None")
            if self.static_steps:
                raise ValueError("static_steps is not supported with a vision-language base (its image rows vary "
                                 "per call)")
        check_max_seq_len(self.max_seq_len, lookahead(self), rope_limit)


def lookahead(options: Options) -> int:
    """Cache positions one speculation step computes past a sequence's committed tokens: the
    pending token and k drafts (a chain), or the tree's width."""
    return options.num_spec_tokens + 1 if options.draft_tree is None else options.draft_tree.width
