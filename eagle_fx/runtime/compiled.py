"""torch.compile for the runtime's graphs: sizes dynamic, no duck shaping, no 0/1 specialisation.

Dynamic sizes that happen to be equal when a graph is first traced (a batch of 2 and a block
table 2 blocks wide, or a table as wide as the pool has blocks) would otherwise be assumed equal
forever (torch's "duck shaping"), and a size seen as 1 (one sequence, one token) would be
specialised; the first call where either differs would recompile. Sizes are size-oblivious
instead, as in eagle_fx.export (the captured step graphs run at any size >= 1), so one compile
serves every batch, token count and table width. Every call, not only the first, runs with these
settings, since a recompile traces again.

Python floats (a sampler's temperature, top_p) are specialised from the start: traced as symbolic
floats they make inductor restart the whole trace once to specialise them anyway (about 7 s of a
cold compile of the chain cycle on a 2-core CPU).
"""
from __future__ import annotations

import functools

import torch
from torch._dynamo import config as dynamo_config
from torch.fx.experimental import _config as fx_config


def compile_dynamic(fn, fullgraph: bool = False):
    """torch.compile(fn) with inductor, every size dynamic, no duck shaping, without autograd."""
    compiled = torch.compile(fn, backend="inductor", dynamic=True, fullgraph=fullgraph)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with (torch.no_grad(), fx_config.patch(use_duck_shape=False, backed_size_oblivious=True),
              dynamo_config.patch(specialize_float=True)):
            return compiled(*args, **kwargs)

    return call
