"""insert_tree_mask: op counts, and numerics against the model itself on every root-to-node path."""
import pytest
import torch

from conftest import tiny_base
from eagle_fx.runtime.kv_cache import new_kv_pool
from eagle_fx.draft_tree import tree_mask
from eagle_fx.passes import PassContext, canonicalize_attention, insert_kv_cache, insert_tree_mask
from eagle_fx.passes.fx_graph import copy_graph_module
from tests.passes.snapshot import exported_base, op_counts

CACHED = "eagle_fx.cached_attention.default"
TREE = "eagle_fx.tree_cached_attention.default"
# a hand-built tree of 6 nodes under the root: node parents (-1: the root)
PARENTS = [-1, -1, 0, 0, 1, 2]


@pytest.mark.parametrize("arch", ["llama", "mistral_swa", "gemma3"])
def test_counts_and_numerics_per_path(arch):
    step, gm = exported_base(arch)
    gm = canonicalize_attention.run(gm, PassContext(root=step)).gm
    before = copy_graph_module(gm)  # the uncached model
    cached = insert_kv_cache.run(gm, PassContext(root=step)).gm
    res = insert_tree_mask.run(copy_graph_module(cached), PassContext())
    c0, c1 = op_counts(cached), op_counts(res.gm)
    L = tiny_base(arch).config.num_hidden_layers
    assert res.num_matches == L
    assert c0[CACHED] == L and c1[CACHED] == 0 and c1[TREE] == L
    assert c1["placeholder"] == c0["placeholder"] + 2
    assert [n.target for n in res.gm.graph.nodes if n.op == "placeholder"][-2:] == ["tree_mask", "tree_start"]
    assert op_counts(cached)[TREE] == 0  # the chain graph is untouched

    # a context of 11 tokens prefilled through the chain graph, then one tree verify after it
    torch.manual_seed(0)
    bs, ctx_len = 4, 11
    pool = new_kv_pool(L, 8, bs, 2, 16, torch.float32, "cpu")
    table = torch.tensor([[5, 1, 7, 0, 2]])
    ctx = torch.randint(0, 96, (1, ctx_len))
    pos = torch.arange(ctx_len)[None]
    slots = table[0, pos[0] // bs] * bs + pos[0] % bs
    cached(input_ids=ctx, positions=pos, logits_indices=torch.tensor([ctx_len - 1]), kv_pool=pool, slot_mapping=slots,
           block_table=table, query_start_loc=torch.tensor([0, ctx_len]))
    parents = torch.tensor([PARENTS])
    mask = tree_mask(parents)[0]  # [7, 7] over [root, nodes]
    nodes = torch.randint(0, 96, (1, len(PARENTS) + 1))
    depth = mask.sum(-1) - 1
    logical = ctx_len + torch.arange(len(PARENTS) + 1)
    logits, feats = res.gm(input_ids=nodes, positions=(ctx_len + depth)[None], logits_indices=torch.arange(7),
                           kv_pool=pool, slot_mapping=table[0, logical // bs] * bs + logical % bs, block_table=table,
                           query_start_loc=torch.tensor([0, 7]), tree_mask=mask, tree_start=torch.tensor([ctx_len]))
    for i in range(7):
        path = mask[i].nonzero()[:, 0]  # the root, node i's ancestors, node i: in order
        seq = torch.cat([ctx, nodes[:, path]], dim=1)
        ref_logits, ref_feats = before(seq, torch.arange(seq.shape[1])[None], torch.tensor([seq.shape[1] - 1]))
        torch.testing.assert_close(logits[i:i + 1], ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats[i], ref_feats[-1], atol=1e-5, rtol=1e-5)

    assert insert_tree_mask.run(res.gm, PassContext()).num_matches == 0  # idempotent


def test_copy_shares_parameters():
    step, gm = exported_base("llama")
    copy = copy_graph_module(gm)
    assert copy.graph is not gm.graph
    ours = dict(gm.named_parameters())
    for name, p in copy.named_parameters():
        assert p is ours[name]
