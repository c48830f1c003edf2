"""``popxl.context``, upstream's module path for graph contexts (gcg, gir, name_scope, ...); defined in ``ir/context.py``."""

from .ir.context import (
    _execution_context,
    gcg,
    get_current_context,
    get_current_graph,
    get_main_graph,
    gir,
    gmg,
    in_sequence,
    io_tiles,
    ipu,
    name_scope,
)

__all__ = [
    "_execution_context",
    "gcg",
    "get_current_context",
    "get_current_graph",
    "get_main_graph",
    "gir",
    "gmg",
    "in_sequence",
    "io_tiles",
    "ipu",
    "name_scope",
]
