"""``popxl.ops`` names popxl-addons programs use that the rest of ``ops`` did not provide yet:
the float8 power-of-two casts and scaled matmul, ``swish_``, ``shaped_dropout`` and
``scatter_reduce`` (upstream: popart python/popxl/python_files/ops/cast.py, matmul.py,
swish.py, shaped_dropout.py, scatter_reduce.py).

Note [power-of-two scaling]
    ``log2_scale`` is a scalar int32 tensor read at run time. ``pow2scale_then_cast`` computes
    ``cast(t * 2**log2_scale, float8)``, ``cast_then_pow2scale`` ``cast(t, dtype) *
    2**log2_scale`` and ``matmul_pow2scaled`` ``(lhs @ rhs) * 2**log2_scale`` in float16 (the
    IPU's output and partials type for float8 matmuls). The products are exact powers of two,
    so only the casts round; float8 data is held in torch's formats (Note [float8 encoding]
    in dtypes.py), whose out-of-range conversions torch defines.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn.functional as F

from .. import dtypes as _dtypes
from ..capture import call_torch
from ..errors import given
from ..ir.tensor import Tensor, constant
from .rng import seeded_uniform

__all__ = ["pow2scale_then_cast", "cast_then_pow2scale", "pow2scale_cast_to_fp8",
           "pow2scale_cast_from_fp8", "matmul_pow2scaled", "swish_", "shaped_dropout",
           "scatter_reduce"]  # fmt: skip

_FLOAT8 = (_dtypes.float8_143, _dtypes.float8_152)


def _tensor(t, op: str, what: str = "t") -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"ops.{op}: {what} must be a popxl Tensor; got {given(t)}.")
    return t


def _scale(log2_scale, op: str) -> Tensor:
    log2_scale = _tensor(log2_scale, op, "log2_scale")
    if log2_scale.shape != ():
        raise ValueError(
            f"ops.{op}: log2_scale must be a scalar tensor; got shape {tuple(log2_scale.shape)}."
        )
    if log2_scale.dtype not in (_dtypes.int8, _dtypes.int16, _dtypes.int32):
        raise TypeError(
            f"ops.{op}: log2_scale must be an int32 tensor; got {log2_scale.dtype.name}."
        )
    return log2_scale


def _pow2(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, scale.to(torch.float32))


def pow2scale_then_cast(t: Tensor, log2_scale: Tensor, data_type: _dtypes.dtype) -> Tensor:
    """``cast(t * 2**log2_scale, data_type)`` for ``data_type`` float8_143 / float8_152 (see
    Note [power-of-two scaling]).

    Raises:
        TypeError: ``data_type`` is not a float8 type, or ``log2_scale`` is not an integer.
        ValueError: ``log2_scale`` is not a scalar.
    """
    t = _tensor(t, "pow2scale_then_cast")
    scale = _scale(log2_scale, "pow2scale_then_cast")
    if data_type not in _FLOAT8:
        raise TypeError(
            f"ops.pow2scale_then_cast: data_type must be float8_143 or float8_152; got {data_type!r}."
        )
    target = data_type.as_torch()

    def run(x, s):
        return (x.to(torch.float32) * _pow2(s)).to(target)

    return call_torch(run, (t, scale), {})


def cast_then_pow2scale(t: Tensor, log2_scale: Tensor, data_type: _dtypes.dtype) -> Tensor:
    """``cast(t, data_type) * 2**log2_scale`` from float8 data to float16 / float32.

    Raises:
        TypeError: ``data_type`` is not float16 / float32, ``t`` is not float8 data, or
            ``log2_scale`` is not an integer.
        ValueError: ``log2_scale`` is not a scalar.
    """
    t = _tensor(t, "cast_then_pow2scale")
    scale = _scale(log2_scale, "cast_then_pow2scale")
    if data_type not in (_dtypes.float16, _dtypes.float32):
        raise TypeError(
            f"ops.cast_then_pow2scale: data_type must be float16 or float32; got {data_type!r}."
        )
    if t.dtype not in _FLOAT8:
        raise TypeError(f"ops.cast_then_pow2scale: t must be float8 data; got {t.dtype.name}.")
    target = data_type.as_torch()

    def run(x, s):
        return (x.to(torch.float32) * _pow2(s)).to(target)

    return call_torch(run, (t, scale), {})


def _zero_scale(log2_scale: Tensor | None) -> Tensor:
    return constant(0, _dtypes.int32) if log2_scale is None else log2_scale


def pow2scale_cast_to_fp8(t: Tensor, data_type: _dtypes.dtype = _dtypes.float8_143,
                          log2_scale: Tensor | None = None) -> Tensor:  # fmt: skip
    """SDK 3.3's name for ``pow2scale_then_cast`` (``log2_scale`` None: no scaling)."""
    return pow2scale_then_cast(t, _zero_scale(log2_scale), data_type)


