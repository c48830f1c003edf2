"""``popxl.graph``, upstream's module path for Graph and Op; defined in ``ir/graph.py``."""

from .ir.graph import Graph, Op, Slot

__all__ = ["Graph", "Op", "Slot"]
