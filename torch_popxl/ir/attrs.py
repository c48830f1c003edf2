"""Typed attribute records of IR ops, one per ``OpKind`` (frozen: edit with ``replace``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .graph import Graph
    from .remote_buffer import RemoteBuffer
    from .streams import DeviceToHostStream, HostToDeviceStream

__all__ = ["CallSite", "HostTransfer", "PrintOptions", "RemoteTransfer", "TorchCall"]


@dataclass(frozen=True, slots=True)
class TorchCall:
    """A captured aten / ``torch_popxl`` op: ``target(*args, **kwargs)`` with ``Slot``
    placeholders for the tensor inputs; ``out_paths[i]`` locates output i in the result;
    ``no_grad``: the captured code ran it under ``torch.no_grad()`` (Note [no_grad in captured
    code], capture.py); ``new_tensors``: a view op recorded for one of PopXL's non-in-place
    ops, whose results are new tensors though torch returns views (Note [views of new tensors]
    in ir/views.py)."""

    target: Any  # torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    out_paths: tuple[tuple[int, ...], ...]
    no_grad: bool = False
    new_tensors: bool = False

    def argument(self, name: str) -> Any:
        """The value of the schema argument ``name`` (positional, keyword or default)."""
        for i, arg in enumerate(self.target._schema.arguments):
            if arg.name != name:
                continue
            if i < len(self.args):
                return self.args[i]
            if name in self.kwargs:
                return self.kwargs[name]
            if arg.has_default_value():
                return arg.default_value
            break
        raise KeyError(f"{self.target} has no argument {name!r} in this call.")


@dataclass(frozen=True, slots=True)
class CallSite:
    """A call (``repeat_count`` 1) or repeat of ``graph``; ``modified`` are the callee input
    indices the caller lets it write."""

    graph: Graph
    modified: frozenset[int]
    repeat_count: int = 1


@dataclass(frozen=True, slots=True)
class HostTransfer:
    stream: HostToDeviceStream | DeviceToHostStream


@dataclass(frozen=True, slots=True)
class RemoteTransfer:
    buffer: RemoteBuffer


FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")


@dataclass(frozen=True, slots=True)
class PrintOptions:
    """How ``ops.print_tensor`` prints (upstream's PrintTensorFmt options)."""

    title: str
    print_self: bool
    threshold: int
    edge_items: int
    line_width: int
    digits: int
    float_format: str = "auto"
    separator: str = ","
    open_bracket: str = "("
    close_bracket: str = ")"
    print_gradient: bool = False

    def format(self, values) -> str:
        """``values`` (a numpy array) as nested brackets of formatted elements; tensors with
        more than ``threshold`` elements show ``edge_items`` at each end of every axis."""
        arr = np.asarray(values)
        summarise = arr.size > self.threshold
        element = self._element_formatter(arr.dtype)

        def rec(a, depth: int) -> str:
            if a.ndim == 0:
                return element(a.item())
            n = a.shape[0]
            edge = self.edge_items
            rows: list[int | None] = list(range(n))
            if summarise and n > 2 * edge:
                rows = [*range(edge), None, *range(n - edge, n)]
            parts = ["..." if i is None else rec(a[i], depth + 1) for i in rows]
            if a.ndim > 1:
                body = (self.separator + "\n" + " " * (depth + 1)).join(parts)
            else:
                body = self._wrap(parts, depth + 1)
            return self.open_bracket + body + self.close_bracket

        return rec(arr, 0)

    def _element_formatter(self, dtype):
        kind = dtype.kind
        if kind == "b":
            return lambda v: "true" if v else "false"
        if kind in "iu":
            return lambda v: str(int(v))
        d = self.digits
        return {
            "auto": lambda v: f"{v:#.{d}g}",
            "fixed": lambda v: f"{v:.{d}f}",
            "scientific": lambda v: f"{v:.{d}e}",
            "none": lambda v: f"{v:.{d}g}",
        }[self.float_format]

    def _wrap(self, parts: list[str], indent: int) -> str:
        # break a row of elements before it passes line_width, continuing one column in
        lines, line = [], ""
        for i, p in enumerate(parts):
            piece = p + (self.separator if i < len(parts) - 1 else "")
            if line and indent + len(line) + len(piece) > self.line_width:
                lines.append(line)
                line = ""
            line += piece
        lines.append(line)
        return ("\n" + " " * indent).join(lines)
