"""4-bit group quantisation (FlexGen, arXiv:2303.06865): each row is cut into groups of
``group_size`` values; a group stores ``round((x - min) / scale)`` in 4 bits with
``scale = (max - min) / 15``, four codes packed per uint16, first code in the high nibble.
Decompression is ``code * scale + bias`` with ``bias = min``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ....capture import call_torch
from ....ir.tensor import Tensor

__all__ = [
    "group_quantize_decompress",
    "group_quantize_decompress_numpy",
    "group_quantize_compress_numpy",
]

_SHIFTS = (12, 8, 4, 0)  # nibble k of a packed word is code 4 * i + k


def group_quantize_compress_numpy(
    t: np.ndarray, group_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compress float16 ``t`` ``(rows, cols)`` into ``(packed uint16 (rows, groups,
    group_size // 4), scale (rows, groups, 1), bias (rows, groups, 1))``, float16 statistics."""
    t = np.asarray(t)
    if t.ndim != 2 or group_size <= 0 or group_size % 4 or t.shape[1] % group_size:
        raise ValueError(
            f"group_quantize_compress_numpy: t must be 2-D with columns divisible by group_size, and "
            f"group_size a positive multiple of 4; got shape {t.shape}, group_size={group_size}"
        )
    if not np.isfinite(t).all():
        raise ValueError("group_quantize_compress_numpy: t contains non-finite values")
    rows, cols = t.shape
    grouped = t.reshape(rows, cols // group_size, group_size)
    hi = grouped.max(-1, keepdims=True).astype(np.float16)
    lo = grouped.min(-1, keepdims=True).astype(np.float16)
    scale = (hi - lo) / np.float16(15)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.round((grouped - lo) / scale)
    codes = (
        np.nan_to_num(codes, nan=0.0, posinf=0.0).clip(0, 15).astype(np.uint16)
    )  # constant groups: 0
    quads = codes.reshape(rows, cols // group_size, group_size // 4, 4)
    packed = sum(quads[..., k] << np.uint16(s) for k, s in enumerate(_SHIFTS)).astype(np.uint16)
    return packed, scale, lo


def group_quantize_decompress_numpy(
    t: np.ndarray, group_scale: np.ndarray, group_bias: np.ndarray
) -> np.ndarray:
    """Inverse of ``group_quantize_compress_numpy``: float16 ``(rows, groups * ids * 4)``."""
    rows, groups, ids = t.shape
    codes = np.stack([(t >> s) & 15 for s in _SHIFTS], axis=-1).reshape(rows, groups, ids * 4)
    out = codes.astype(np.float16) * group_scale + group_bias
    return out.reshape(rows, groups * ids * 4)


def _decompress(t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    rows, groups, ids = t.shape
    words = t.to(torch.int32)
    codes = torch.stack([(words >> s) & 15 for s in _SHIFTS], dim=-1).reshape(rows, groups, ids * 4)
    return (codes.to(scale.dtype) * scale + bias).reshape(rows, groups * ids * 4)


def group_quantize_decompress(t: Tensor, group_scale: Tensor, group_bias: Tensor) -> Tensor:
    """Decompress packed ``t`` (uint16 ``(rows, groups, ids)``) with ``group_scale`` and
    ``group_bias`` (``(rows, groups[, 1])``) into ``(rows, groups * ids * 4)`` of the scale's
    dtype. Differentiable in the scale and bias."""
    if len(t.shape) != 3:
        raise NotImplementedError(
            f"group_quantize_decompress: packed tensors of rank 3 only (rows, groups, ids); got {tuple(t.shape)}"
        )
    fixed: list[Any] = []
    for name, s in (("group_scale", group_scale), ("group_bias", group_bias)):
        if len(s.shape) == 2:
            s = s.reshape((*s.shape, 1))
        if len(s.shape) != 3 or tuple(s.shape[:2]) != tuple(t.shape[:2]) or s.shape[2] != 1:
            raise ValueError(
                f"group_quantize_decompress: {name} must have shape {tuple(t.shape[:2])} or "
                f"{(*t.shape[:2], 1)} to match t {tuple(t.shape)}; got {tuple(s.shape)}"
            )
        fixed.append(s)
    return call_torch(_decompress, (t, fixed[0], fixed[1]), {})
