"""mark_uniform_queries and inline_uniform_attention: counts, what is left alone, and numerics
(the marked graph and the inlined graph against the unmarked one on the same uniform inputs)."""
import copy

import torch

from conftest import tiny_base, tiny_draft
from eagle_fx.capture import capture
from eagle_fx.ops.canonical import cached_attention_ref
from eagle_fx.passes import PassContext, batch_invariant, inline_uniform_attention, mark_uniform_queries
from eagle_fx.pipeline import CapturePlan
from eagle_fx.runtime.kv_cache import new_kv_pool

CACHED = torch.ops.eagle_fx.cached_attention.default


def _uniform_inputs(gm, per_seq=3, lens=(7, 11), seed=0):
    """Two sequences, the last per_seq positions of each, blocks of 4."""
    g = torch.Generator().manual_seed(seed)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    T = per_seq * len(lens)
    pos = torch.cat([torch.arange(n - per_seq, n) for n in lens])
    table = torch.tensor([[0, 1, 2], [3, 4, 5]])
    seq = torch.arange(T) // per_seq
    feat = next((n.meta["val"].shape[-1] for n in gm.graph.nodes if n.target == "features"), 64)
    kw = dict(input_ids=torch.randint(0, 96, (1, T), generator=g), positions=pos[None],
              logits_indices=torch.arange(T), features=torch.randn(T, feat, generator=g),
              next_tokens=torch.zeros(2, dtype=torch.long), query_start_loc=torch.arange(3) * per_seq,
              slot_mapping=table[seq, pos // 4] * 4 + pos % 4, block_table=table)
    return {k: kw[k] for k in names if k in kw}


def _marks(gm):
    return [n.kwargs.get("uniform_queries", False) for n in gm.graph.nodes if n.target == CACHED]


def test_marks_and_inlines_the_decode_steps_only():
    graphs = capture(tiny_base("llama"), tiny_draft("llama", "eagle"), CapturePlan(draft_kv="pool"))
    assert _marks(graphs.verify) == [True] * 4 and _marks(graphs.draft_step) == [True] and _marks(graphs.draft_extend) == [True]
    assert _marks(graphs.base) == [False] * 4 and _marks(graphs.draft_prefill) == [False]  # ragged prefill: on the host
    again = mark_uniform_queries.run(copy.deepcopy(graphs.verify))
    assert again.num_matches == 0  # idempotent
    assert inline_uniform_attention.run(copy.deepcopy(graphs.base)).num_matches == 0  # ragged stays an op
    invariant = batch_invariant.run(copy.deepcopy(graphs.base)).gm
    assert mark_uniform_queries.run(invariant).num_matches == 0  # row by row stays on the host

    before = copy.deepcopy(graphs.verify)
    inlined = inline_uniform_attention.run(copy.deepcopy(graphs.verify))
    assert inlined.num_matches == 4
    targets = [n.target for n in inlined.gm.graph.nodes if n.op == "call_function"]
    assert CACHED not in targets and targets.count(cached_attention_ref) == 4

    kw = _uniform_inputs(before)
    pools = [new_kv_pool(5, 6, 4, 2, 16, torch.float32, "cpu") for _ in range(3)]
    for p in pools:
        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    unmarked = copy.deepcopy(before)
    for n in unmarked.graph.nodes:
        if n.target == CACHED:
            n.kwargs = {**n.kwargs, "uniform_queries": False}
    unmarked.recompile()
    ref = unmarked(**kw, kv_pool=pools[0])
    for gm, pool in ((before, pools[1]), (inlined.gm, pools[2])):
        out = gm(**kw, kv_pool=pool)
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(pool, pools[0])  # the same K/V written
    assert mark_uniform_queries.run(copy.deepcopy(unmarked), PassContext()).num_matches == 4  # marks what is unmarked
