"""``popxl.streams``, upstream's module path for host streams; defined in ``ir/streams.py``."""

from .ir.streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream

__all__ = ["DeviceToHostStream", "HostToDeviceStream", "d2h_stream", "h2d_stream"]
