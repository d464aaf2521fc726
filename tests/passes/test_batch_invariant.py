import copy

import torch

from conftest import tiny_base
from eagle_fx.runtime.kv_cache import new_kv_pool
from eagle_fx.passes import PassContext, batch_invariant, canonicalize_attention, insert_kv_cache
from eagle_fx.passes.fx_graph import op_arguments
from tests.passes.snapshot import exported_base, op_counts


def test_counts_and_numerics():
    step, gm = exported_base("mistral_swa")
    gm = insert_kv_cache.run(canonicalize_attention.run(gm, PassContext(root=step)).gm).gm
    before = copy.deepcopy(gm)
    c0 = op_counts(gm)
    res = batch_invariant.run(gm)
    c1 = op_counts(res.gm)
    n_lin = c0["aten.linear.default"]
    assert n_lin > 0 and c1["aten.linear.default"] == 0 and c1["eagle_fx.rowwise_linear.default"] == n_lin
    assert res.num_matches == n_lin + 4
    assert all(op_arguments(n)["batch_invariant"] is True for n in res.gm.graph.nodes
               if n.target == torch.ops.eagle_fx.cached_attention.default)

    T = 13
    kw = dict(input_ids=torch.randint(0, 96, (1, T)), positions=torch.arange(T)[None], logits_indices=torch.arange(T),
              slot_mapping=torch.arange(T), block_table=torch.tensor([[0, 1, 2, 3]]), query_start_loc=torch.tensor([0, T]))
    a = before(**kw, kv_pool=new_kv_pool(4, 4, 4, 2, 16, torch.float32, "cpu"))
    b = res.gm(**kw, kv_pool=new_kv_pool(4, 4, 4, 2, 16, torch.float32, "cpu"))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert batch_invariant.run(res.gm).num_matches == 0  # idempotent
    assert tiny_base("mistral_swa").config.sliding_window == 8 and T > 8  # the window is exercised
