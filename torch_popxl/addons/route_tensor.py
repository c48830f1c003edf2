"""Graph-nesting helpers of popxl-addons' ``route_tensor`` module: ``is_subgraph`` and
``route_tensor_into_graph`` (reach a parent graph's tensor from a graph it calls, directly or
through other calls and repeats, by threading it in as a new graph input at every call site on
the way)."""

from __future__ import annotations

from dataclasses import replace

from ..errors import given
from ..ir.context import gcg
from ..ir.graph import Graph, Op, OpKind
from ..ir.tensor import Tensor, graph_input

__all__ = ["route_tensor_into_graph", "is_subgraph"]

_CALLS = (OpKind.CALL, OpKind.REPEAT)


def is_subgraph(parent: Graph, subgraph: Graph) -> bool:
    """Whether ``subgraph`` is ``parent`` or is called (directly or through other calls) from it."""
    parent = getattr(parent, "graph", parent)  # accept GraphWithNamedArgs too
    subgraph = getattr(subgraph, "graph", subgraph)
    stack, seen = [parent], set()
    while stack:
        g = stack.pop()
        if g is subgraph:
            return True
        if id(g) not in seen:
            seen.add(id(g))
            stack.extend(g.called_graphs)
    return False


def route_tensor_into_graph(
    tensor: Tensor, graph: Graph | None = None, modified: bool = False
) -> Tensor:
    """``tensor`` as seen from ``graph`` (default: the current graph).

    If ``tensor`` belongs to a graph that calls ``graph`` (directly, or through calls and
    repeats in between), every graph on those call paths gains one graph input for it and
    every call site on the paths passes it on; the input of ``graph`` is returned. A tensor
    already in ``graph`` is returned as it is, and routing the same tensor twice reuses the
    inputs made the first time. With ``modified=True`` the new inputs are by reference, so
    in-place updates made in ``graph`` reach ``tensor``.

    Raises:
        ValueError: ``graph`` is not called from ``tensor``'s graph, or one of the graphs on
            the way is also called from a graph that cannot see ``tensor`` (its call site
            there would lack the new input). Nothing is changed then.
        TypeError: ``modified`` is not a bool (upstream's region lists are PopART objects).
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"route_tensor_into_graph expects a popxl Tensor; got {given(tensor)}.")
    if not isinstance(modified, bool):
        raise TypeError(
            "route_tensor_into_graph: modified must be True or False (the whole tensor); got "
            f"{type(modified).__name__}. Region lists are not supported."
        )
    graph = gcg() if graph is None else getattr(graph, "graph", graph)
    if tensor._graph is graph:
        return tensor
    source = tensor._graph
    if not is_subgraph(source, graph):
        raise ValueError(
            f"{tensor.id!r} is not in the graph {graph.name!r}. Additionally, the tensor is not in "
            "a known parent graph so cannot be moved into the graph: its graph "
            f"{source.name!r} does not call {graph.name!r}, directly or through other graphs."
        )
    on_path = _graphs_between(source, graph)
    _check_call_sites(source, on_path, graph)

    # Route outwards-in: each graph on the way gets its input from its callers' inputs.
    held: dict[int, Tensor] = {id(source): tensor}
    for g in _topological(source, on_path):
        for i, op in enumerate(list(g._ops)):
            if op.kind not in _CALLS or id(op.attrs.graph) not in on_path:
                continue
            callee = op.attrs.graph
            outer = held[id(g)]
            inner = held.get(id(callee))
            if inner is None:
                inner = _existing_input(op, outer)
            if inner is None:
                with callee:
                    inner = graph_input(tensor.shape, tensor.dtype, tensor.name, by_ref=modified,
                                        meta_shape=tensor.meta_shape)  # fmt: skip
            if modified:
                callee._by_ref.add(inner.id)
            callee._version += 1
            held[id(callee)] = inner
            g._replace_op(i, _connected(op, outer, inner, modified))
    return held[id(graph)]


def _graphs_between(source: Graph, target: Graph) -> set[int]:
    """Ids of the graphs called (transitively) from ``source`` that call or are ``target``."""
    reach: dict[int, bool] = {}

    def reaches(g: Graph) -> bool:
        if id(g) not in reach:
            reach[id(g)] = False  # a call cycle cannot help reaching the target
            # Visit every callee (no short-circuit): each one that reaches the target is on a path.
            callees = [reaches(c) for c in g.called_graphs]
            reach[id(g)] = g is target or any(callees)
        return reach[id(g)]

    reaches(source)
    return {gid for gid, ok in reach.items() if ok and gid != id(source)}


def _topological(source: Graph, on_path: set[int]) -> list[Graph]:
    """``source`` and the graphs of ``on_path``, every caller before its callees."""
    order: list[Graph] = []
    seen: set[int] = set()

    def visit(g: Graph) -> None:
        if id(g) in seen:
            return
        seen.add(id(g))
        for c in g.called_graphs:
            if id(c) in on_path:
                visit(c)
        order.append(g)

    visit(source)
    return order[::-1]


def _check_call_sites(source: Graph, on_path: set[int], target: Graph) -> None:
    allowed = on_path | {id(source)}
    for g in source.ir.graphs:
        for op in g.ops:
            if op.kind in _CALLS and id(op.attrs.graph) in on_path and id(g) not in allowed:
                raise ValueError(
                    f"route_tensor_into_graph: {op.attrs.graph.name!r} (on the way from "
                    f"{source.name!r} to {target.name!r}) is also called from {g.name!r}, which "
                    "cannot see the tensor, so that call site would lack the new input. Pass the "
                    "tensor as an ordinary graph input instead."
                )


def _existing_input(op: Op, outer: Tensor) -> Tensor | None:
    # The call already passes the tensor: reuse the callee input it feeds.
    callee = op.attrs.graph
    for i, t in enumerate(op.inputs[: len(callee._inputs)]):
        if t is outer:
            return callee._inputs[i]
    return None


def _connected(op: Op, outer: Tensor, inner: Tensor, modified: bool) -> Op:
    callee = op.attrs.graph
    index = callee._inputs.index(inner)
    inputs = op.inputs
    if index == len(inputs):
        inputs = (*inputs, outer)
    elif index > len(inputs) or inputs[index] is not outer:
        raise AssertionError(f"{op.name}: input {index} of {callee.id} is connected elsewhere")
    attrs = op.attrs
    if modified:
        attrs = replace(attrs, modified=attrs.modified | {index})
    return replace(op, inputs=inputs, attrs=attrs)
