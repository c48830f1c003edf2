"""Ops about the program rather than values: ``print_tensor`` (a host print at run time, an
identity for values and gradients) and ``remote_code_load`` (where a graph's code lives).
"""

from __future__ import annotations

from ..errors import given
from ..ir.attrs import FLOAT_FORMATS, PrintOptions
from ..ir.context import gcg
from ..ir.graph import Graph
from ..ir.tensor import Tensor
from ..opdefs.print_tensor import record_print
from ._common import _check_tensor

__all__ = ["print_tensor", "remote_code_load"]


# ---- printing -----------------------------------------------------------------------------


def print_tensor(t: Tensor, title: str | None = None, print_self: bool = True,
                 print_gradient: bool = False, summarise_threshold: int = 1000,
                 edge_items: int = 3, max_line_width: int = 75, digits: int = 8,
                 float_format: str = "auto", separator: str = ",", open_bracket: str = "(",
                 close_bracket: str = ")") -> Tensor:  # fmt: skip
    """Print ``t`` to stderr at run time, once per replica, as ``{title}: {values}``; returns
    ``t`` unchanged (an identity for gradients).

    ``title`` defaults to ``print_{t.name}`` as upstream. Floats are printed with ``digits``
    significant digits (``float_format`` "auto", C++ showpoint style: ``0.0000000``), or
    ``digits`` decimals ("fixed", "scientific"), or ``digits`` significant digits without
    trailing zeros ("none"); elements are joined by ``separator`` inside ``open_bracket`` /
    ``close_bracket``, rows wrap at ``max_line_width``, and tensors with more than
    ``summarise_threshold`` elements show ``edge_items`` at each end of every axis.
    With ``print_gradient``, the gradient graph made by ``autodiff`` prints the gradient as
    ``{title}_gradient``.
    """
    graph = gcg()
    _check_tensor(t, "print_tensor")
    if float_format not in FLOAT_FORMATS:
        raise ValueError(
            f"print_tensor: float_format must be one of {', '.join(FLOAT_FORMATS)}; got "
            f"{float_format!r}."
        )
    for name, value in (("summarise_threshold", summarise_threshold), ("edge_items", edge_items),
                        ("max_line_width", max_line_width), ("digits", digits)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"print_tensor: {name} must be a non-negative int; got {value!r}.")
    return record_print(
        graph,
        t,
        PrintOptions(
            title=f"print_{t.name}" if title is None else title,
            print_self=print_self,
            threshold=summarise_threshold,
            edge_items=edge_items,
            line_width=max_line_width,
            digits=digits,
            float_format=float_format,
            separator=separator,
            open_bracket=open_bracket,
            close_bracket=close_bracket,
            print_gradient=print_gradient,
        ),
        t.meta_shape,
    )


# ---- code loading -------------------------------------------------------------------------


# Upstream's code locations (popxl/ops/remote_code_load.py, CODE_LOCATION); only
# "executable" is implemented there, the buffers raise NotImplementedError.
_CODE_LOCATIONS = ("executable", "compute_buffer", "io_buffer")


def remote_code_load(graph: Graph, destination: str) -> None:
    """Load ``graph``'s code from Streaming Memory into ``destination`` ("executable") before
    it is called.

    The simulator keeps all code resident; the load is recorded, and the memory report shows
    the graph's code as kept in streaming memory and loaded on demand (``Code location``).
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"remote_code_load: graph must be a popxl Graph; got {given(graph)}.")
    if destination not in _CODE_LOCATIONS:
        raise ValueError(
            f"Not a valid location: {destination!r}. Must choose from: "
            f"{', '.join(_CODE_LOCATIONS)} (remote_code_load destination)."
        )
    parent = gcg()
    if parent == graph:
        raise ValueError(
            f"The remote_code_load op cannot load the code for the graph it resides in "
            f"({graph.id})."
        )
    if graph.ir is not parent.ir:
        raise ValueError(
            f"remote_code_load: {graph.id!r} belongs to {graph.ir!r}, not to {parent.ir!r} of the "
            "current graph; load a graph of the same Ir."
        )
    if destination != "executable":
        raise NotImplementedError(
            f"destination == '{destination}' for remote_code_load op, graph {graph.id} not "
            "supported (upstream implements only 'executable')."
        )
    parent.ir._check_mutable()
    parent.ir._code_loads.append((parent, graph, destination))
