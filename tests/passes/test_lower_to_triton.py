"""lower_to_triton: op counts before/after, numerics vs the unlowered graph, idempotence, and
the graph left alone (with the reason) when Triton cannot run. Runs the kernels in the interpreter."""
import copy

import pytest
import torch

from conftest import tiny_base, tiny_draft
from eagle_fx.runtime.kv_cache import new_kv_pool
from eagle_fx.capture import capture
from eagle_fx.passes import PassContext, lower_to_triton
from eagle_fx.pipeline import CapturePlan
from tests.passes.snapshot import op_counts

E = "eagle_fx."


def _inputs(gm, T=6, B=2, seed=0, uniform=False):
    """Inputs for any step graph: two sequences of 4 and 2 tokens (uniform: 3 and 3) at positions 0.."""
    g = torch.Generator().manual_seed(seed)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    first = 3 if uniform else 4
    qsl = torch.tensor([0, first, 6])
    pos = torch.cat([torch.arange(first), torch.arange(6 - first)])[None]
    bt = torch.tensor([[0, 1], [2, 3]])
    slots = torch.cat([bt[0, 0] * 4 + torch.arange(first), bt[1, 0] * 4 + torch.arange(6 - first)])
    feat = next((n.meta["val"].shape[-1] for n in gm.graph.nodes if n.target == "features"), 64)
    kw = dict(input_ids=torch.randint(0, 96, (1, T), generator=g), positions=pos, logits_indices=qsl[1:] - 1,
              features=torch.randn(T, feat, generator=g), next_tokens=torch.zeros(B, dtype=torch.long),
              carry_features=torch.randn(B, feat, generator=g), query_start_loc=qsl, slot_mapping=slots,
              block_table=bt)
    return {k: kw[k] for k in names if k in kw}


@pytest.mark.parametrize("arch,method", [("llama", "eagle"), ("qwen3", "eagle3")])
def test_counts_numerics_idempotent(arch, method):
    g = capture(tiny_base(arch), tiny_draft(arch, method), CapturePlan(draft_kv="pool"))
    L = 4
    for name in ("base", "draft_prefill", "draft_step"):
        gm = copy.deepcopy(getattr(g, name))
        before = copy.deepcopy(gm)
        res = lower_to_triton.run(gm, PassContext())
        c0, c1 = op_counts(before), op_counts(res.gm)
        assert c1[E + "cached_attention.default"] == 0
        assert c1[E + "triton_cached_attention.default"] == c0[E + "cached_attention.default"]
        assert c1["aten.rsqrt.default"] == 0 and c1["aten.silu.default"] == 0  # every Llama-form norm and SwiGLU
        if name != "base":
            assert c1[E + "triton_draft_input.default"] == (1 if method == "eagle" else 3)  # fc, or q/k/v
            assert c1["aten.embedding.default"] == 0 and c1["aten.cat.default"] == c0["aten.cat.default"] - 1  # the input concat
        assert res.num_matches == sum(c1[E + op + ".default"] for op in
                                      ("triton_cached_attention", "triton_rmsnorm", "triton_add_rmsnorm", "triton_swiglu",
                                       "triton_draft_input")) + (2 if method == "eagle3" and name != "base" else 0)
        kw = _inputs(before, uniform=name == "draft_step")  # a decode-step graph: the same rows per sequence
        pools = [new_kv_pool(L + 1, 5, 4, 2, 16, torch.float32, "cpu") for _ in range(2)]
        ref = before(**kw, kv_pool=pools[0])
        got = res.gm(**kw, kv_pool=pools[1])
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pools[1], pools[0], rtol=1e-5, atol=1e-5)
        assert lower_to_triton.run(res.gm, PassContext()).num_matches == 0  # idempotent


def test_left_alone_when_triton_cannot_run(monkeypatch):
    g = capture(tiny_base("llama"), tiny_draft("llama", "eagle"), CapturePlan(draft_kv="pool"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gm = copy.deepcopy(g.draft_step)
    before = op_counts(gm)
    res = lower_to_triton.run(gm, PassContext())
    assert res.num_matches == 0 and "Triton kernels need a CUDA device" in res.notes[0]
    assert op_counts(res.gm) == before
