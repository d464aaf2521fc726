"""eagle_fx.pipeline: the pass table per plan, its contexts, and the plan's own consistency checks."""
import pytest

from eagle_fx.passes import PASSES
from eagle_fx.pipeline import CapturePlan, build_pipelines

CACHED = ("canonicalize_attention", "insert_kv_cache")


def _rewrites(plan, base_layers=4):
    return {name: p.rewrites for name, p in build_pipelines(plan, base_layers).items()}


def test_default_plan():
    pipelines = build_pipelines(CapturePlan(), base_layers=4)
    assert list(pipelines) == ["base", "verify", "draft_prefill", "draft_extend", "draft_step"]
    uniform = ("mark_uniform_queries",)
    assert {name: p.rewrites for name, p in pipelines.items()} == {
        "base": CACHED, "verify": uniform, "draft_prefill": CACHED + ("drop_prefill_shift",),
        "draft_extend": CACHED + uniform, "draft_step": CACHED + uniform}
    assert pipelines["verify"].copy_of == "base"  # the base graph, its attention marked uniform
    assert all(p.lowering == () and p.copy_of is None for name, p in pipelines.items() if name != "verify")
    assert pipelines["base"].context.expected_attention_layers == 4 and pipelines["base"].context.pool_name == "kv_pool"
    for name in ("draft_prefill", "draft_extend", "draft_step"):
        ctx = pipelines[name].context
        assert (ctx.expected_attention_layers, ctx.pool_name, ctx.shared_pool_layer, ctx.kv_share_layer) == \
            (1, "draft_kv_pool", 4, None)
        assert ctx.all_rows_committed == (name == "draft_prefill")


def test_every_choice():
    got = _rewrites(CapturePlan(prefill_shift=True, batch_invariant=True, draft_kv="pool"))
    assert got["base"] == CACHED + ("batch_invariant",)
    assert got["draft_prefill"] == CACHED + ("batch_invariant", "alias_draft_kv")
    assert got["draft_step"] == CACHED + ("batch_invariant", "alias_draft_kv", "mark_uniform_queries")

    got = _rewrites(CapturePlan(batch_invariant=True, draft_kv="layer", kv_share_layer=2))
    assert got["draft_prefill"] == CACHED + ("drop_prefill_shift", "batch_invariant", "alias_draft_kv", "prune_draft_rows")
    assert got["draft_extend"] == CACHED + ("batch_invariant", "alias_draft_kv", "prune_draft_rows",
                                            "mark_uniform_queries")
    assert got["draft_step"] == CACHED + ("batch_invariant", "alias_draft_kv", "mark_uniform_queries")
    assert build_pipelines(CapturePlan(draft_kv="layer", kv_share_layer=2), 4)["draft_step"].context.kv_share_layer == 2


def test_tree_and_lowering():
    pipelines = build_pipelines(CapturePlan(tree=True, lower_to_triton=True), base_layers=4)
    assert list(pipelines)[-2:] == ["verify_tree", "draft_tree_step"]
    assert pipelines["verify_tree"].copy_of == "base" and pipelines["draft_tree_step"].copy_of == "draft_step"
    assert pipelines["verify_tree"].rewrites == ("insert_tree_mask",)
    assert all(p.lowering == ("lower_to_triton",) for p in pipelines.values())
    names = list(pipelines)
    assert all(names.index(p.copy_of) < names.index(name) for name, p in pipelines.items() if p.copy_of)
    assert all(step in PASSES for p in pipelines.values() for step in p.rewrites + p.lowering)


@pytest.mark.parametrize("fields,match", [(dict(draft_kv="shared"), "choose from"),
                                          (dict(draft_kv="layer"), "kv_share_layer=None"),
                                          (dict(draft_kv="pool", kv_share_layer=3), "kv_share_layer=3"),
                                          (dict(mrope=True), "vision_language")])
def test_plan_refuses_inconsistent_choices(fields, match):
    with pytest.raises(ValueError, match=match):
        CapturePlan(**fields)
