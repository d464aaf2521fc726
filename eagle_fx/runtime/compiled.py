"""torch.compile for the runtime's graphs: sizes dynamic, no duck shaping, no 0/1 specialisation.

Dynamic sizes that happen to be equal when a graph is first traced (a batch of 2 and a block
table 2 blocks wide, or a table as wide as the pool has blocks) would otherwise be assumed equal
forever (torch's "duck shaping"), and a size seen as 1 (one sequence, one token) would be
specialised; the first call where either differs would recompile. Sizes are size-oblivious
instead, as in eagle_fx.export (the captured step graphs run at any size >= 1), so one compile
serves every batch, token count and table width. Every call, not only the first, runs with these
settings, since a recompile traces again.

The decode hot path (the chain cycle: frozen_on=its device) is compiled with its weights frozen
(inductor's `freezing`: parameters become constants, folded and pre-packed), and on a CPU every
matmul is chosen by autotuning between inductor's C++ GEMM template (weights packed into its blocked
layout once, at compile time) and ATen's MKL / oneDNN calls. On a small-batch decode this is what
makes a step cost what reading its weights costs: one-row linears through MKL's sgemm cost 3-5x
more on this project's CPU (bench/step_costs.py prints the breakdown). The price: each compiled
cycle (one per k, and per one / several sequences) holds its own packed copy of the base's and the
draft's weights, and a change to the model's weights after compile is not seen (compile again).
The other step graphs (prefill, the graph-by-graph steps) keep the weights as inputs: a prefill's
many rows are compute-bound, where ATen's GEMMs do well, and they hold no copy.

The chain cycle keeps only the guards on its input tensors (their dtype, device, sizes and
strides), on the global state (grad mode) and on its symbolic sizes (the filter
`input_guards_only`): dynamo otherwise checked about 330 guards per call of a k = 0 cycle and 530
of a k = 3 one, most on what the cycle's closure holds (the step GraphModules, their frozen
parameters, the settings), which never change for a compiled cycle: each CycleSettings has a
function (a code object) of its own, made per ChainCycle (dynamo keeps traces per code object: no
other model's cycle can hit these unguarded traces), and the weights are constants already (a
change after compile is not seen, as above). Measured (bundled pair, one process, two compiles
alternated): a k = 3 cycle of one sequence 6-16% faster, a k = 0 one within noise (README, stop 49).

Python floats (a sampler's temperature, top_p) are specialised from the start: traced as symbolic
floats they make inductor restart the whole trace once to specialise them anyway (about 7 s of a
cold compile of the chain cycle on a 2-core CPU).
"""
from __future__ import annotations

import functools

import torch
from torch._dynamo import config as dynamo_config
from torch._inductor import config as inductor_config
from torch.fx.experimental import _config as fx_config


def frozen_weights_config(device: torch.device | str, cpp_wrapper: bool = False, autotune: bool = True) -> dict:
    """inductor settings for graphs whose weights are constants: freezing, and on a CPU (autotune)
    the autotuned choice between the C++ GEMM template and ATen for every matmul; cpp_wrapper (CPU):
    the compiled graph's calling code in C++ instead of Python (for graphs of ATen ops only: the
    chain cycle, about 7% faster per k=0 token on the bundled pair, interleaved A/B)."""
    settings = {"freezing": True}
    if torch.device(device).type == "cpu":
        settings.update(cpp_wrapper=cpp_wrapper)
        if autotune:
            settings.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return settings


def input_guards_only(guards) -> list[bool]:
    """A torch.compile guard filter: keep the guards on the global state, the symbolic sizes and the
    input tensors (not parameters, not globals); drop the rest (see the module)."""
    return [g.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
            or (g.guard_type == "TENSOR_MATCH" and not g.is_global and not isinstance(g.value, torch.nn.Parameter))
            for g in guards]


def compile_dynamic(fn, fullgraph: bool = False, frozen_on: torch.device | str | None = None,
                    cpp_wrapper: bool = False, autotune: bool = True, backend="inductor",
                    guard_inputs_only: bool = False):
    """torch.compile(fn) with inductor, every size dynamic, no duck shaping, without autograd.
    frozen_on (a device): the weights of the modules fn calls frozen (frozen_weights_config).
    guard_inputs_only: only the input tensors' guards (input_guards_only), for a function whose
    closure and globals never change once compiled.
    backend: inductor, or (tests) another torch.compile backend traced under the same settings.

    The settings are patched around every call (a call traces when its guards fail, and the patches
    are thread-local, so a server's engine thread sees them too). The patch objects are made once:
    making them anew costs about 0.1 ms per call on this project's CPU (a class per patch), as much
    as half a one-row draft step's kernels."""
    compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=fullgraph,
                             options={"guard_filter_fn": input_guards_only} if guard_inputs_only else None)
    settings = frozen_weights_config(frozen_on, cpp_wrapper, autotune) if frozen_on is not None else {}
    # inductor reads these when it compiles, which happens inside a call (the first, or a recompile)
    patches = (fx_config.patch(use_duck_shape=False, backed_size_oblivious=True),
               dynamo_config.patch(specialize_float=True), inductor_config.patch(settings))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.no_grad(), patches[0], patches[1], patches[2]:
            return compiled(*args, **kwargs)

    return call
