import copy

import pytest
import torch

from conftest import ARCHS, tiny_base
from eagle_fx.passes import PassContext, canonicalize_attention
from tests.passes.snapshot import exported_base, op_counts

SDPA = "aten.scaled_dot_product_attention.default"
CANON = "eagle_fx.attention.default"


@pytest.mark.parametrize("arch", ARCHS)
def test_counts_and_numerics(arch):
    step, gm = exported_base(arch)
    before = copy.deepcopy(gm)
    layers = tiny_base(arch).config.num_hidden_layers
    c0 = op_counts(gm)
    assert c0[SDPA] == layers and c0[CANON] == 0

    res = canonicalize_attention.run(gm, PassContext(root=step, expected_attention_layers=layers))
    c1 = op_counts(res.gm)
    assert res.num_matches == layers
    assert c1[SDPA] == 0 and c1[CANON] == layers
    assert c1["aten.expand.default"] < c0["aten.expand.default"]  # repeat_kv and the mask subgraph are gone

    windows = [n.args[4] for n in res.gm.graph.nodes if n.target == torch.ops.eagle_fx.attention.default]
    cfg = tiny_base(arch).config
    if arch == "mistral_swa":
        assert windows == [8] * layers
    elif arch == "gemma3":
        assert windows == [8 if t == "sliding_attention" else 0 for t in cfg.layer_types]
    else:
        assert windows == [0] * layers

    ids = torch.randint(0, 96, (1, 20))
    pos = torch.arange(20)[None]
    li = torch.arange(20)
    ref_logits, ref_feat = before(ids, pos, li)
    logits, feat = res.gm(ids, pos, li)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feat, ref_feat, atol=1e-5, rtol=1e-5)

    again = canonicalize_attention.run(res.gm, PassContext(root=step))
    assert again.num_matches == 0  # idempotent


def test_eager_attention_is_a_clear_error():
    from eagle_fx.capture import BaseStep, _example_inputs, export_graph

    step = BaseStep(tiny_base("llama", "eager")).eval()
    ids, pos, li, _ = _example_inputs("cpu")
    gm = export_graph(step, (ids, pos, li), None)
    with pytest.raises(ValueError, match=r"did not match eagle_fx::attention.*attn_implementation='sdpa'"):
        canonicalize_attention.run(gm, PassContext(root=step, expected_attention_layers=4))


def test_missing_layers_is_a_clear_error():
    step, gm = exported_base("llama")
    with pytest.raises(ValueError, match="matched 4 scaled_dot_product_attention op"):
        canonicalize_attention.run(gm, PassContext(root=step, expected_attention_layers=5))


def test_repeat_kv_is_stripped():
    def f(q, k, v):
        kr = k[:, :, None].expand(1, 2, 2, 5, 8).reshape(1, 4, 5, 8)
        vr = v[:, :, None].expand(1, 2, 2, 5, 8).reshape(1, 4, 5, 8)
        return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)

    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    from eagle_fx.capture import export_graph

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return f(q, k, v)

    gm = export_graph(M(), (q, k, v), None)
    res = canonicalize_attention.run(gm)
    node = next(n for n in res.gm.graph.nodes if n.target == torch.ops.eagle_fx.attention.default)
    assert node.args[1].meta["val"].shape[1] == 2  # un-repeated: 2 kv heads
    torch.testing.assert_close(res.gm(q, k, v)[0], f(q, k, v), atol=1e-5, rtol=1e-5)
