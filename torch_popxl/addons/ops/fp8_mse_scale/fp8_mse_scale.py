"""``fp8_mse_scale``: the power-of-two scaling bias that loses least when casting a tensor to a
float8 format, searched on the device (Note [float8 MSE scale] in ``popxl.fp8_utils``)."""

from __future__ import annotations

from functools import partial

import torch

from .... import dtypes as _dtypes
from ....capture import call_torch
from ....errors import given
from ....fp8_utils import float8_143_def, float8_152_def, mse_scale_search
from ....ir.tensor import Tensor

__all__ = ["fp8_mse_scale"]

_DEST = {"float8_143": float8_143_def, "float8_152": float8_152_def}
_SRC_MANTISSA_BITS = {"float32": 23, "float16": 10}


def _scale(x: torch.Tensor, dest, mantissa_bits: int) -> torch.Tensor:
    return mse_scale_search(x, dest, mantissa_bits)[1]


def fp8_mse_scale(src: Tensor, dtype: _dtypes.dtype = _dtypes.float8_143) -> Tensor:
    """The scaling bias (an int32 scalar) that minimises the squared error of
    ``cast(src * 2**bias, dtype)``, as ``popxl.fp8_utils.host_fp8_mse_scale`` finds it on the host.
    Pass it as ``log2_scale`` to ``ops.pow2scale_cast_to_fp8``.

    Raises:
        RuntimeError: ``src`` is not float16 / float32 (upstream's error type).
        TypeError: ``src`` is not a Tensor, or ``dtype`` is not a float8 type.
    """
    if not isinstance(src, Tensor):
        raise TypeError(f"fp8_mse_scale expects a popxl Tensor; got {given(src)}.")
    if src.dtype.name not in _SRC_MANTISSA_BITS:
        raise RuntimeError(
            f"fp8_mse_scale: dtype {src.dtype.name} not currently supported; src must be float16 "
            "or float32. Cast it first."
        )
    dest = _DEST.get(str(getattr(dtype, "name", "")))
    if dest is None:
        raise TypeError(
            f"fp8_mse_scale: dtype must be popxl.float8_143 or popxl.float8_152; got {dtype!r}."
        )
    fn = partial(_scale, dest=dest, mantissa_bits=_SRC_MANTISSA_BITS[src.dtype.name])
    return call_torch(fn, (src,), {})
