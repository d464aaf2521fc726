"""`torch.compile(fn, backend="eagle_fx", options={...})`: eagle_fx's passes, then inductor.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so it works right
after `pip install` without importing eagle_fx first. Dynamo's graph is lowered to aten by
AOTAutograd; on the aten graph the eagle_fx passes run:

  canonicalize_attention   causal scaled_dot_product_attention without an explicit mask ->
                           eagle_fx::attention (an explicit mask, e.g. padding or a sliding
                           window, keeps the SDPA: its semantics are the mask's)
  lower_to_triton          the Triton fusions (RMSNorm + residual, SwiGLU, ...), where Triton can
                           run on the graph's device (else skipped, with the reason in the log)

and the result is compiled by inductor. The passes run inside inductor's own pipeline
(`compile_fx(..., inner_compile=...)`): inductor's AOTAutograd (its decompositions and
partitioner) produces the forward, backward or inference graph, the passes rewrite it, and
inductor's `compile_fx_inner` compiles it, so the forward's output strides reach the backward as
with backend="inductor". (Compiling each partitioned graph with `compile_fx`, a second
AOTAutograd inside the first, lost them: from a cold cache the backward was compiled for strides
the forward did not return.) A backend must never break a model: each pass runs on a copy of the
graph, and a pass that cannot rewrite it (an error inside the pass) leaves the graph as it was,
with a log line saying why. Training works: the forward and backward graphs both go through the
passes, and an attention whose logsumexp the backward needs is left as SDPA.
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
    sink = opts["pass_log"]

    def run_passes(aten_gm: torch.fx.GraphModule, aten_inputs) -> torch.fx.GraphModule:
        from eagle_fx.passes import PassContext, canonicalize_attention, lower_to_triton
        from eagle_fx.passes.fx_graph import copy_graph_module

        ctx = PassContext()
        changed = False
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
                changed |= res.num_matches > 0
                line = f"{name}: {res}"
                log.info("eagle_fx backend: %s", line)
            if sink is not None:
                sink.append(line)
        if changed:
            _propagate_fake_values(aten_gm, aten_inputs)
        return aten_gm

    if not opts["inductor"]:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def run_as_is(aten_gm, aten_inputs):
            # AOTAutograd calls what we return with one list of arguments (boxed)
            return make_boxed_func(run_passes(aten_gm, aten_inputs))

        # AOTAutograd partitions a training graph into a forward and a backward: both get the passes
        return aot_autograd(fw_compiler=run_as_is, bw_compiler=run_as_is)(gm, example_inputs)

    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def passes_then_inductor(aten_gm, aten_inputs, **kwargs):
        return compile_fx_inner(run_passes(aten_gm, aten_inputs), aten_inputs, **kwargs)

    # inductor's own AOTAutograd (its decompositions, partitioner, and the forward's output strides
    # handed to the backward) with the passes between partitioning and code generation: forward,
    # backward and inference graphs all get them. AOTAutograd's cache is off for this compile: its
    # key knows neither the passes nor their options (a hit would skip them, or return a graph
    # compiled with other options); inductor's own cache keys the graph after the passes
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=passes_then_inductor,
                          decompositions=_decompositions(opts["passes"], example_inputs))


# ops inductor decomposes that lower_to_triton matches whole (swiglu: silu(g) * u), kept when it runs
KEPT_FOR_TRITON = (torch.ops.aten.silu.default,)


def _decompositions(passes, example_inputs) -> dict:
    """Inductor's decomposition table, less the ops lower_to_triton matches when it can run on the
    inputs' device (an unmatched one then runs as its aten kernel)."""
    from torch._inductor.decomposition import select_decomp_table

    from eagle_fx.ops.triton import triton_status

    table = select_decomp_table()
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    if "lower_to_triton" not in passes or not triton_status(device)[0]:
        return table
    return {op: fn for op, fn in table.items() if op not in KEPT_FOR_TRITON}


def _propagate_fake_values(gm: torch.fx.GraphModule, example_inputs) -> None:
    """Recompute every node's meta["val"] (inductor reads them: output strides, pattern passes) after
    a pass rewrote the graph: a replaced node carries its predecessor's meta (e.g. SDPA's tuple)."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        return
    with fake_mode:
        FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*example_inputs)
