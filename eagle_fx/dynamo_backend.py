"""`torch.compile(fn, backend="eagle_fx", options={...})`: eagle_fx's passes, then inductor.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so it works right
after `pip install` without importing eagle_fx first. Dynamo's graph is lowered to aten by
AOTAutograd; on the aten graph the eagle_fx passes run:

  canonicalize_attention   causal scaled_dot_product_attention without an explicit mask ->
                           eagle_fx::attention (an explicit mask, e.g. padding or a sliding
                           window, keeps the SDPA: its semantics are the mask's)
  lower_to_triton          the Triton fusions (RMSNorm + residual, SwiGLU, ...), where Triton can
                           run on the graph's device (else skipped, with the reason in the log)

and the result is compiled by inductor. A backend must never break a model: each pass runs on a
copy of the graph, and a pass that cannot rewrite it (an error inside the pass) leaves the graph
as it was, with a log line saying why. Training works: AOTAutograd's forward and backward graphs
both go through the passes, and an attention whose logsumexp the backward needs is left as SDPA.
Options (all optional; anything else is an error):

  passes     which passes to run, default ("canonicalize_attention", "lower_to_triton")
  inductor   compile the rewritten graph with inductor (default True); False runs it as is
  pass_log   a list the backend appends one line per pass and graph to ("<pass>: N match(es) ...")
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("eagle_fx")

PASS_NAMES = ("canonicalize_attention", "lower_to_triton")
OPTIONS = {"passes": PASS_NAMES, "inductor": True, "pass_log": None}


def _options(options) -> dict:
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ValueError(f"torch.compile(backend='eagle_fx'): unknown option(s) {unknown}; the options are "
                         f"{sorted(OPTIONS)} (see eagle_fx.dynamo_backend)")
    opts = {**OPTIONS, **opts}
    bad = [p for p in opts["passes"] if p not in PASS_NAMES]
    if bad:
        raise ValueError(f"torch.compile(backend='eagle_fx'): unknown pass(es) {bad}; choose from {PASS_NAMES}")
    return opts


def eagle_fx_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    opts = _options(options)
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import compile_fx

    from eagle_fx.passes import PassContext, canonicalize_attention, lower_to_triton
    from eagle_fx.passes.fx_graph import copy_graph_module

    sink = opts["pass_log"]

    def run_passes(aten_gm):
        ctx = PassContext()
        for name in opts["passes"]:
            try:
                copy = copy_graph_module(aten_gm)
                if name == "canonicalize_attention":
                    res = canonicalize_attention.run(copy, ctx, only_unmasked=True)
                else:
                    res = lower_to_triton.run(copy, ctx)
            except Exception as e:  # any failure of a pass: the graph stays as it was
                line = f"{name}: left as is ({type(e).__name__}: {e})"
                log.warning("eagle_fx backend: %s", line)
            else:
                aten_gm = res.gm
                line = f"{name}: {res}"
                log.info("eagle_fx backend: %s", line)
            if sink is not None:
                sink.append(line)
        return aten_gm

    def compiler(aten_gm, aten_inputs):
        aten_gm = run_passes(aten_gm)
        # AOTAutograd calls what we return with one list of arguments (boxed)
        return make_boxed_func(compile_fx(aten_gm, aten_inputs) if opts["inductor"] else aten_gm)

    # AOTAutograd partitions a training graph into a forward and a backward: both get the passes
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)(gm, example_inputs)
