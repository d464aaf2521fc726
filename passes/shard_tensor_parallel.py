"""shard_tensor_parallel: the base's step graph, one rank's share of it (Megatron-style).

Before (each decoder layer, Llama-style projections):

    q = linear(x, Wq); k = linear(x, Wk); v = linear(x, Wv)       # H, KVH heads
    o = linear(cached_attention(q, k, v, kv_pool, ...), Wo)
    y = linear(silu(linear(h, Wg)) * linear(h, Wu), Wd)

After, on rank r of N:

    q = linear(x, Wq[r]); k = linear(x, Wk[r]); v = linear(x, Wv[r])   # H/N, KVH/N heads: column-parallel
    o = all_reduce(linear(cached_attention(q, k, v, kv_pool_r, ...), Wo[:, r]))   # row-parallel
    y = all_reduce(linear(silu(linear(h, Wg[r])) * linear(h, Wu[r]), Wd[:, r]))

The all-reduces are torch.distributed's functional collectives (`_c10d_functional.all_reduce` +
`wait_tensor`), so the graph stays one traceable, compilable graph. Row-parallel biases are added
once, after the reduction. Head reshapes use -1 in Hugging Face's code, so they follow the
narrower projections; the KV pool input is per rank (KVH/N heads), sized by the runtime.
Everything else (embedding, norms, lm_head) is replicated: every rank computes the same logits,
so every rank accepts the same tokens. Projections are found by their module names; a base
without Llama-style q/k/v/o and gate/up/down projections is an error that names what it has.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from .result import PassContext, PassResult

aten = torch.ops.aten
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def _projection(node: Node) -> str | None:
    """The projection a linear node computes ('q_proj', ...), from the module it was traced in."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return str(path).rsplit(".", 1)[-1]


def run(gm: GraphModule, ctx: PassContext | None = None) -> PassResult:
    ctx = ctx or PassContext()
    rank, world = ctx.tensor_parallel
    if world == 1:
        return PassResult(gm, 0, ["world size 1: nothing to shard"])
    graph = gm.graph
    linears = [n for n in graph.nodes if n.op == "call_function" and n.target == aten.linear.default]
    kinds = {n: _projection(n) for n in linears}
    found = {k for k in kinds.values() if k in COLUMN + ROW}
    if found != set(COLUMN + ROW):
        seen = sorted({k for k in kinds.values() if k})
        raise ValueError(f"shard_tensor_parallel: tensor_parallel needs Llama-style projections {COLUMN + ROW}; this "
                         f"base's linear layers are {seen} (fused or other projections are not sharded yet)")
    matches = 0
    for node in linears:
        kind = kinds[node]
        if kind not in COLUMN + ROW:
            continue
        weight_node = node.args[1]
        bias_node = node.args[2] if len(node.args) > 2 else None
        if weight_node.op != "get_attr":
            raise ValueError(f"shard_tensor_parallel: {kind} at {node.name} reads its weight from {weight_node.op}, "
                             "not a module attribute")
        weight = operator.attrgetter(weight_node.target)(gm)
        dim = 0 if kind in COLUMN else 1
        size = weight.shape[dim]
        if size % world:
            raise ValueError(f"shard_tensor_parallel: {kind} ({weight_node.target}) has {size} "
                             f"{'output' if dim == 0 else 'input'} features, not divisible by tensor_parallel={world}")
        part = size // world
        shard = weight.narrow(dim, rank * part, part).detach().clone()
        name = f"tp_{weight_node.target.replace('.', '_')}"
        gm.register_buffer(name, shard)
        with graph.inserting_before(node):
            w = graph.get_attr(name)
            if kind in COLUMN:
                args = [node.args[0], w]
                if bias_node is not None:
                    bias = operator.attrgetter(bias_node.target)(gm)
                    gm.register_buffer(f"{name}_bias", bias.narrow(0, rank * part, part).detach().clone())
                    args.append(graph.get_attr(f"{name}_bias"))
                new = graph.call_function(aten.linear.default, tuple(args))
            else:
                partial = graph.call_function(aten.linear.default, (node.args[0], w))
                reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default,
                                              (partial, "sum", ctx.tensor_parallel_group))
                new = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
                if bias_node is not None:
                    new = graph.call_function(aten.add.Tensor, (new, bias_node))
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}  # a narrower output than the traced one
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        matches += 1
    graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return PassResult(gm, matches, [f"rank {rank} of {world}"])
