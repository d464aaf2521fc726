"""eagle_fx's version, in a leaf module (export writes it into manifests without importing the package)."""
__version__ = "0.1.0.dev0"
