"""Shape ops: reshape, transpose, flatten, concat, split, squeeze/unsqueeze, casts and detach,
and ``init`` (a new zero tensor). Slicing and gathering are in ``indexing.py``.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterable, Sequence

import torch

from .. import dtypes as _dtypes
from ..capture import call_torch
from ..ir.tensor import Tensor
from ._common import _check_tensor, call_op

__all__ = [
    "reshape", "reshape_", "transpose", "transpose_", "flatten", "flatten_", "concat",
    "concat_", "split", "squeeze", "unsqueeze", "cast", "detach", "detach_", "init"
]  # fmt: skip


# ---- reshape and transpose ----------------------------------------------------------------


def _reshape_target(t: Tensor, shape: Sequence[int], name: str) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if builtins.sum(1 for s in shape if s == -1) > 1:
        raise ValueError(f"{name}: at most one -1 is allowed in the shape; got {shape}.")
    known = math.prod(s for s in shape if s != -1)
    if -1 not in shape and known != t.nelms or (-1 in shape and (known == 0 or t.nelms % known)):
        raise ValueError(
            f"{name}: cannot reshape {t.id!r} of shape {t.shape} ({t.nelms} elements) to "
            f"{shape}; the new shape must hold the same number of elements."
        )
    return shape


def reshape(t: Tensor, shape: Sequence[int]) -> Tensor:
    return call_op(torch.reshape, (t, _reshape_target(t, shape, "reshape")), {})


def reshape_(t: Tensor, shape: Sequence[int]) -> Tensor:
    """The in-place (aliasing) reshape; see Note [reshape_ of a permuted tensor]."""
    shape = _reshape_target(t, shape, "reshape_")
    if _is_viewable(t, shape):
        return call_torch(torch.Tensor.view, (t, shape), {})
    return call_torch(torch.reshape, (t, shape), {})


# Note [reshape_ of a permuted tensor]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Upstream's reshape_ aliases its input whatever the input's layout: Poplar tensors are
# expressions over tile memory, so a reshape of a transposed tensor is still a view. A torch
# view needs strides, which a permuted tensor folded into fewer axes may not have (torch's
# "Cannot view a tensor with shape ... and strides ..."). There the result is a reshaped copy:
# the values are upstream's; in-place writes through the result do not reach the input (GPT-3
# and BERT's attention reshape transposed heads and only read the result).


def _is_viewable(t: Tensor, shape: tuple[int, ...]) -> bool:
    probe = torch.empty_strided(t._fake.shape, t._fake.stride(), device="meta")
    try:
        probe.view(shape)
    except (RuntimeError, ValueError):  # meta tensors raise one, torch's refs the other
        return False
    return True


def _permutation(t: Tensor, permutation: Sequence[int] | None, name: str) -> tuple[int, ...]:
    perm = tuple(reversed(range(t.rank))) if permutation is None else tuple(permutation)
    if sorted(p % t.rank if t.rank else p for p in perm) != list(range(t.rank)):
        raise ValueError(f"{name}: {perm} is not a permutation of the {t.rank} axes of {t.id!r}.")
    return perm


def transpose(t: Tensor, permutation: Sequence[int] | None = None) -> Tensor:
    return call_op(torch.permute, (t, _permutation(t, permutation, "transpose")), {})


def transpose_(t: Tensor, permutation: Sequence[int] | None = None) -> Tensor:
    """The in-place (aliasing) transpose: updates of either side reach the other."""
    return call_torch(torch.permute, (t, _permutation(t, permutation, "transpose_")), {})


def flatten(t: Tensor) -> Tensor:
    return reshape(t, (t.nelms,))


def flatten_(t: Tensor) -> Tensor:
    """The in-place (aliasing) flatten: ``reshape_(t, (t.nelms,))``."""
    return reshape_(t, (t.nelms,))


# ---- concat and split ---------------------------------------------------------------------


def concat(ts: Iterable[Tensor], axis: int = 0) -> Tensor:
    ts = [_check_tensor(t, "concat") for t in ts]
    _check_concat_types(ts)
    return call_op(torch.cat, (ts,), {"dim": axis})


def concat_(ts: Iterable[Tensor], axis: int = 0) -> Tensor:
    """Concatenation whose output aliases its inputs upstream; the values are ``concat``'s."""
    ts = [_check_tensor(t, "concat_") for t in ts]
    _check_concat_types(ts)
    return call_op(torch.cat, (ts,), {"dim": axis})


def _check_concat_types(ts: list[Tensor]) -> None:
    # Upstream raises rather than promoting (torch.cat would promote float16 to float32).
    types = [t.dtype for t in ts]
    if len(set(types)) > 1:
        raise TypeError(
            f"All inputs to a concat operation must have the same type: {types}. Cast them to "
            "one dtype first (ops.cast)."
        )


def split(t: Tensor, splits: int | list[int], axis: int = 0) -> list[Tensor]:
    """Split into ``splits`` equal parts (int) or parts of the listed sizes."""
    size = t.shape[axis]
    if isinstance(splits, int):
        if size % splits:
            raise ValueError(f"split: axis {axis} of size {size} is not divisible by {splits}.")
        sizes = [size // splits] * splits
    else:
        sizes = list(splits)
        if builtins.sum(sizes) != size:
            raise ValueError(f"split: sizes {sizes} do not add up to axis {axis} size {size}.")
    return list(call_op(torch.split, (t, sizes), {"dim": axis}))


def squeeze(t: Tensor, axes: Sequence[int] | None = None) -> Tensor:
    if axes is None:
        return call_op(torch.squeeze, (t,), {})
    return call_op(torch.squeeze, (t, tuple(axes)), {})


def unsqueeze(t: Tensor, axes: Sequence[int]) -> Tensor:
    for ax in sorted(axes):
        t = call_op(torch.unsqueeze, (t, ax), {})
    return t


# ---- dtype, detach, new tensors -----------------------------------------------------------


def cast(t: Tensor, data_type) -> Tensor:
    dt = _dtypes.dtype.as_dtype(data_type)
    return call_op(torch.Tensor.to, (t, dt.as_torch()), {})


def detach(t: Tensor) -> Tensor:
    return call_op(torch.Tensor.detach, (t,), {})


def detach_(t: Tensor) -> Tensor:
    """``detach`` whose output aliases ``t``; gradients do not flow through it."""
    return call_torch(torch.Tensor.detach, (_check_tensor(t, "detach_"),), {})


def init(shape, dtype, name: str | None = None, init_type: str = "zero", meta_shape=None) -> Tensor:
    if init_type not in ("zero", "undef"):
        raise ValueError(f"init_type must be 'zero' or 'undef'; got {init_type!r}.")
    dt = _dtypes.dtype.as_dtype(dtype)
    out = call_op(torch.zeros, (tuple(shape),), {"dtype": dt.as_torch()})
    if meta_shape:
        out._meta_shape = tuple(meta_shape)
    return out
