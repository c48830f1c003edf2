"""``popxl.fp8_utils``: the float8 host conversions under their newer upstream names.

``host_pow2scale_cast_to_fp8`` / ``host_pow2scale_cast_from_fp8`` are
``utils.host_pow2scale_then_cast`` / ``utils.host_cast_then_pow2scale`` that also take or give
float16 (upstream's MSE scale search, ``host_fp8_mse_scale``, is not provided).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import dtypes as _dtypes
from .utils import host_cast_then_pow2scale, host_pow2scale_then_cast

__all__ = ["host_pow2scale_cast_to_fp8", "host_pow2scale_cast_from_fp8"]


def host_pow2scale_cast_to_fp8(src: Any, dtype: Any = None, log2_scale: int = 0,
                               nan_on_overflow: bool = True) -> np.ndarray:  # fmt: skip
    """``cast(src * 2**log2_scale, dtype)`` on the host: float16/32/64 data (numpy or torch)
    to PopXL's numpy float8 representation (``dtype`` float8_143 or float8_152).

    Raises:
        RuntimeError: ``src`` is not float16/32/64 or ``dtype`` is not a float8 type.
    """
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    src = np.asarray(src, order="C")
    if src.dtype == np.float16:
        src = src.astype(np.float32)  # exact: every float16 is a float32
    return host_pow2scale_then_cast(src, dtype, log2_scale, nan_on_overflow)


def host_pow2scale_cast_from_fp8(src: np.ndarray, dtype: Any = None, log2_scale: int = 0) -> np.ndarray:  # fmt: skip
    """``cast(src, dtype) * 2**log2_scale`` on the host: PopXL float8 data to ``dtype``
    float16, float32 or float64.

    Raises:
        RuntimeError: ``src`` is not float8 data or ``dtype`` is not float16/32/64.
    """
    if dtype == _dtypes.float16:
        return host_cast_then_pow2scale(src, _dtypes.float64, log2_scale).astype(np.float16)
    return host_cast_then_pow2scale(src, dtype, log2_scale)
