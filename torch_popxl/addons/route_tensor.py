"""Graph-nesting helpers of popxl-addons' ``route_tensor`` module."""

from __future__ import annotations

from ..ir.graph import Graph

__all__ = ["is_subgraph"]


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
