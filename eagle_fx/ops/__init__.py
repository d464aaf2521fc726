"""Canonical eagle_fx ops: `torch.library.custom_op`s with a fake impl and a torch reference."""
from eagle_fx.ops.attention import attention, cached_attention, rowwise_linear, visible_keys

__all__ = ["attention", "cached_attention", "rowwise_linear", "visible_keys"]
