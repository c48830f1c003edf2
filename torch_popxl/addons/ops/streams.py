"""``host_load`` / ``host_store`` helpers: a stream and its op in one call."""

from __future__ import annotations

import numpy as np

from ... import dtypes as _dtypes
from ... import ops
from ...ir.streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream
from ...ir.tensor import Tensor

__all__ = ["host_load", "host_store"]


def host_load(t, dtype, name: str) -> tuple[np.ndarray, HostToDeviceStream, Tensor]:
    """``(host array cast to dtype, its h2d stream "<name>_stream", the loaded tensor)``."""
    dt = _dtypes.dtype.as_dtype(dtype)
    data = np.array(t.detach().cpu().numpy() if hasattr(t, "detach") else t).astype(dt.as_numpy())
    stream = h2d_stream(data.shape, dt, name=f"{name}_stream")
    return data, stream, ops.host_load(stream, name)


def host_store(t: Tensor) -> DeviceToHostStream:
    """Stream ``t`` to the host; returns the stream (the key of ``session.run()`` results)."""
    stream = d2h_stream(t.shape, t.dtype, name=f"{t.name}_stream")
    ops.host_store(stream, t)
    return stream
