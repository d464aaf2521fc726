"""Capture: torch.export the base and draft step functions, then run the capture passes.

Every step graph works on one packed row of tokens (all sequences of the step back to back), so a
ragged batch, a prefill and a k+1-token verify are the same graph at different token counts:

    base:           (input_ids[1,T], positions[1,T], logits_indices[N], <cache inputs>)
                    -> (logits[N,V], features[T,F])
    draft_prefill:  (input_ids, positions, features[T,F], logits_indices, next_tokens[B],
                     query_start_loc, <cache inputs>) -> (logits[N,Vd], hidden[N,H])
                    captured shifted (the draft sees t_1..t_n; the shift is in the graph);
                    prefill_shift=False runs drop_prefill_shift on it: tokens unshifted,
                    features shifted right with a new `carry_features[B,F]` input
    draft_extend:   same without the shift (tokens already aligned with features)
    draft_step:     as draft_extend, but the feature is the draft's own output (no EAGLE-3 fc)

<cache inputs> = kv_pool (drafts: draft_kv_pool until alias_draft_kv makes the draft one more layer
of kv_pool), slot_mapping, block_table, query_start_loc (added by insert_kv_cache). A KV-sharing
draft (kv_share=LAYER) reads base layer LAYER from kv_pool and takes spec_kv, spec_rows and
committed_len instead of a slot mapping; its prefill and extend graphs compute only the rows at
logits_indices (prune_draft_rows).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.fx import GraphModule
from torch.fx.graph import CodeGen

from eagle_fx.drafts import select_features
from eagle_fx.passes import CAPTURE_PASSES, PASSES, PassContext
from eagle_fx.passes.insert_tree_mask import copy_graph_module

log = logging.getLogger("eagle_fx")


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
    draft_prefill: GraphModule
    draft_extend: GraphModule
    draft_step: GraphModule
    pass_log: list[str] = field(default_factory=list)
    # draft trees (EAGLE-2): the base and draft-step graphs with tree attention (insert_tree_mask)
    verify_tree: GraphModule | None = None
    draft_tree_step: GraphModule | None = None

    def names(self) -> tuple[str, ...]:
        """The step graphs this capture holds."""
        return ("base", "draft_prefill", "draft_extend", "draft_step") + (
            ("verify_tree", "draft_tree_step") if self.verify_tree is not None else ())


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


def run_passes(gm: GraphModule, ctx: PassContext, name: str, pass_names, pass_log: list[str],
               expected_layers: int | None = None) -> GraphModule:
    for pass_name in pass_names:
        fn = PASSES[pass_name]
        if pass_name == "canonicalize_attention":
            res = fn(gm, ctx, expected_layers=expected_layers)
        else:
            res = fn(gm, ctx)
        gm = res.gm
        line = f"{name}: {pass_name}: {res}"
        pass_log.append(line)
        log.info(line)
    return gm


def _example_inputs(device, t=10, n=3):
    ids = torch.arange(t, device=device)[None] % 7
    pos = torch.arange(t, device=device)[None]
    li = torch.arange(n, device=device)
    qsl = torch.tensor([0, 4, t], device=device)
    return ids, pos, li, qsl


def capture(base: nn.Module, draft: nn.Module, prefill_shift: bool = False, batch_invariant: bool = False,
            alias_kv: bool = False, kv_share_layer: int | None = None, lower: bool = False,
            tree: bool = False, vision_language: bool = False, mrope: bool = False) -> StepGraphs:
    """alias_kv: the draft's KV becomes one more layer of the base's pool (kv_share="pool");
    kv_share_layer: the draft reads that base layer's K/V and its prefill/extend rows are pruned;
    lower: swap in the Triton kernels (lower_draft_prefill) in every graph; tree: also the
    tree-attention copies of the base and draft-step graphs (verify_tree, draft_tree_step);
    vision_language: the base is an image-text model whose language model is captured, and every
    graph takes mm_embeds (eagle_fx.multimodal); mrope: its base graph also takes rope_positions
    [3, 1, T] (Qwen2-VL's M-RoPE)."""
    dev = next(base.parameters()).device
    T = torch.export.Dim("T", min=1, max=1 << 20)
    N = torch.export.Dim("N", min=1, max=1 << 20)
    B = torch.export.Dim("B", min=1, max=1 << 14)
    ids, pos, li, qsl = _example_inputs(dev)
    pass_log: list[str] = []
    num_layers = base.config.get_text_config().num_hidden_layers

    M = torch.export.Dim("M", min=1, max=1 << 20)
    dtype = next(draft.parameters()).dtype
    mm = (torch.zeros(2, base.get_input_embeddings().weight.shape[1], device=dev, dtype=dtype),) if vision_language else ()
    mm_dyn = ({0: M},) if vision_language else ()
    if vision_language:
        from eagle_fx.multimodal import VisionLanguageBaseStep

        base_step = VisionLanguageBaseStep(base, draft.aux_layer_ids, mrope=mrope).eval()
    else:
        base_step = BaseStep(base, draft.aux_layer_ids).eval()
    rope = (pos[None].expand(3, 1, -1).contiguous(),) if mrope else ()
    gm_base = export_graph(base_step, (ids, pos, li) + mm + rope, ({1: T}, {1: T}, {0: N}) + mm_dyn + (({2: T},) if mrope else ()))
    extra = ("batch_invariant",) if batch_invariant else ()
    gm_base = run_passes(gm_base, PassContext(root=base_step), "base", CAPTURE_PASSES + extra, pass_log, num_layers)

    feats = torch.zeros(ids.shape[1], draft.feature_dim, device=dev, dtype=dtype)
    hidden = torch.zeros(ids.shape[1], draft.config.hidden_size, device=dev, dtype=dtype)
    nxt = torch.zeros(2, dtype=torch.long, device=dev)
    lm_head = base.get_output_embeddings()
    graphs = {}
    for name, shift, project, f in (
        ("draft_prefill", True, True, feats),
        ("draft_extend", False, True, feats),
        ("draft_step", False, False, hidden),
    ):
        step = DraftStep(draft, lm_head, shift, project).eval()
        dyn = ({1: T}, {1: T}, {0: T}, {0: N}, {0: B}, {0: B + 1}) + mm_dyn
        gm = export_graph(step, (ids, pos, f, li, nxt, qsl) + mm, dyn)
        passes = CAPTURE_PASSES + (("drop_prefill_shift",) if name == "draft_prefill" and not prefill_shift else ()) + extra
        passes += ("alias_draft_kv",) if alias_kv or kv_share_layer is not None else ()
        passes += ("prune_draft_rows",) if kv_share_layer is not None and name != "draft_step" else ()
        ctx = PassContext(root=step, pool_name="draft_kv_pool", shared_pool_layer=num_layers,
                          kv_share_layer=kv_share_layer, all_rows_committed=name == "draft_prefill")
        graphs[name] = run_passes(gm, ctx, name, passes, pass_log, 1)
    graphs["base"] = gm_base
    if tree:
        for name, src in (("verify_tree", "base"), ("draft_tree_step", "draft_step")):
            graphs[name] = run_passes(copy_graph_module(graphs[src]), PassContext(), name, ("insert_tree_mask",), pass_log)
    if lower:
        graphs = {name: run_passes(gm, PassContext(), name, ("lower_draft_prefill",), pass_log) for name, gm in graphs.items()}
    return StepGraphs(graphs["base"], graphs["draft_prefill"], graphs["draft_extend"], graphs["draft_step"], pass_log,
                      graphs.get("verify_tree"), graphs.get("draft_tree_step"))
