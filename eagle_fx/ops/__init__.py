"""Canonical eagle_fx ops: torch.library ops with a fake impl and a torch reference."""
from eagle_fx.ops.canonical import visible_keys

__all__ = ["visible_keys"]
