"""Available-memory-proportion settings per IPU. The simulator has no tile memory to plan, so the
values are checked and recorded (``ir.available_memory_proportions`` / the graph's) and change no
result."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["set_available_memory_proportion_by_ipu", "set_graph_available_memory_proportion_by_ipu"]


def _check(proportions: Iterable[float]) -> tuple[float, ...]:
    props = tuple(float(p) for p in proportions)
    if not props or any(not 0.0 < p <= 1.0 for p in props):
        raise ValueError(
            f"available memory proportions must be a non-empty list of values in (0, 1], one per IPU; got {props}"
        )
    return props


def set_available_memory_proportion_by_ipu(ir, proportions: Iterable[float]) -> None:
    """Record ``proportions[n]`` as the available memory proportion of ops on IPU ``n``."""
    ir.available_memory_proportions = _check(proportions)


def set_graph_available_memory_proportion_by_ipu(graph, proportions: Iterable[float]) -> None:
    """As ``set_available_memory_proportion_by_ipu`` for the ops of ``graph`` (and its callees)."""
    graph = getattr(graph, "graph", graph)
    graph.available_memory_proportions = _check(proportions)
