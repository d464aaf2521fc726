import copy

import pytest
import torch

from conftest import tiny_base
from eagle_fx.runtime.kv_cache import new_kv_pool
from eagle_fx.passes import PassContext, canonicalize_attention, insert_kv_cache
from tests.passes.snapshot import exported_base, op_counts

CANON = "eagle_fx.attention.default"
CACHED = "eagle_fx.cached_attention.default"


@pytest.mark.parametrize("arch", ["llama", "mistral_swa", "gemma3"])
def test_counts_and_numerics(arch):
    step, gm = exported_base(arch)
    gm = canonicalize_attention.run(gm, PassContext(root=step)).gm
    before = copy.deepcopy(gm)
    c0 = op_counts(gm)
    res = insert_kv_cache.run(gm, PassContext(root=step))
    c1 = op_counts(res.gm)
    L = tiny_base(arch).config.num_hidden_layers
    assert res.num_matches == L
    assert c0[CANON] == L and c1[CANON] == 0 and c1[CACHED] == L
    assert c1["placeholder"] == c0["placeholder"] + 4
    names = [n.target for n in res.gm.graph.nodes if n.op == "placeholder"]
    assert names[-4:] == ["kv_pool", "slot_mapping", "block_table", "query_start_loc"]
    layers = [n.args[4] for n in res.gm.graph.nodes if n.target == torch.ops.eagle_fx.cached_attention.default]
    assert layers == list(range(L))

    # numerics: two sequences packed in one row, scattered blocks, == the uncached graph per sequence
    bs = 4
    pool = new_kv_pool(L + 2, 16, bs, 2, 16, torch.float32, "cpu")  # two spare layers, never written
    lens = [11, 6]
    ids = torch.randint(0, 96, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    table = torch.tensor([[5, 1, 9], [3, 12, 0]])
    seq = torch.tensor([0] * 11 + [1] * 6)
    slots = table[seq, pos[0] // bs] * bs + pos[0] % bs
    qsl = torch.tensor([0, 11, 17])
    li = torch.arange(17)
    logits, feat = res.gm(input_ids=ids, positions=pos, logits_indices=li, kv_pool=pool, slot_mapping=slots,
                          block_table=table, query_start_loc=qsl)
    for s, (a, b) in enumerate([(0, 11), (11, 17)]):
        ref_logits, ref_feat = before(ids[:, a:b], pos[:, a:b], torch.arange(b - a))
        torch.testing.assert_close(logits[a:b], ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feat[a:b], ref_feat, atol=1e-5, rtol=1e-5)
    assert all(pool[layer].abs().sum() > 0 for layer in range(L)) and pool[L:].abs().sum() == 0  # layers 0..L-1

    assert insert_kv_cache.run(res.gm, PassContext()).num_matches == 0  # idempotent


def test_needs_positions_input():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    from eagle_fx.capture import export_graph

    x = torch.randn(1, 2, 5, 8)
    gm = canonicalize_attention.run(export_graph(M(), (x, x, x), None)).gm
    with pytest.raises(ValueError, match="no input named 'positions'"):
        insert_kv_cache.run(gm)
