"""The capture pipelines: which passes run on which step graph, in which order, with which context.

`CapturePlan` holds the choices that change the step graphs (eagle_fx.compile derives it from its
options); `build_pipelines(plan, base_layers)` turns it into a table {graph name -> GraphPipeline}:

    graph             made from             rewrites (in order)                            lowering
    base              BaseStep              canonicalize_attention, insert_kv_cache,       lower_to_triton
                                            [batch_invariant], [shard_tensor_parallel]
    verify            a copy of base        mark_uniform_queries                           lower_to_triton
    draft_prefill     DraftStep (shifted)   canonicalize_attention, insert_kv_cache,       lower_to_triton
                                            [drop_prefill_shift], [batch_invariant],
                                            [alias_draft_kv], [prune_draft_rows]
    draft_extend      DraftStep             as draft_prefill, without drop_prefill_shift,   lower_to_triton
                                            then mark_uniform_queries
    draft_step        DraftStep (no fc)     as draft_extend, without prune_draft_rows       lower_to_triton
    verify_tree       a copy of base        insert_tree_mask                                lower_to_triton
    draft_tree_step   a copy of draft_step  insert_tree_mask                                lower_to_triton

([...]: per the plan; lowering only with lower_to_triton=True.) The base graph runs the ragged
prefill; `verify` is the same graph with its attention marked uniform (k+1 rows per sequence,
device-side only), as are the draft step (1 row) and the padded draft extend (k+1 rows). Each graph's PassContext is
declared in the table too, so `run_passes` only iterates: every pass is `run(gm, ctx)` and reads
what it needs from the context (canonicalize_attention its expected_attention_layers, the KV
passes their pool settings). `eagle_fx.capture` exports the step modules and runs the table.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from torch.fx import GraphModule

from eagle_fx.draft_kv import DraftKV
from eagle_fx.graph_kinds import DRAFT_GRAPHS, GRAPH_KINDS, TREE_GRAPHS, FeatureInput
from eagle_fx.passes import PASSES, PassContext
from eagle_fx.passes.alias_draft_kv import DRAFT_POOL

log = logging.getLogger("eagle_fx")


@dataclass(frozen=True)
class CapturePlan:
    """What the step graphs are made of.

    prefill_shift: keep the shifted (reference) draft prefill; False runs drop_prefill_shift on it.
    batch_invariant: every token's numerics independent of chunking and batching (batch_invariant).
    draft_kv: where the draft's K/V live (eagle_fx.draft_kv.DraftKV). OWN: a pool of its own (the
        draft_kv_pool input); POOL: one more layer of the base's pool (alias_draft_kv); LAYER: the
        draft reads base layer kv_share_layer's K/V for committed positions (alias_draft_kv, and
        prune_draft_rows on the prefill and extend graphs).
    kv_share_layer: the base layer a LAYER draft reads; None for the other two.
    lower_to_triton: swap in the Triton kernels in every graph (lower_to_triton), last.
    tree: also the tree-attention copies of the base and draft-step graphs (verify_tree,
        draft_tree_step) for EAGLE-2 draft trees.
    vision_language: the base is an image-text model whose language model is captured, and every
        graph takes mm_embeds (eagle_fx.multimodal).
    mrope: the vision-language base graph also takes rope_positions [3, 1, T] (Qwen2-VL's M-RoPE).
    tensor_parallel: (rank, world size); with more than one rank the base graph (and its copies)
        is this rank's shard (shard_tensor_parallel), the draft replicated.
    """

    prefill_shift: bool = False
    batch_invariant: bool = False
    draft_kv: DraftKV = DraftKV.OWN
    kv_share_layer: int | None = None
    lower_to_triton: bool = False
    tree: bool = False
    vision_language: bool = False
    mrope: bool = False
    tensor_parallel: tuple[int, int] = (0, 1)  # (rank, world size): shard_tensor_parallel on the base graph
    tensor_parallel_group: str = ""  # the torch.distributed group of its all-reduces

    def __post_init__(self):
        object.__setattr__(self, "draft_kv", DraftKV.of(self.draft_kv, "CapturePlan"))
        self.draft_kv.check_layer(self.kv_share_layer, "CapturePlan")
        if self.mrope and not self.vision_language:
            raise ValueError("CapturePlan: mrope=True needs vision_language=True (M-RoPE positions come with images)")


@dataclass(frozen=True)
class GraphPipeline:
    """How one step graph is made.

    context: the PassContext every pass of this graph gets (capture fills in `root`, the module the
        graph was exported from; a copy has none).
    rewrites: the passes, in order, that make the step graph.
    lowering: the passes, in order, that swap in backend kernels afterwards.
    copy_of: None: the graph is exported from its step module (eagle_fx.capture); a graph name: it
        starts as a copy of that graph after its rewrites and before its lowering (the table lists
        a source before its copies).
    """

    context: PassContext
    rewrites: tuple[str, ...]
    lowering: tuple[str, ...] = ()
    copy_of: str | None = None


def build_pipelines(plan: CapturePlan, base_layers: int) -> dict[str, GraphPipeline]:
    """The table {graph name -> GraphPipeline} for `plan`, in the order the graphs are made.

    base_layers: the base's number of attention layers (canonicalize_attention checks the base
    graph has that many; the draft's layer goes after them in the base's pool for draft_kv="pool").
    """
    cached_attention = ("canonicalize_attention", "insert_kv_cache")
    batch_invariant = ("batch_invariant",) if plan.batch_invariant else ()
    lowering = ("lower_to_triton",) if plan.lower_to_triton else ()
    shard = ("shard_tensor_parallel",) if plan.tensor_parallel[1] > 1 else ()
    base_context = PassContext(expected_attention_layers=base_layers, tensor_parallel=plan.tensor_parallel,
                               tensor_parallel_group=plan.tensor_parallel_group)
    pipelines = {"base": GraphPipeline(base_context, cached_attention + batch_invariant + shard, lowering),
                 "verify": GraphPipeline(PassContext(), ("mark_uniform_queries",), lowering, copy_of="base")}
    for name in DRAFT_GRAPHS:
        unshift = ("drop_prefill_shift",) if name == "draft_prefill" and not plan.prefill_shift else ()
        alias = ("alias_draft_kv",) if plan.draft_kv is not DraftKV.OWN else ()
        # a sharing draft computes only the rows it uses in the graphs the base's features come in
        prune = ("prune_draft_rows",) if (plan.draft_kv is DraftKV.LAYER and GRAPH_KINDS[name].feature_input
                                          is FeatureInput.BASE_FEATURE) else ()
        context = PassContext(expected_attention_layers=1, pool_name=DRAFT_POOL, shared_pool_layer=base_layers,
                              kv_share_layer=plan.kv_share_layer, all_rows_committed=name == "draft_prefill")
        uniform = ("mark_uniform_queries",) if GRAPH_KINDS[name].uniform_rows else ()
        pipelines[name] = GraphPipeline(context, cached_attention + unshift + batch_invariant + alias + prune + uniform,
                                        lowering)
    if plan.tree:
        for name in TREE_GRAPHS:
            pipelines[name] = GraphPipeline(PassContext(), ("insert_tree_mask",), lowering,
                                            copy_of=GRAPH_KINDS[name].tree_copy_of)
    return pipelines


def run_passes(gm: GraphModule, ctx: PassContext, graph_name: str, pass_names: tuple[str, ...],
               pass_log: list[str]) -> GraphModule:
    """Run `pass_names` on gm in order, each with ctx; log one line per pass with its match count."""
    for pass_name in pass_names:
        result = PASSES[pass_name](gm, ctx)
        gm = result.gm
        line = f"{graph_name}: {pass_name}: {result}"
        pass_log.append(line)
        log.info(line)
    return gm
