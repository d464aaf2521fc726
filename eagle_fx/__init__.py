"""eagle_fx: lossless EAGLE speculative decoding for Hugging Face models, as torch.fx graph passes."""
__version__ = "0.1.0.dev0"

from eagle_fx.api import compile, export, load_draft  # noqa: E402,A004

__all__ = ["compile", "export", "load_draft", "__version__"]
