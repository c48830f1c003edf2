"""Host streams: ``h2d_stream`` / ``d2h_stream`` and their handles."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from .. import dtypes as _dtypes
from .context import gcg
from .tensor import TensorSpec

if TYPE_CHECKING:
    from .ir import Ir

__all__ = ["HostToDeviceStream", "DeviceToHostStream", "h2d_stream", "d2h_stream"]


class _Stream:
    _direction = "stream"
    _factory: ClassVar[str]  # the public factory's name, set by each subclass

    # Set by ``_create`` (streams are built with ``object.__new__``, never ``__init__``).
    _ir: Ir
    _spec: TensorSpec
    _name: str
    _used: bool  # True once a host_load / host_store uses the stream
    _index: int  # position in the Ir's list of streams of this direction

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} cannot be constructed directly; use popxl.{self._factory}."
        )

    @classmethod
    def _create(cls, ir, shape, dtype, name, index: int):
        s = object.__new__(cls)
        s._ir = ir
        s._spec = TensorSpec(shape, _dtypes.dtype.as_dtype(dtype))
        s._name = name
        s._used = False
        s._index = index
        return s

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> _dtypes.dtype:
        return self._spec.dtype

    @property
    def spec(self) -> TensorSpec:
        return self._spec

    @property
    def tensor_id(self) -> str:
        return self._name

    def __hash__(self):
        return hash((self._name, id(self._ir)))

    def __eq__(self, other):
        return isinstance(other, _Stream) and other._name == self._name and other._ir is self._ir

    def __str__(self):
        return f"{type(self).__name__} Tensor[{self._name} {self.dtype.name} {self.shape}]"

    __repr__ = __str__


class HostToDeviceStream(_Stream):
    _factory = "h2d_stream"


class DeviceToHostStream(_Stream):
    _factory = "d2h_stream"


def _unique(existing: Iterable[_Stream], name: str, tensor_ids=()) -> str:
    """``name``, or ``name__t<k>`` if a stream or a main-graph tensor (``tensor_ids``) has it:
    upstream's streams are main-graph tensors, so the two share one namespace."""
    names = {s._name for s in existing} | set(tensor_ids)
    if name not in names:
        return name
    for k in itertools.count(1):
        candidate = f"{name}__t{k}"
        if candidate not in names:
            return candidate
    raise AssertionError("unreachable")


def _new_stream(cls, shape, dtype, name: str | None):
    """Create a stream of ``cls`` in the current Ir (its main graph), with a unique name."""
    ir = gcg().ir
    ir._check_mutable()
    registry = ir._h2d_streams if cls is HostToDeviceStream else ir._d2h_streams
    unique_name = _unique([*ir._h2d_streams, *ir._d2h_streams], name or cls._factory,
                          ir.main_graph._tensors)  # fmt: skip
    s = cls._create(ir, shape, dtype, unique_name, len(registry))
    registry.append(s)
    return s


def h2d_stream(shape, dtype, name: str | None = None) -> HostToDeviceStream:
    """A host-to-device stream (always created in the main graph of the current Ir)."""
    return _new_stream(HostToDeviceStream, shape, dtype, name)


def d2h_stream(shape, dtype, name: str | None = None) -> DeviceToHostStream:
    """A device-to-host stream (always created in the main graph of the current Ir)."""
    return _new_stream(DeviceToHostStream, shape, dtype, name)
