"""``popxl.utils``: host data conversion (``to_numpy``) and float8 host casts."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import dtypes as _dtypes
from .dtypes import np_dtype_float8_143, np_dtype_float8_152

__all__ = [
    "to_numpy",
    "host_pow2scale_then_cast",
    "host_cast_then_pow2scale",
    "np_dtype_float8_143",
    "np_dtype_float8_152",
    "downcast_np_dtypes",
]

# The numpy types `to_numpy` narrows when no dtype is given (upstream's table, by its name).
downcast_np_dtypes: dict[np.dtype, np.dtype] = _dtypes._DOWNCAST

_FLOAT8_BY_NUMPY = {
    np_dtype_float8_143: _dtypes.float8_143,
    np_dtype_float8_152: _dtypes.float8_152,
}


def to_numpy(x: Any, dtype: Any = None, downcast: bool = True, copy: bool = True,
             log2_scale: int | None = None, nan_on_overflow: bool | None = None) -> np.ndarray:  # noqa: A002  # fmt: skip
    """Host data as a C-contiguous numpy array, as PopXL converts ``variable`` data.

    With no ``dtype`` the inferred 64-bit types are downcast to 32 bits (``downcast=True``).
    The result is always a new array (``copy=False`` is accepted and also copies).
    """
    return _dtypes.to_numpy(x, dtype, downcast, log2_scale, nan_on_overflow)


def host_pow2scale_then_cast(src: Any, dtype: Any = None, log2_scale: int = 0,
                             nan_on_overflow: bool = True) -> np.ndarray:  # noqa: A002  # fmt: skip
    """``cast(src * 2**log2_scale, dtype)`` on the host for a float8 ``dtype``.

    Raises:
        RuntimeError: ``src`` is not float32/float64 or ``dtype`` is not a float8 type.
    """
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    src = np.asarray(src, order="C")
    if src.dtype not in (np.float32, np.float64):
        raise RuntimeError(f"src.dtype {src.dtype} not currently supported.")
    if dtype not in (_dtypes.float8_143, _dtypes.float8_152):
        raise RuntimeError(f"dtype {dtype} not currently supported.")
    return _dtypes.to_numpy(src, dtype, log2_scale=log2_scale, nan_on_overflow=nan_on_overflow)


def host_cast_then_pow2scale(src: np.ndarray, dtype: Any = None, log2_scale: int = 0) -> np.ndarray:  # noqa: A002
    """``cast(src, dtype) * 2**log2_scale`` on the host, from float8 data to float32/float64.

    Raises:
        RuntimeError: ``src`` is not float8 data or ``dtype`` is not float32/float64.
    """
    if src.dtype not in _FLOAT8_BY_NUMPY:
        raise RuntimeError(f"src.dtype {src.dtype} not currently supported.")
    if dtype not in (_dtypes.float32, _dtypes.float64):
        raise RuntimeError(f"dtype {dtype} not currently supported.")
    fp8 = _FLOAT8_BY_NUMPY[src.dtype].as_torch()
    raw = torch.from_numpy(np.ascontiguousarray(src).view(np.uint8).copy())
    values = raw.view(fp8).to(torch.float64) * 2.0**log2_scale
    return values.numpy().astype(dtype.as_numpy())
