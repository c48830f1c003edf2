"""``popxl.ops`` names popxl-addons programs use that the rest of ``ops`` did not provide yet:
the float8 power-of-two casts (under SDK 3.4's names and the later ``pow2scale_cast_to_fp8`` /
``pow2scale_cast_from_fp8``), the scaled matmul and convolutions, ``swish_``,
``shaped_dropout`` and ``scatter_reduce`` (upstream: popart python/popxl/python_files/ops/
cast.py, matmul.py, conv.py, swish.py, shaped_dropout.py, scatter_reduce.py).

Note [power-of-two scaling]
    ``log2_scale`` is a scalar int32 tensor read at run time. ``pow2scale_then_cast`` computes
    ``cast(t * 2**log2_scale, float8)`` (a value too large for the format becomes NaN, as
    the host's ``nan_on_overflow`` default), ``cast_then_pow2scale`` ``cast(t, dtype) *
    2**log2_scale`` and ``matmul_pow2scaled`` (``conv_pow2scaled``,
    ``conv_transpose_pow2scaled``) ``(lhs @ rhs) * 2**log2_scale`` in float16 (the IPU's output
    and partials type for float8 matmuls and convolutions). The products are exact powers of two,
    so only the casts round; float8 data is held in torch's formats (Note [float8 encoding]
    in dtypes.py), whose out-of-range conversions torch defines. A scale outside [-32, 32)
    stops the run, as upstream (Note [log2 scale range check] in opdefs/log2_scale.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from .. import dtypes as _dtypes
from ..errors import given
from ..ir.tensor import Tensor, constant
from ..opdefs.log2_scale import checked_log2_scale
from ._common import call_op
from .nn import PadType, conv_function, conv_transpose_function
from .rng import seeded_uniform

__all__ = ["pow2scale_then_cast", "cast_then_pow2scale", "pow2scale_cast_to_fp8",
           "pow2scale_cast_from_fp8", "matmul_pow2scaled", "conv_pow2scaled",
           "conv_transpose_pow2scaled", "swish_", "shaped_dropout", "scatter_reduce"]  # fmt: skip

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
    # The scale is read at run time, and checked then (Note [log2 scale range check]).
    return torch.pow(2.0, checked_log2_scale(scale).to(torch.float32))


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

    def run(x, s):
        return _dtypes.round_to_float8(x.to(torch.float32) * _pow2(s), data_type)

    return call_op(run, (t, scale), {})


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

    return call_op(run, (t, scale), {})


def _scale_and_type(log2_scale, data_type, default: _dtypes.dtype):
    """The later upstream order ``(t, log2_scale, data_type)`` and SDK 3.3's ``(t, data_type,
    log2_scale)`` both name their arguments; a dtype given second is SDK 3.3's. No scale: 0."""
    if isinstance(log2_scale, _dtypes.dtype):
        log2_scale, data_type = data_type if isinstance(data_type, Tensor) else None, log2_scale
    scale = constant(0, _dtypes.int32) if log2_scale is None else _int32_scale(log2_scale)
    return scale, default if data_type is None else data_type


def pow2scale_cast_to_fp8(t: Tensor, log2_scale: Tensor | None = None,
                          data_type: _dtypes.dtype | None = None) -> Tensor:  # fmt: skip
    """``cast(t * 2**log2_scale, data_type)``: ``pow2scale_then_cast`` under its later upstream
    name (``log2_scale`` a scalar int32 tensor, None: no scaling; ``data_type`` float8_143 by
    default)."""
    scale, data_type = _scale_and_type(log2_scale, data_type, _dtypes.float8_143)
    return pow2scale_then_cast(t, scale, data_type)


def pow2scale_cast_from_fp8(t: Tensor, log2_scale: Tensor | None = None,
                            data_type: _dtypes.dtype | None = None) -> Tensor:  # fmt: skip
    """``cast(t, data_type) * 2**log2_scale``: ``cast_then_pow2scale`` under its later
    upstream name (``data_type`` float16 by default)."""
    scale, data_type = _scale_and_type(log2_scale, data_type, _dtypes.float16)
    return cast_then_pow2scale(t, scale, data_type)


