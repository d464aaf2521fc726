"""Capture: torch.export the base and draft step functions, then run the passes of a CapturePlan
(eagle_fx.pipeline says which passes run on which graph; this module only exports and runs them).

Every step graph works on one packed row of tokens (all sequences of the step back to back), so a
ragged batch, a prefill and a k+1-token verify are the same graph at different token counts:

    base:           (input_ids[1,T], positions[1,T], logits_indices[N], <cache inputs>)
                    -> (logits[N,V], features[T,F])
    draft_prefill:  (input_ids, positions, features[T,F], logits_indices, next_tokens[B],
                     query_start_loc, <cache inputs>) -> (logits[N,Vd], hidden[N,H])
                    captured shifted (the draft sees t_1..t_n; the shift is in the graph);
                    CapturePlan(prefill_shift=False) runs drop_prefill_shift on it: tokens unshifted,
                    features shifted right with a new `carry_features[B,F]` input
    draft_extend:   same without the shift (tokens already aligned with features)
    draft_step:     as draft_extend, but the feature is the draft's own output (no EAGLE-3 fc)

<cache inputs> = kv_pool (drafts: draft_kv_pool until alias_draft_kv makes the draft one more layer
of kv_pool), slot_mapping, block_table, query_start_loc (added by insert_kv_cache). A KV-sharing
draft (draft_kv="layer", kv_share=LAYER) reads base layer LAYER from kv_pool and takes spec_kv, spec_rows and
committed_len instead of a slot mapping; its prefill and extend graphs compute only the rows at
logits_indices (prune_draft_rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx.graph import CodeGen

from eagle_fx.model_inputs import select_features
from eagle_fx.multimodal import VisionLanguageBaseStep
from eagle_fx.graph_kinds import CHAIN_GRAPHS, DRAFT_GRAPHS, GRAPH_KINDS, TREE_GRAPHS, FeatureInput
from eagle_fx.passes.fx_graph import copy_graph_module
from eagle_fx.pipeline import CapturePlan, build_pipelines, run_passes


class BaseStep(nn.Module):
    """The base model on packed tokens: logits at `logits_indices`, features at every token."""

    def __init__(self, base: nn.Module, feature_layers: tuple[int, ...] = ()):
        super().__init__()
        self.base = base
        self.feature_layers = tuple(feature_layers)

    def forward(self, input_ids, positions, logits_indices):
        out = self.base(input_ids=input_ids, position_ids=positions, logits_to_keep=logits_indices,
                        output_hidden_states=True, use_cache=False)
        return out.logits[0], select_features(out.hidden_states, self.feature_layers)[0]


def shift_left(input_ids, next_tokens, query_start_loc):
    """The shifted (reference) draft input: t_1..t_n per sequence, the sampled token last."""
    ids = torch.roll(input_ids, -1, dims=1)
    last = query_start_loc[1:] - 1
    return ids.index_put((torch.zeros_like(last), last), next_tokens)


class DraftStep(nn.Module):
    def __init__(self, draft: nn.Module, base_lm_head: nn.Module, shift: bool, project: bool):
        super().__init__()
        self.draft = draft
        self.lm_head = base_lm_head
        self.embed = draft.embed_tokens  # registered here too: a draft borrowing the base's is no module of it
        self.shift = shift
        self.project = project

    def forward(self, input_ids, positions, features, logits_indices, next_tokens, query_start_loc, mm_embeds=None):
        """mm_embeds (vision-language bases): ids >= the vocab size are rows of it (eagle_fx.multimodal)."""
        if self.shift:
            input_ids = shift_left(input_ids, next_tokens, query_start_loc)
        hidden = self.draft.project(features) if self.project else features
        out = self.draft.body(input_ids, positions, hidden[None], mm_embeds=mm_embeds)[0][logits_indices]
        return self.draft.logits(out, self.lm_head), out


@dataclass
class StepGraphs:
    base: GraphModule
    verify: GraphModule
    draft_prefill: GraphModule
    draft_extend: GraphModule
    draft_step: GraphModule
    pass_log: list[str] = field(default_factory=list)
    # draft trees (EAGLE-2): the base and draft-step graphs with tree attention (insert_tree_mask)
    verify_tree: GraphModule | None = None
    draft_tree_step: GraphModule | None = None

    def names(self) -> tuple[str, ...]:
        """The step graphs this capture holds (eagle_fx.graph_kinds' order)."""
        return CHAIN_GRAPHS + (TREE_GRAPHS if self.verify_tree is not None else ())


def strip_export_checks(gm: GraphModule) -> GraphModule:
    """Drop the runtime guard and metadata-assert nodes torch.export leaves, and plain-ify calling."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_function" and n.target == torch.ops.aten._assert_tensor_metadata.default:
            g.erase_node(n)
        elif n.op == "call_module" and n.target == "_guards_fn":
            g.erase_node(n)
    g.set_codegen(CodeGen())
    g.eliminate_dead_code()
    # a fresh GraphModule: only what the graph references, without export's input-spec hooks
    return GraphModule(gm, g, class_name="StepGraph")


def export_graph(module: nn.Module, args: tuple, dynamic_shapes) -> GraphModule:
    with torch.no_grad():
        ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    return strip_export_checks(ep.module())


def _example_inputs(device, t=10, n=3):
    ids = torch.arange(t, device=device)[None] % 7
    pos = torch.arange(t, device=device)[None]
    li = torch.arange(n, device=device)
    qsl = torch.tensor([0, 4, t], device=device)
    return ids, pos, li, qsl


class StepExport(NamedTuple):
    """What torch.export takes to capture one step graph."""

    module: nn.Module
    args: tuple
    dynamic_shapes: tuple


# the draft graph whose step shifts the tokens left (the reference prefill; drop_prefill_shift undoes it)
SHIFTED_DRAFT_GRAPH = "draft_prefill"


def step_exports(base: nn.Module, draft: nn.Module, plan: CapturePlan) -> dict[str, StepExport]:
    """The step module, example inputs and dynamic dims of each graph exported from a module."""
    dev = next(base.parameters()).device
    dtype = next(draft.parameters()).dtype
    T = torch.export.Dim("T", min=1, max=1 << 20)
    N = torch.export.Dim("N", min=1, max=1 << 20)
    B = torch.export.Dim("B", min=1, max=1 << 14)
    M = torch.export.Dim("M", min=1, max=1 << 20)
    ids, pos, li, qsl = _example_inputs(dev)
    if plan.vision_language:
        base_step = VisionLanguageBaseStep(base, draft.aux_layer_ids, mrope=plan.mrope).eval()
        mm_embeds = (torch.zeros(2, base.get_input_embeddings().weight.shape[1], device=dev, dtype=dtype),)
        mm_dims = ({0: M},)
    else:
        base_step = BaseStep(base, draft.aux_layer_ids).eval()
        mm_embeds, mm_dims = (), ()
    rope, rope_dims = ((pos[None].expand(3, 1, -1).contiguous(),), ({2: T},)) if plan.mrope else ((), ())
    exports = {"base": StepExport(base_step, (ids, pos, li) + mm_embeds + rope,
                                  ({1: T}, {1: T}, {0: N}) + mm_dims + rope_dims)}
    features = torch.zeros(ids.shape[1], draft.feature_dim, device=dev, dtype=dtype)
    hidden = torch.zeros(ids.shape[1], draft.config.hidden_size, device=dev, dtype=dtype)
    next_tokens = torch.zeros(2, dtype=torch.long, device=dev)
    lm_head = base.get_output_embeddings()
    for name in DRAFT_GRAPHS:  # a graph fed the base's feature projects it with the draft's fc
        project = GRAPH_KINDS[name].feature_input is FeatureInput.BASE_FEATURE
        step = DraftStep(draft, lm_head, shift=name == SHIFTED_DRAFT_GRAPH, project=project).eval()
        args = (ids, pos, features if project else hidden, li, next_tokens, qsl) + mm_embeds
        exports[name] = StepExport(step, args, ({1: T}, {1: T}, {0: T}, {0: N}, {0: B}, {0: B + 1}) + mm_dims)
    return exports


class ExportedStep(NamedTuple):
    """One exported step graph, before any pass, and the module it was exported from."""

    graph: GraphModule
    module: nn.Module


def export_steps(base: nn.Module, draft: nn.Module, plan: CapturePlan = CapturePlan()) -> dict[str, ExportedStep]:
    """torch.export each step function of `base` + `draft` (most of a capture's time). The result
    depends on the pair and on plan.vision_language / plan.mrope only, and capture never changes
    it (passes run on copies), so one export can serve several plans."""
    return {name: ExportedStep(export_graph(*export), export.module)
            for name, export in step_exports(base, draft, plan).items()}


def capture(base: nn.Module, draft: nn.Module, plan: CapturePlan = CapturePlan(),
            exported: dict[str, ExportedStep] | None = None) -> StepGraphs:
    """Export the step graphs of `base` + `draft` (or take them from `exported`, an export_steps
    result for this pair) and run the passes `plan` asks for on each (eagle_fx.pipeline has the
    table): first every graph's rewrites, in table order (a copy starts from its source's
    rewritten graph), then every graph's lowering."""
    pipelines = build_pipelines(plan, base_layers=base.config.get_text_config().num_hidden_layers)
    if exported is None:
        exported = export_steps(base, draft, plan)
    pass_log: list[str] = []
    contexts, graphs = {}, {}
    for name, pipeline in pipelines.items():
        if pipeline.copy_of is None:
            gm = copy_graph_module(exported[name].graph)
            contexts[name] = replace(pipeline.context, root=exported[name].module)
        else:
            gm = copy_graph_module(graphs[pipeline.copy_of])
            contexts[name] = pipeline.context
        graphs[name] = run_passes(gm, contexts[name], name, pipeline.rewrites, pass_log)
    for name, pipeline in pipelines.items():
        graphs[name] = run_passes(graphs[name], contexts[name], name, pipeline.lowering, pass_log)
    return StepGraphs(**graphs, pass_log=pass_log)
