"""FX graph helpers the passes (and capture) share: graph inputs, copies, and op arguments read and
written by name. Not a pass: nothing here is in the registry."""
from __future__ import annotations

from torch.fx import Graph, GraphModule, Node


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


def op_arguments(node: Node) -> dict:
    """{argument name: value} of a call to a torch op (an OpOverload), by its schema: positional and
    keyword arguments alike, defaults filled in. The one place passes read op arguments."""
    arguments = node.target._schema.arguments
    names = [a.name for a in arguments]
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        raise ValueError(f"eagle_fx: {node.name} calls {node.target} with arguments its schema does not have "
                         f"({len(node.args)} positional, keywords {sorted(node.kwargs)}; schema {names})")
    values = {}
    for i, a in enumerate(arguments):
        if i < len(node.args):
            values[a.name] = node.args[i]
        elif a.name in node.kwargs:
            values[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            values[a.name] = a.default_value
        else:
            raise ValueError(f"eagle_fx: {node.name} calls {node.target} without its argument {a.name!r}")
    return values


def op_call_args(op, values: dict) -> tuple[tuple, dict]:
    """(args, kwargs) that call `op` with `values` ({name: value}, names from its schema): the
    arguments without a default positionally, those with one by keyword (left out at the default)."""
    arguments = op._schema.arguments
    unknown = set(values) - {a.name for a in arguments}
    if unknown:
        raise ValueError(f"eagle_fx: {op} has no argument(s) {sorted(unknown)}")
    args, kwargs = [], {}
    for a in arguments:
        if not a.has_default_value():
            if a.name not in values:
                raise ValueError(f"eagle_fx: {op} needs its argument {a.name!r}")
            args.append(values[a.name])
        elif a.name in values and values[a.name] != a.default_value:
            kwargs[a.name] = values[a.name]
    return tuple(args), kwargs


def call_op(graph: Graph, op, values: dict) -> Node:
    """A new call_function node of `op` with `values` by name (op_call_args)."""
    args, kwargs = op_call_args(op, values)
    return graph.call_function(op, args, kwargs)


def set_op_arguments(node: Node, **changes) -> None:
    """Change some of an op call's arguments, by name; the others stay as they are."""
    node.args, node.kwargs = op_call_args(node.target, op_arguments(node) | changes)
