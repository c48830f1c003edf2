"""``remote_load``, ``remote_load_``, ``remote_store`` (spec §4.3)."""

from __future__ import annotations

import math

from .. import dtypes as _dtypes
from ..ir.attrs import RemoteTransfer
from ..ir.context import gcg
from ..ir.graph import Op, OpKind
from ..ir.remote_buffer import RemoteBuffer
from ..ir.tensor import Tensor, _fake_like, constant

__all__ = ["remote_load", "remote_load_", "remote_store"]


def _buffer(rb, name: str):
    if not isinstance(rb, RemoteBuffer):
        raise TypeError(f"{name} expects a RemoteBuffer; got {type(rb).__name__}.")
    if rb._ir is not gcg().ir:
        raise ValueError(f"{name}: {rb!r} belongs to another Ir.")
    return rb


_INT32_MAX = 2**31 - 1


def _offset(offset, name: str, rb) -> Tensor:
    """The offset as a 0-d int tensor; a Python int is range-checked against ``rb.entries``."""
    if isinstance(offset, Tensor):
        if offset.rank != 0 or not (offset.dtype.is_int):
            raise ValueError(
                f"{name}: a tensor offset must be a 0-d integer tensor; got {offset.dtype.name}"
                f"{list(offset.shape)}."
            )
        return offset
    if isinstance(offset, float) and math.isnan(offset):
        raise ValueError(
            f"{name}: offset is NaN; expected a non-negative int below {rb.entries} (the entries "
            f"of {rb!r}) or a 0-d int tensor."
        )
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(
            f"{name}: offset must be a non-negative int or a 0-d int tensor; got {offset!r}."
        )
    # Checked as an unbounded Python int, before it becomes a tensor: narrowing first would
    # turn 2**32 into 0 and silently address slot 0.
    if offset >= rb.entries:
        raise ValueError(
            f"{name}: offset {offset} is out of range for {rb!r}; valid offsets are 0 to "
            f"{rb.entries - 1}. Use a smaller offset or create the buffer with more entries."
        )
    # PopXL passes offsets as int32; only a buffer with more than 2**31 entries needs int64.
    dtype = _dtypes.int32 if offset <= _INT32_MAX else _dtypes.int64
    return constant(offset, dtype, "offset")


def remote_load(remote_buffer, offset: int | Tensor, name: str | None = None) -> Tensor:
    """Load slot ``offset`` of this replica's copy of ``remote_buffer``."""
    rb = _buffer(remote_buffer, "remote_load")
    off = _offset(offset, "remote_load", rb)
    graph = gcg()
    out = Tensor._create(
        graph, name or "remote_load", _fake_like(rb.tensor_shape, rb.tensor_dtype), rb.meta_shape
    )
    graph._append_op(
        Op(
            OpKind.REMOTE_LOAD,
            "RemoteLoad",
            (off,),
            (out,),
            RemoteTransfer(rb),
        )
    )
    return out


def remote_load_(remote_buffer, offset: int | Tensor, t: Tensor) -> Tensor:
    """Load slot ``offset`` into ``t`` in place; sets ``t.meta_shape`` to the buffer's."""
    rb = _buffer(remote_buffer, "remote_load_")
    rb.validate_tensor_matches_buffer(t)
    off = _offset(offset, "remote_load_", rb)
    graph = gcg()
    t._meta_shape = rb.meta_shape
    graph._append_op(
        Op(
            OpKind.REMOTE_LOAD_INPLACE,
            "RemoteLoadInplace",
            (t, off),
            (t,),
            RemoteTransfer(rb),
        )
    )
    return t


def remote_store(remote_buffer, offset: int | Tensor, t: Tensor) -> None:
    """Store ``t`` into slot ``offset`` of this replica's copy of ``remote_buffer``."""
    rb = _buffer(remote_buffer, "remote_store")
    if not isinstance(t, Tensor):
        raise TypeError(f"remote_store expects a popxl Tensor to store; got {type(t).__name__}.")
    rb.validate_tensor_matches_buffer(t)
    off = _offset(offset, "remote_store", rb)
    graph = gcg()
    graph._append_op(
        Op(
            OpKind.REMOTE_STORE,
            "RemoteStore",
            (t, off),
            (),
            RemoteTransfer(rb),
        )
    )
