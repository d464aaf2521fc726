"""What the step modules make of their inputs before the layers, shared by the draft (eagle_fx.drafts)
and the vision-language base step (eagle_fx.multimodal): token embeddings with image rows, and the
draft's input feature from a base's hidden states. A leaf: it imports nothing of eagle_fx."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def embed_tokens(input_ids: torch.Tensor, embed: nn.Embedding, mm_embeds: torch.Tensor | None) -> torch.Tensor:
    """Token embeddings by the `embed` module; with mm_embeds, ids >= its rows (the vocab size)
    take rows of mm_embeds instead."""
    if mm_embeds is None:
        return embed(input_ids)
    vocab = embed.weight.shape[0]
    text = embed(input_ids.clamp(max=vocab - 1))
    image = F.embedding((input_ids - vocab).clamp(min=0), mm_embeds.to(text.dtype))
    return torch.where((input_ids < vocab)[..., None], text, image)


def select_features(hidden_states, aux_layer_ids) -> torch.Tensor:
    """The draft's input feature from HF `hidden_states`: EAGLE-3 concatenates the inputs of its
    feature layers (low -> high); EAGLE-1 (no aux layers) takes the last state, after the final norm."""
    if aux_layer_ids:
        return torch.cat([hidden_states[i] for i in aux_layer_ids], dim=-1)
    return hidden_states[-1]
