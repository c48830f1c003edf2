"""Remote (streaming-memory) buffers: ``RemoteBuffer`` and ``remote_buffer`` (spec §4.2)."""

from __future__ import annotations

from .. import dtypes as _dtypes
from .context import gcg

__all__ = ["RemoteBuffer", "remote_buffer"]


class RemoteBuffer:
    """An array of ``entries`` slots of ``tensor_shape``/``tensor_dtype`` in streaming memory.

    Every replica has its own private copy of every buffer.
    """

    _id: int  # unique within the Ir, from 1

    def __init__(self, tensor_shape, tensor_dtype, entries: int = 1):
        ir = gcg().ir
        ir._check_mutable()
        self._ir = ir
        self._entries = 1
        self.set_remote_buffer_info(tensor_dtype, tensor_shape, entries)
        self._meta_shape: tuple[int, ...] = ()
        # The shard count of a buffer made by popxl.replica_sharded_buffer; None otherwise.
        self._rts_shard_over: int | None = None
        ids = [b._id for b in ir._remote_buffers]
        self._id = max(ids, default=0) + 1
        ir._remote_buffers.append(self)

    @property
    def _current_ir(self):
        """The Ir the buffer belongs to (upstream's attribute name)."""
        return self._ir

    def set_remote_buffer_info(self, tensor_dtype, tensor_shape, entries: int) -> None:
        """Reset the buffer's tensor dtype, shape and number of entries (all or nothing)."""
        self._ir._check_mutable()
        dt = _dtypes.dtype.as_dtype(tensor_dtype)
        shape = tuple(int(s) for s in tensor_shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"Remote buffer tensor_shape must be non-negative; got {shape}.")
        _check_entries(entries)
        self._tensor_dtype, self._tensor_shape, self._entries = dt, shape, int(entries)

    @property
    def remote_buffer_id(self) -> int:
        return self._id

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        return self._tensor_shape

    @property
    def tensor_dtype(self) -> _dtypes.dtype:
        return self._tensor_dtype

    @property
    def entries(self) -> int:
        return self._entries

    @entries.setter
    def entries(self, value: int) -> None:
        self.set_remote_buffer_info(self._tensor_dtype, self._tensor_shape, value)

    @property
    def meta_shape(self) -> tuple[int, ...]:
        return self._meta_shape

    @meta_shape.setter
    def meta_shape(self, shape) -> None:
        self._meta_shape = tuple(int(s) for s in shape)

    def validate_tensor_matches_buffer(self, t, num_shards: int = 1) -> None:
        shape = self._meta_shape if num_shards != 1 and self._meta_shape else self._tensor_shape
        if tuple(t.shape) != shape or t.dtype != self._tensor_dtype:
            raise ValueError(
                # upstream's message starts with this sentence (its tests match on it)
                f"Tensor does not match buffer. Tensor {t.id!r}: {t.dtype.name}{list(t.shape)}, "
                f"buffer {self!r}: {self._tensor_dtype.name}{list(shape)}."
            )

    def __repr__(self) -> str:
        return (
            f"RemoteBuffer[id={self._id}, shape={self._tensor_shape}, "
            f"dtype={self._tensor_dtype.name}, entries={self._entries}]"
        )

    def __hash__(self) -> int:
        return hash((id(self._ir), self._id))


def _check_entries(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"Entries must be a non-zero, positive integer. Got {value!r} (the number of "
            "tensors the buffer holds)."
        )


def remote_buffer(tensor_shape, tensor_dtype, entries: int = 1) -> RemoteBuffer:
    """Create a remote buffer in the current Ir."""
    return RemoteBuffer(tensor_shape, tensor_dtype, entries)
