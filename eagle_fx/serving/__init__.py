"""Serving: a continuous-batching engine with adaptive speculation (engine.py, adaptive.py) and an
OpenAI-compatible HTTP server over it (server.py, `eagle-fx serve`)."""
from eagle_fx.serving.engine import Engine
from eagle_fx.serving.requests import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
