"""PairSpec: what the runtime needs to know about a base + draft pair besides its step graphs, so a
pair loaded from exported graphs runs without the original modules."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_fx.draft_kv import DraftKV
from eagle_fx.graph_kinds import GRAPH_KINDS, FeatureInput
from eagle_fx.kv_share import base_kv_shape
from eagle_fx.multimodal import image_token_id, is_vision_language


def eos_ids(model) -> tuple[int, ...]:
    """The eos ids of `model`'s generation_config (none, one or several), as a tuple."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


@dataclass(frozen=True)
class PairSpec:
    vocab_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    eos: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    draft_method: str
    draft_kv_heads: int
    draft_heads: int
    draft_head_dim: int
    draft_hidden_size: int
    feature_dim: int
    # how the draft's K/V is kept (eagle_fx.draft_kv; the pools: eagle_fx.runtime.kv_cache.KVCache)
    draft_kv: DraftKV = DraftKV.POOL
    kv_share_layer: int | None = None  # DraftKV.LAYER: the base layer the draft reads
    d2t: torch.Tensor | None = None  # EAGLE-3: target id = draft id + d2t[draft id]
    embed_dim: int = 0  # a vision-language base: the width of its input (and image) embeddings
    image_token_id: int | None = None  # a vision-language base: its image placeholder token
    mrope: bool = False  # a Qwen2-VL-family base: its graph takes M-RoPE positions
    pad_token_id: int | None = None  # the base's generation_config pad id (a padded 2-D input without a mask is refused)
    rope_limit: int | None = None  # longrope: the longest sequence its RoPE is exact for (eagle_fx.rope_support)

    def __post_init__(self):
        object.__setattr__(self, "draft_kv", DraftKV.of(self.draft_kv, "PairSpec"))
        self.draft_kv.check_layer(self.kv_share_layer, "PairSpec")

    @property
    def vision_language(self) -> bool:
        return self.image_token_id is not None

    def feature_width(self, graph: str) -> int:
        """The width of step graph `graph`'s features / carry_features input (eagle_fx.graph_kinds)."""
        return {FeatureInput.NONE: 0, FeatureInput.BASE_FEATURE: self.feature_dim,
                FeatureInput.DRAFT_HIDDEN: self.draft_hidden_size}[GRAPH_KINDS[graph].feature_input]

    @classmethod
    def from_pair(cls, base, draft, draft_kv: DraftKV, kv_share_layer: int | None = None, mrope: bool = False,
                  rope_limit: int | None = None, tensor_parallel: int = 1) -> "PairSpec":
        text_config, draft_config = base.config.get_text_config(), draft.config
        param = next(base.parameters())
        eos = eos_ids(base)
        pads = (getattr(getattr(base, "generation_config", None), "pad_token_id", None),
                getattr(text_config, "pad_token_id", None))
        pad = next((p for p in pads if isinstance(p, int)), None)
        kv_heads, head_dim = base_kv_shape(base)
        kv_heads //= tensor_parallel  # a sharded base: this rank's share of the heads
        d2t = getattr(draft, "d2t", None)
        vision_language = is_vision_language(base)
        return cls(
            vocab_size=text_config.vocab_size, num_layers=text_config.num_hidden_layers, kv_heads=kv_heads,
            head_dim=head_dim, eos=eos, device=param.device, dtype=param.dtype, draft_method=draft.method,
            draft_kv_heads=draft_config.num_key_value_heads, draft_heads=draft_config.num_attention_heads,
            draft_head_dim=draft_config.head_dim, draft_hidden_size=draft_config.hidden_size,
            feature_dim=draft.feature_dim, draft_kv=draft_kv, kv_share_layer=kv_share_layer,
            d2t=None if d2t is None else d2t.detach().clone(),
            embed_dim=base.get_input_embeddings().weight.shape[1] if vision_language else 0,
            image_token_id=image_token_id(base) if vision_language else None, mrope=mrope, rope_limit=rope_limit,
            pad_token_id=pad)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: draft vocab ids -> target ids (d2t); EAGLE-1: as they are."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def to_draft_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A mask over the target vocab [N, V] (bool) as one over the draft vocab [N, Vd]."""
        if self.d2t is None:
            return allowed
        d2t = self.d2t.to(allowed.device)
        return allowed[:, torch.arange(d2t.shape[0], device=allowed.device) + d2t]

    def to_target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocab [N, Vd] as one over the target vocab [N, V]."""
        if self.d2t is None:
            return draft_probs
        out = draft_probs.new_zeros(draft_probs.shape[0], self.vocab_size)
        target = torch.arange(draft_probs.shape[1], device=draft_probs.device) + self.d2t.to(draft_probs.device)
        return out.index_add_(1, target, draft_probs)
