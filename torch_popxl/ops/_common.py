"""What every ``popxl.ops`` family module checks the same way: that an argument is a popxl
``Tensor``, and how host data on one side of a binary op becomes a constant of the other
side's dtype. One place, so every op words its errors alike."""

from __future__ import annotations

from typing import Any

from ..capture import call_torch
from ..errors import given
from ..ir.tensor import HostTensor, Tensor, constant

# What the binary ops accept on either side: a tensor, or host data made a constant of the
# other side's dtype (``add(t, 1.0)``).
_TensorLike = Tensor | HostTensor


def _coerce(t: Tensor, other) -> Tensor:
    if isinstance(other, Tensor):
        return other
    return constant(other, t.dtype)


def _check_tensor(t, op: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"ops.{op} expects a popxl Tensor; got {given(t)}.")
    return t


def call_op(func, args, kwargs) -> Any:
    """Record one PopXL op: ``func`` run on the handles (``capture.call_torch``), its results
    new tensors even where torch returns a view of an input, as upstream's non-in-place ops
    (TransposeOp, ReshapeOp, SliceOp, ...) make them (Note [views of new tensors] in
    ir/views.py). In-place ops write their input and return it, so they are recorded alike;
    the in-place *view* ops (``transpose_``, ``reshape_``, ``slice_``, ...), whose results
    alias their input, call ``capture.call_torch`` itself."""
    return call_torch(func, args, kwargs, new_tensors=True)