def _int32_scale(log2_scale) -> Tensor:
    """Upstream's check of a scaled op's ``log2_scale``: a scalar int32 tensor."""
    if not isinstance(log2_scale, Tensor):
        raise TypeError(
            f"Log2 scale must be a popxl Tensor of type popxl.int32; got {given(log2_scale)}."
        )
    if log2_scale.shape != ():
        raise ValueError(
            f"Log2 scale argument must be a scalar tensor; got shape {tuple(log2_scale.shape)}."
        )
    if log2_scale.dtype != _dtypes.int32:
        raise TypeError(
            f"Log2 scale tensor must be of type popxl.int32; got {log2_scale.dtype.name}."
        )
    return log2_scale


def _float8_operands(op: str, *operands) -> None:
    for x in operands:
        _tensor(x, op, "each operand")
    if any(x.dtype not in _FLOAT8 for x in operands):
        kinds = " and ".join(x.dtype.name for x in operands)
        raise TypeError(
            f"Scaled {op} operands must be of dtype popxl.float8_143 or popxl.float8_152; got "
            f"{kinds}. Cast them with ops.pow2scale_cast_to_fp8."
        )


def _scaled(run):
    """``run`` (a torch function of two operands) on float8 values read exactly in float32,
    scaled by ``2**log2_scale`` and cast to float16 (Note [power-of-two scaling])."""

    def scaled(a, b, s):
        return (run(a.to(torch.float32), b.to(torch.float32)) * _pow2(s)).to(torch.float16)

    return scaled


def matmul_pow2scaled(lhs: Tensor, rhs: Tensor, log2_scale: Tensor,
                      available_memory_proportion: float | None = None) -> Tensor:  # fmt: skip
    """``(lhs @ rhs) * 2**log2_scale`` for float8 operands, as float16 (numpy matmul rules).

    Raises:
        TypeError: an operand is not float8, or ``log2_scale`` is not int32.
        ValueError: ``log2_scale`` is not a scalar.
    """
    _float8_operands("matmul", lhs, rhs)
    scale = _int32_scale(log2_scale)
    # float8 values are exact in float32, and so are their products' partial sums here.
    return call_op(_scaled(torch.matmul), (lhs, rhs, scale), {})


def conv_pow2scaled(t: Tensor, weight: Tensor, log2_scale: Tensor,
                    stride: Sequence[int] | None = None, padding: Sequence[int] | None = None,
                    dilation: Sequence[int] | None = None, groups: int = 1,
                    pad_type: PadType = "not_set", available_memory_proportions=None,
                    enable_conv_dithering=None) -> Tensor:  # fmt: skip
    """``ops.conv`` of float8 ``t`` and ``weight``, scaled by ``2**log2_scale``, as float16.

    Raises:
        TypeError: an operand is not float8, or ``log2_scale`` is not int32.
        ValueError: ``log2_scale`` is not a scalar.
    """
    _float8_operands("conv", t, weight)
    scale = _int32_scale(log2_scale)
    run = conv_function("conv_pow2scaled", t, weight, stride, padding, dilation, groups, pad_type)
    return call_op(_scaled(run), (t, weight, scale), {})


def conv_transpose_pow2scaled(t: Tensor, weight: Tensor, log2_scale: Tensor,
                              stride: Sequence[int] | None = None,
                              padding: Sequence[int] | None = None,
                              dilation: Sequence[int] | None = None, groups: int = 1,
                              pad_type: PadType = "not_set", output_padding: Sequence[int] = (),
                              output_shape: Sequence[int] = (),
                              available_memory_proportions=None,
                              enable_conv_dithering=None) -> Tensor:  # fmt: skip
    """``ops.conv_transpose`` of float8 ``t`` and ``weight``, scaled by ``2**log2_scale``, as
    float16.

    Raises:
        TypeError: an operand is not float8, or ``log2_scale`` is not int32.
        ValueError: ``log2_scale`` is not a scalar.
    """
    _float8_operands("conv transpose", t, weight)
    scale = _int32_scale(log2_scale)
    run = conv_transpose_function("conv_transpose_pow2scaled", t, weight, stride, padding,
                                  dilation, groups, pad_type, output_padding, output_shape)  # fmt: skip
    return call_op(_scaled(run), (t, weight, scale), {})


def swish_(t: Tensor) -> Tensor:
    """``t * sigmoid(t)`` in place; returns ``t`` (an alias)."""
    t = _tensor(t, "swish_")

    def run(x):
        return x.copy_(F.silu(x))

    return call_op(run, (t,), {})


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

    return call_op(run, (t, seed_tensor), {})


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
    return call_op(run, args, {})
