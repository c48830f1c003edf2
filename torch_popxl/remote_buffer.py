"""``popxl.remote_buffer``, upstream's module path for remote buffers; defined in ``ir/remote_buffer.py``."""

from .ir.remote_buffer import RemoteBuffer, remote_buffer

__all__ = ["RemoteBuffer", "remote_buffer"]
