"""Typed attribute records of IR ops, one per ``OpKind`` (frozen: edit with ``replace``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .graph import Graph
    from .remote_buffer import RemoteBuffer
    from .streams import DeviceToHostStream, HostToDeviceStream

__all__ = ["CallSite", "HostTransfer", "PrintOptions", "RemoteTransfer", "TorchCall"]


@dataclass(frozen=True, slots=True)
class TorchCall:
    """A captured aten / ``torch_popxl`` op: ``target(*args, **kwargs)`` with ``Slot``
    placeholders for the tensor inputs; ``out_paths[i]`` locates output i in the result."""

    target: Any  # torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    out_paths: tuple[tuple[int, ...], ...]

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


@dataclass(frozen=True, slots=True)
class PrintOptions:
    title: str
    print_self: bool
    threshold: int
    edge_items: int
    line_width: int
    digits: int
