"""``fp8_amax_scale``: the power-of-two scaling bias that fits a tensor's absolute maximum into
a float8 format."""

from __future__ import annotations

import torch

from ... import dtypes as _dtypes
from ...capture import call_torch
from ...errors import given
from ...ir.tensor import Tensor
from .fp8_utils import float8_143_def, float8_152_def

__all__ = ["fp8_amax_scale"]

# Largest finite values of Graphcore's float8 formats (``fp8_utils``). They are the formats' own
# limits, not those of the OCP formats this simulator stores float8 data in (Note [float8
# encoding] in dtypes.py), so scales match what an IPU program computes.
_FP8_MAX = {
    "float8_143": float(float8_143_def.max_value),
    "float8_152": float(float8_152_def.max_value),
}


def _amax_scale(src: torch.Tensor, fp8_max: float) -> torch.Tensor:
    # float32 throughout: ``fp8_max / amax`` overflows float16 for small amax (57344 / 0.5).
    # Clamping before the cast also defines the all-zero tensor (log2(inf)) as the largest bias.
    amax = src.abs().max().to(torch.float32)
    log2_max = torch.floor(torch.log2(fp8_max / amax))
    return torch.clamp(log2_max, -31.0, 31.0).to(torch.int32)


def fp8_amax_scale(src: Tensor, dtype: _dtypes.dtype = _dtypes.float8_143) -> Tensor:
    """The scaling bias ``clip(floor(log2(fp8_max / max|src|)), -31, 31)`` (an int32 scalar) for
    ``dtype`` (``float8_143``: max 240, or ``float8_152``: max 57344). Pass it as ``log2_scale``
    to ``ops.pow2scale_then_cast``-style casts: ``src * 2**scale`` then fits the format.

    Raises:
        TypeError: ``src`` is not float16 / float32, or ``dtype`` is not a float8 type.
    """
    if not isinstance(src, Tensor):
        raise TypeError(f"fp8_amax_scale expects a popxl Tensor; got {given(src)}.")
    if src.dtype not in (_dtypes.float16, _dtypes.float32):
        raise TypeError(
            f"fp8_amax_scale: src must be float16 or float32; got {src.dtype.name}. Cast it first."
        )
    name = getattr(dtype, "name", None)
    if name not in _FP8_MAX:
        raise TypeError(
            f"fp8_amax_scale: dtype must be popxl.float8_143 or popxl.float8_152; got {dtype!r}."
        )
    return call_torch(_amax_scale, (src, _FP8_MAX[name]), {})
