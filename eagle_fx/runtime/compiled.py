"""torch.compile for the runtime's graphs: sizes dynamic, no duck shaping.

Dynamic sizes that happen to be equal when a graph is first traced (a batch of 2 and a block
table 2 blocks wide, or a table as wide as the pool has blocks) would otherwise be assumed equal
forever (torch's "duck shaping"), and the first call where they differ would recompile. Every
call, not only the first, runs with duck shaping off, since a recompile traces again.
"""
from __future__ import annotations

import functools

import torch
from torch.fx.experimental import _config as fx_config


def compile_dynamic(fn, fullgraph: bool = False):
    """torch.compile(fn) with inductor, every size dynamic, no duck shaping, without autograd."""
    compiled = torch.compile(fn, backend="inductor", dynamic=True, fullgraph=fullgraph)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.no_grad(), fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call
