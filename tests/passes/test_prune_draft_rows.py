"""prune_draft_rows: op counts, numerics vs the unpruned graph on the rows used, FLOPs flat in T."""
import copy

import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_base
from eagle_fx.capture import capture
from eagle_fx.drafts import new_draft
from eagle_fx.passes import PassContext, alias_draft_kv, prune_draft_rows
from eagle_fx.pipeline import CapturePlan
from tests.passes.snapshot import op_counts

L, KVH, D, BS = 4, 2, 16, 4


def _graphs(method="eagle", layer=3):
    base = tiny_base("llama")
    draft = new_draft(base, method, seed=5, kv_share=layer)
    g = capture(base, draft)  # drafts with their own pool: the state before kv_share
    out = {}
    for name in ("draft_prefill", "draft_extend"):
        gm = copy.deepcopy(getattr(g, name))
        for n in gm.graph.nodes:  # the pipeline aliases before mark_uniform_queries; these inputs are ragged
            if n.op == "call_function" and n.kwargs.get("uniform_queries"):
                n.kwargs = {**n.kwargs, "uniform_queries": False}
        ctx = PassContext(kv_share_layer=layer, all_rows_committed=name == "draft_prefill")
        out[name] = alias_draft_kv.run(gm, ctx).gm
    return draft, out


def _inputs(lens, starts, draft, committed_extra=0, seed=0):
    """Two sequences with cached prefixes: seq s holds positions starts[s] .. starts[s]+lens[s]-1."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    qsl = torch.tensor([0] + lens).cumsum(0)
    pos = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens)])
    last = qsl[1:] - 1
    nb = 64 // BS
    return dict(input_ids=torch.randint(0, 96, (1, T), generator=g), positions=pos[None],
                features=torch.randn(T, draft.feature_dim, generator=g), logits_indices=last, query_start_loc=qsl,
                carry_features=torch.randn(len(lens), draft.feature_dim, generator=g),
                block_table=torch.arange(2 * nb).view(2, nb), spec_rows=torch.tensor([1, 0]),
                committed_len=pos[last] + committed_extra,
                kv_pool=torch.randn(L, 2, 2 * nb, BS, KVH, D, generator=g))


def _run(gm, kw):
    """Call a step graph with the inputs it declares."""
    kw = {**kw, "next_tokens": torch.zeros(2, dtype=torch.long)}
    return gm(**{n.target: kw[n.target] for n in gm.graph.nodes if n.op == "placeholder"})


def _ring():
    return torch.zeros(2, 2, 3, KVH, D)


def test_extend_counts_numerics_idempotent():
    draft, graphs = _graphs()
    gm = graphs["draft_extend"]
    before = copy.deepcopy(gm)
    res = prune_draft_rows.run(gm, PassContext())
    assert res.num_matches == 1
    c0, c1 = op_counts(before), op_counts(res.gm)
    assert c0["aten.index.Tensor"] == 1 and c1["aten.index.Tensor"] == 0  # the final out[logits_indices] is gone
    assert c1["aten.index_select.default"] == 3  # input_ids, positions, features gathered
    assert c1["aten.linear.default"] == c0["aten.linear.default"]  # same ops, fewer rows

    kw = _inputs([5, 3], [10, 4], draft)  # only each sequence's last row is uncommitted (the bonus)
    ring_ref, ring_got = _ring(), _ring()
    ref = _run(before, {**kw, "spec_kv": ring_ref})
    got = _run(res.gm, {**kw, "spec_kv": ring_got})
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ring_got, ring_ref, rtol=1e-5, atol=1e-6)
    assert ring_ref.abs().sum() > 0  # the bonus rows' k/v went into the ring
    assert prune_draft_rows.run(res.gm, PassContext()).num_matches == 0  # idempotent


def _flops(gm, kw):
    with FlopCounterMode(display=False) as fc:
        _run(gm, kw)
    return fc.get_total_flops()


def test_prefill_has_no_kv_projections_and_flat_flops():
    draft, graphs = _graphs("eagle3", layer=1)
    gm = graphs["draft_prefill"]
    names = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert not any("k_proj" in n or "v_proj" in n for n in names)  # removed as dead code (every row committed)
    assert any("q_proj" in n for n in names)
    before = copy.deepcopy(gm)
    res = prune_draft_rows.run(gm, PassContext())
    assert res.num_matches == 1
    short = _inputs([6, 4], [0, 0], draft, committed_extra=1)
    long = _inputs([60, 40], [0, 0], draft, committed_extra=1)
    for kw in (short, long):
        ref = _run(before, {**kw, "spec_kv": _ring()})
        got = _run(res.gm, {**kw, "spec_kv": _ring()})
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert _flops(res.gm, {**short, "spec_kv": _ring()}) == _flops(res.gm, {**long, "spec_kv": _ring()})
    assert _flops(before, {**long, "spec_kv": _ring()}) > 9 * _flops(before, {**short, "spec_kv": _ring()})


def test_left_alone_without_shared_attention():
    base = tiny_base("llama")
    g = capture(base, new_draft(base, "eagle", seed=5), CapturePlan(draft_kv="pool"))
    res = prune_draft_rows.run(copy.deepcopy(g.draft_extend), PassContext())
    assert res.num_matches == 0 and "cannot be pruned" in res.notes[0]
