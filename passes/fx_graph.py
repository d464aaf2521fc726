"""FX graph helpers the passes (and capture) share. Not a pass: nothing here is in the registry."""
from __future__ import annotations

from torch.fx import Graph, GraphModule


def graph_input(gm: GraphModule, name: str, create: bool = True):
    """The placeholder called `name`, appended after the existing inputs if missing."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        if n.target == name:
            return n
    if not create:
        raise ValueError(f"eagle_fx: graph has no input named {name!r} (inputs: {[n.target for n in placeholders]})")
    anchor = placeholders[-1] if placeholders else None
    ctx = gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before(None)
    with ctx:
        return gm.graph.placeholder(name)


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A new GraphModule over a copy of gm's graph that shares gm's parameters and buffers."""
    g = Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return GraphModule(gm, g, class_name=type(gm).__name__)