def pow2scale_cast_from_fp8(t: Tensor, data_type: _dtypes.dtype = _dtypes.float16,
                            log2_scale: Tensor | None = None) -> Tensor:  # fmt: skip
    """SDK 3.3's name for ``cast_then_pow2scale`` (``log2_scale`` None: no scaling)."""
    return cast_then_pow2scale(t, _zero_scale(log2_scale), data_type)


def matmul_pow2scaled(lhs: Tensor, rhs: Tensor, log2_scale: Tensor,
                      available_memory_proportion: float | None = None) -> Tensor:  # fmt: skip
    """``(lhs @ rhs) * 2**log2_scale`` for float8 operands, as float16 (numpy matmul rules).

    Raises:
        TypeError: an operand is not float8, or ``log2_scale`` is not int32.
        ValueError: ``log2_scale`` is not a scalar.
    """
    lhs, rhs = _tensor(lhs, "matmul_pow2scaled", "lhs"), _tensor(rhs, "matmul_pow2scaled", "rhs")
    if lhs.dtype not in _FLOAT8 or rhs.dtype not in _FLOAT8:
        raise TypeError(
            "Scaled matmul operands must be of dtype popxl.float8_143 or popxl.float8_152; got "
            f"{lhs.dtype.name} and {rhs.dtype.name}. Cast them with ops.pow2scale_then_cast."
        )
    if log2_scale.shape != ():
        raise ValueError(
            f"Log2 scale argument must be a scalar tensor; got shape {tuple(log2_scale.shape)}."
        )
    if log2_scale.dtype != _dtypes.int32:
        raise TypeError(
            f"Log2 scale tensor must be of type popxl.int32; got {log2_scale.dtype.name}."
        )

    def run(a, b, s):
        # float8 values are exact in float32, and so are their products' partial sums here.
        out = torch.matmul(a.to(torch.float32), b.to(torch.float32)) * _pow2(s)
        return out.to(torch.float16)

    return call_torch(run, (lhs, rhs, log2_scale), {})


def swish_(t: Tensor) -> Tensor:
    """``t * sigmoid(t)`` in place; returns ``t`` (an alias)."""
    t = _tensor(t, "swish_")

    def run(x):
        return x.copy_(F.silu(x))

    return call_torch(run, (t,), {})


