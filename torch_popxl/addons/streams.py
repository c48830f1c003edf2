"""``InputStreams`` / ``OutputStreams``: named collections of host streams."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ..ir.streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream

__all__ = ["InputStreams", "OutputStreams"]


class _Streams:
    _make: Any = None

    def __init__(self, **streams: tuple[tuple[int, ...], Any]):
        self._streams: dict[str, Any] = {}
        for name, (shape, dtype) in streams.items():
            self._streams[name] = type(self)._make(shape, dtype, name)

    @classmethod
    def from_streams(cls, streams: Iterable[Any]):
        """Wrap existing streams, keyed by ``stream.tensor_id``."""
        new = cls()
        for s in streams:
            new._streams[s.tensor_id] = s
        return new

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._streams[name]
        except KeyError:
            raise AttributeError(f"No stream {name!r}; streams: {list(self._streams)}") from None

    def __getitem__(self, key):
        values = list(self._streams.values())
        if isinstance(key, str):
            return self._streams[key]
        return values[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._streams.values()))

    def __len__(self) -> int:
        return len(self._streams)

    def keys(self):
        return self._streams.keys()

    def items(self):
        return self._streams.items()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._streams)})"


class InputStreams(_Streams):
    """Host-to-device streams: ``InputStreams(x=((8, 28, 28), popxl.float32))``."""

    _make = staticmethod(h2d_stream)
    stream_type = HostToDeviceStream


class OutputStreams(_Streams):
    """Device-to-host streams: ``OutputStreams(loss=((), popxl.float32))``."""

    _make = staticmethod(d2h_stream)
    stream_type = DeviceToHostStream
