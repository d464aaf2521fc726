"""eagle_fx: lossless EAGLE speculative decoding for Hugging Face models, as torch.fx graph passes."""
from eagle_fx.version import __version__

from eagle_fx.api import compile, load_draft  # noqa: E402,A004
from eagle_fx.export import export, load_exported  # noqa: E402

__all__ = ["compile", "export", "load_draft", "load_exported", "__version__"]
