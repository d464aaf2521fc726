"""mark_uniform_queries and inline_uniform_attention read an attention's flags by name, wherever
the graph passes them: a `uniform_queries` given by position is seen (it was read from the
keywords only: marking added a second value, inlining skipped the node). Oracle: the graph's
result == the op's own, called directly."""
import torch
from torch.fx import Graph, GraphModule

from eagle_fx.ops.canonical import cached_attention_ref
from eagle_fx.passes.fx_graph import op_arguments
from eagle_fx.passes import inline_uniform_attention, mark_uniform_queries


def _inputs():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(1, 2, 5, 4, 2, 8, generator=g)
    table, pos = torch.tensor([[3, 1]]), torch.tensor([[5]])
    slots = table[0, pos[0] // 4] * 4 + pos[0] % 4
    q, k, v = (torch.randn(1, h, 1, 8, generator=g) for h in (4, 2, 2))
    return q, k, v, pool, slots, table, torch.tensor([0, 1]), pos


def _graph(uniform: bool) -> GraphModule:
    """One cached attention with all 13 arguments by position (batch_invariant=False, uniform_queries=uniform)."""
    graph = Graph()
    q, k, v, pool, slots, table, qsl, pos = (graph.placeholder(n) for n in ("q", "k", "v", "pool", "slots", "table",
                                                                              "qsl", "pos"))
    out = graph.call_function(torch.ops.eagle_fx.cached_attention.default,
                              (q, k, v, pool, 0, slots, table, qsl, pos, 0.3, 0, False, uniform))
    graph.output(out)
    return GraphModule(torch.nn.Module(), graph)


def test_positional_uniform_flag_is_marked_in_place():
    gm = _graph(uniform=False)
    assert mark_uniform_queries.run(gm).num_matches == 1
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert op_arguments(node)["uniform_queries"] is True
    assert not (len(node.args) > 12 and "uniform_queries" in node.kwargs)  # one value, not a second one
    inputs = _inputs()
    want_pool, got_pool = inputs[3].clone(), inputs[3].clone()
    want = cached_attention_ref(*inputs[:3], want_pool, 0, *inputs[4:7], inputs[7], 0.3, 0, uniform_queries=True)
    got = gm(*inputs[:3], got_pool, *inputs[4:])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_pool, want_pool)


def test_positional_uniform_flag_is_inlined():
    gm = _graph(uniform=True)
    assert inline_uniform_attention.run(gm).num_matches == 1
    assert any(n.target is cached_attention_ref for n in gm.graph.nodes)
