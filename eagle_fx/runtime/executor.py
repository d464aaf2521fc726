"""Graph calls: each step graph's inputs from its StepSignature, through static buffers (replayed as
CUDA graphs on a GPU) where the model runs static steps, timed by the call's profiler when asked.

Graph names and what each is: eagle_fx.graph_kinds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_fx.multimodal import rope_positions
from eagle_fx.passes.fx_graph import op_arguments
from eagle_fx.runtime.kv_cache import KVCache
from eagle_fx.runtime.signature import StepSignature
from eagle_fx.runtime.static_buffers import StaticPrefill, StaticStep
from eagle_fx.runtime.stats import Profiler

# torch reference ops that read tensor values on the host (unless marked uniform_queries): their
# graphs cannot be CUDA-graph captured
HOST_READING_OPS = ("cached_attention", "shared_cached_attention", "rowwise_linear")


@dataclass
class WaveTables:
    """Per-wave graph inputs of a vision-language pair: the wave's image rows (mm_embeds, at least one
    row) and its M-RoPE table (eagle_fx.multimodal.wave_inputs), or None."""

    mm_embeds: torch.Tensor | None = None
    rope: tuple | None = None


class Executor:
    def __init__(self, callables: dict, signatures: dict[str, StepSignature], kv_cache: KVCache):
        self.callables = callables
        self.signatures = signatures
        self.kv_cache = kv_cache
        self.static: dict = {}  # "base", "draft_prefill", "draft_step", "verify" -> static buffers
        self.cuda_graphs = False
        self.observers: list = []

    def use_static_buffers(self, graphs, options, device: torch.device) -> None:
        """The draft step (1 row per sequence), the verify (k+1 rows) and the base and draft prefills
        (bucketed by batch and tokens) over static buffers; captured as CUDA graphs when on a GPU and
        every op of their graphs can be captured (`graphs`: the GraphModules, None when loaded from
        exported files: not captured)."""
        host_reading = tuple(getattr(torch.ops.eagle_fx, op).default for op in HOST_READING_OPS)
        blocking = graphs is None or any(
            n.op == "call_function" and n.target in host_reading and not op_arguments(n)["uniform_queries"]
            for name in ("base", "verify", "draft_step", "draft_prefill") for n in getattr(graphs, name).graph.nodes)
        self.cuda_graphs = device.type == "cuda" and not blocking
        kv = self.kv_cache
        common = dict(max_batch_size=options.max_batch_size, scratch_block=kv.scratch_block,
                      block_size=options.block_size, scratch_ring_row=options.max_batch_size, capture=self.cuda_graphs)
        max_tokens = (options.prefill_chunk_size or options.max_seq_len) * options.max_batch_size
        fns, sigs = self.callables, self.signatures
        self.static = {
            "draft_step": StaticStep(fns["draft_step"], sigs["draft_step"], 1, **common),
            "verify": StaticStep(fns["verify"], sigs["verify"], options.num_spec_tokens + 1, **common),
            "base": StaticPrefill(fns["base"], sigs["base"], ("seqs", "tokens"), max_tokens=max_tokens, **common),
            "draft_prefill": StaticPrefill(fns["draft_prefill"], sigs["draft_prefill"], ("seqs", "seqs"),
                                           max_tokens=max_tokens, **common)}

    def graph_inputs(self, graph: str, values: dict, wave: WaveTables | None = None) -> dict:
        """The inputs graph `graph` declares: `values`, plus its pools and the wave's tables."""
        sig = self.signatures[graph]
        values = {**self.kv_cache.pools(sig.is_base), **values}
        if wave is not None:
            values.setdefault("mm_embeds", wave.mm_embeds)
            if sig.takes("rope_positions") and "rope_positions" not in values:
                values["rope_positions"] = rope_positions(wave.rope, values["positions"], values["query_start_loc"],
                                                          values.get("seq_rows"))
        return sig.select(values)

    def add_observer(self, observer) -> None:
        """observer(graph, inputs, outputs) is called after every step-graph call (tests, tracing)."""
        self.observers.append(observer)

    def call(self, graph: str, wave: WaveTables | None = None, profiler: Profiler | None = None, **values):
        """Run step graph `graph` as is (no static buffers)."""
        return self._run(graph, self.callables[graph], self.graph_inputs(graph, values, wave), profiler)

    def prefill(self, graph: str, wave: WaveTables | None, profiler: Profiler | None, **values):
        """A base or draft prefill: through its length-bucketed static buffers when there are some."""
        if graph not in self.static:
            return self.call(graph, wave, profiler, **values)
        return self._run(graph, self.static[graph], self.graph_inputs(graph, values, wave), profiler)

    def step(self, graph: str, n_seq: int, wave: WaveTables | None, profiler: Profiler | None, **values):
        """The draft step or the verify, through static buffers where the model has them."""
        inputs = self.graph_inputs(graph, values, wave)
        if graph not in self.static:
            fn = self.callables[graph]
        else:
            static = self.static[graph]
            fn = lambda **kw: static(n_seq, **kw)  # noqa: E731
        return self._run(graph, fn, inputs, profiler)

    def _run(self, graph: str, fn, inputs: dict, profiler: Profiler | None):
        if profiler is not None and profiler.enabled:
            started = profiler.start()
            out = fn(**inputs)
            profiler.stop(graph, started)
        else:
            out = fn(**inputs)
        for observer in self.observers:
            observer(graph, inputs, out)
        return out
