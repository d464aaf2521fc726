import copy

import torch

from conftest import tiny_base, tiny_draft
from eagle_fx.capture import capture
from eagle_fx.passes import drop_prefill_shift
from eagle_fx.pipeline import CapturePlan
from tests.passes.snapshot import op_counts

ROLL = "aten.roll.default"
INDEX_PUT = "aten.index_put.default"


def _inputs(n_feat, lens=(6, 4)):
    T = sum(lens)
    qsl = torch.tensor([0, lens[0], T])
    return dict(input_ids=torch.randint(0, 96, (1, T)), positions=torch.cat([torch.arange(n) for n in lens])[None],
                features=torch.randn(T, n_feat), logits_indices=qsl[1:] - 1, query_start_loc=qsl)


def _cache(graphs_from, lens=(6, 4)):
    pool = torch.zeros(1, 2, 8, 4, 2, 16)
    table = torch.tensor([[0, 1], [2, 3]])
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    return dict(draft_kv_pool=pool, block_table=table, slot_mapping=table[seq, pos // 4] * 4 + pos % 4)


def ragged(gm):
    """A copy of a decode-step graph whose attention takes ragged rows again (mark_uniform_queries undone)."""
    gm = copy.deepcopy(gm)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.kwargs.get("uniform_queries"):
            n.kwargs = {**n.kwargs, "uniform_queries": False}
    gm.recompile()
    return gm


def test_counts_numerics_idempotent():
    for method in ("eagle", "eagle3"):
        base, draft = tiny_base("llama"), tiny_draft("llama", method)
        graphs = capture(base, draft, CapturePlan(prefill_shift=True))
        gm = copy.deepcopy(graphs.draft_prefill)
        c0 = op_counts(gm)
        assert c0[ROLL] == 1 and c0[INDEX_PUT] == 1
        res = drop_prefill_shift.run(gm)
        c1 = op_counts(res.gm)
        assert res.num_matches == 1
        assert c1[ROLL] == 1 and c1[INDEX_PUT] == 1  # the roll moved from the tokens to the features
        names = [n.target for n in res.gm.graph.nodes if n.op == "placeholder"]
        assert "carry_features" in names and "next_tokens" not in names
        roll = next(n for n in res.gm.graph.nodes if n.target == torch.ops.aten.roll.default)
        assert roll.args[0].target == "features"

        # numerics: == the unshifted-by-hand input through the (shift-free) extend graph
        x = _inputs(draft.feature_dim)
        carry = torch.randn(2, draft.feature_dim)
        got = res.gm(**x, carry_features=carry, **_cache(None))
        f = x["features"].clone()
        f_shift = torch.cat([carry[0:1], f[0:5], carry[1:2], f[6:9]])
        ref = ragged(graphs.draft_extend)(**{**x, "features": f_shift}, next_tokens=torch.zeros(2, dtype=torch.long), **_cache(None))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert drop_prefill_shift.run(res.gm).num_matches == 0  # idempotent
        assert drop_prefill_shift.run(graphs.draft_extend).num_matches == 0  # nothing to do on an unshifted graph