def shaped_dropout(t: Tensor, seed_tensor: Tensor, shape: Iterable[int], ratio: float) -> Tensor:
    """Dropout whose keep-mask has ``shape`` (broadcast to ``t``), so whole features are
    dropped together; kept values are scaled by ``1 / (1 - ratio)``. As ``ops.dropout``, the
    mask is a function of ``seed_tensor`` (uint32[2]) alone (Note [samples come from the
    seed] in ``rng.py``).

    Raises:
        ValueError: ``ratio`` outside [0, 1), or ``shape`` not broadcastable to ``t``.
        TypeError: ``seed_tensor`` is not a uint32[2] tensor.
    """
    t = _tensor(t, "shaped_dropout")
    seed_tensor = _tensor(seed_tensor, "shaped_dropout", "seed_tensor")
    if seed_tensor.dtype != _dtypes.uint32 or tuple(seed_tensor.shape) != (2,):
        raise TypeError(
            "ops.shaped_dropout: seed_tensor must be uint32 of shape (2,); got "
            f"{seed_tensor.dtype.name}{list(seed_tensor.shape)}."
        )
    if not 0.0 <= float(ratio) < 1.0:
        raise ValueError(f"ops.shaped_dropout: ratio must be in [0, 1); got {ratio}.")
    shape = tuple(int(d) for d in shape)
    try:
        if torch.broadcast_shapes(shape, tuple(t.shape)) != tuple(t.shape):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"ops.shaped_dropout: the mask shape {shape} must broadcast to the input shape "
            f"{tuple(t.shape)}."
        ) from None
    keep = 1.0 - float(ratio)

    def run(x, seed):
        mask = seeded_uniform(seed, shape).to(x.device) < keep
        return x * mask.to(x.dtype) / keep

    return call_torch(run, (t, seed_tensor), {})


_REDUCE = {"sum": "sum", "max": "amax", "min": "amin", "none": None}


def scatter_reduce(data: Tensor, indices: Tensor, reduction: Literal["sum", "min", "max", "none"],
                   initial_values: Tensor | None = None, axis: int = 0, axis_size: int | None = None,
                   available_memory_proportion: float | None = None) -> Tensor:  # fmt: skip
    """Reduce slices of ``data`` into an output whose ``axis`` has ``axis_size`` entries:
    ``out[..., indices[i], ...] = reduce(..., data[..., i, ...])``. ``indices`` is 1-D (one
    index per slice of ``data`` along ``axis``) or has ``data``'s shape. The output starts as
    ``initial_values`` (which take part in the reduction) or as zeros (entries no index
    reaches stay 0). ``"none"`` writes the slices (with repeated indices one of them wins).

    Raises:
        ValueError: neither ``initial_values`` nor ``axis_size`` given; an unknown
            ``reduction``; ``indices`` of another shape.
    """
    data = _tensor(data, "scatter_reduce", "data")
    indices = _tensor(indices, "scatter_reduce", "indices")
    if initial_values is None and axis_size is None:
        raise ValueError("One of initial_values and axis_size must be specified")
    if reduction not in _REDUCE:
        raise ValueError(f"The reduction must be one of {list(_REDUCE)}; got {reduction!r}.")
    axis = axis % data.rank
    if axis_size is None:
        assert initial_values is not None  # checked above
        axis_size = initial_values.shape[axis]
    out_shape = (*data.shape[:axis], int(axis_size), *data.shape[axis + 1 :])
    if initial_values is not None and tuple(initial_values.shape) != out_shape:
        raise ValueError(
            f"ops.scatter_reduce: initial_values must have shape {out_shape}; got "
            f"{tuple(initial_values.shape)}."
        )
    if indices.rank == 1:
        if indices.shape[0] != data.shape[axis]:
            raise ValueError(
                f"ops.scatter_reduce: 1-D indices need one index per slice of data along axis "
                f"{axis} ({data.shape[axis]}); got {indices.shape[0]}."
            )
    elif tuple(indices.shape) != tuple(data.shape):
        raise ValueError(
            f"ops.scatter_reduce: indices must be 1-D or have data's shape {tuple(data.shape)}; "
            f"got {tuple(indices.shape)}."
        )
    mode = _REDUCE[reduction]

    def run(src, idx, *init):
        idx = idx.to(torch.int64)
        if idx.dim() == 1:
            view = [1] * src.dim()
            view[axis] = -1
            idx = idx.reshape(view).expand(src.shape)
        base = init[0] if init else torch.zeros(out_shape, dtype=src.dtype, device=src.device)
        if mode is None:
            return base.scatter(axis, idx, src)
        return base.scatter_reduce(axis, idx, src, mode, include_self=bool(init))

    args = (data, indices) if initial_values is None else (data, indices, initial_values)
    return call_torch(run, args, {})
