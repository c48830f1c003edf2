"""4-bit group quantisation (FlexGen, arXiv:2303.06865): each row is cut into groups of
``group_size`` values; a group stores ``round((x - min) / scale)`` in 4 bits with
``scale = (max - min) / 15``, four codes packed per uint16, first code in the high nibble.
Decompression is ``code * scale + bias`` with ``bias = min``.

``dim`` (popxl-addons 3.4) names the axis the groups run along: compression moves it last, so
the packed tensor is ``(*other axes, groups, group_size // 4)``, and decompression moves it back
from last to ``dim``.
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


def _check_dim(dim: Any, ndim: int, fn: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or not -ndim <= dim < ndim:
        raise ValueError(
            f"{fn}: dim must be an axis of the {ndim}-D uncompressed tensor (-1 for the last); "
            f"got {dim!r}."
        )
    return int(dim) % ndim


def _last_to(ndim: int, dim: int) -> list[int]:
    """The permutation moving the last axis to ``dim`` (upstream's ``perm.insert(dim, -1)``)."""
    perm = list(range(ndim - 1))
    perm.insert(dim, ndim - 1)
    return perm


def group_quantize_compress_numpy(
    t: np.ndarray, group_size: int, dim: int = -1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compress float16 ``t`` in groups of ``group_size`` along ``dim`` into ``(packed uint16
    (*other axes, groups, group_size // 4), scale (*other axes, groups, 1), bias (..., 1))``
    with float16 statistics."""
    t = np.asarray(t)
    if t.ndim < 1:
        raise ValueError(f"group_quantize_compress_numpy: t must have an axis; got shape {t.shape}")
    dim = _check_dim(dim, t.ndim, "group_quantize_compress_numpy")
    t = np.moveaxis(t, dim, -1)
    if group_size <= 0 or group_size % 4 or t.shape[-1] % group_size:
        raise ValueError(
            f"group_quantize_compress_numpy: the grouped axis ({t.shape[-1]} long) must divide into "
            f"groups of group_size, a positive multiple of 4; got group_size={group_size}"
        )
    if not np.isfinite(t).all():
        raise ValueError("group_quantize_compress_numpy: t contains non-finite values")
    lead, n = t.shape[:-1], t.shape[-1]
    grouped = t.reshape(*lead, n // group_size, group_size)
    hi = grouped.max(-1, keepdims=True).astype(np.float16)
    lo = grouped.min(-1, keepdims=True).astype(np.float16)
    scale = (hi - lo) / np.float16(15)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.round((grouped - lo) / scale)
    codes = (
        np.nan_to_num(codes, nan=0.0, posinf=0.0).clip(0, 15).astype(np.uint16)
    )  # constant groups: 0
    quads = codes.reshape(*lead, n // group_size, group_size // 4, 4)
    packed = sum(quads[..., k] << np.uint16(s) for k, s in enumerate(_SHIFTS)).astype(np.uint16)
    return packed, scale, lo


def group_quantize_decompress_numpy(
    t: np.ndarray, group_scale: np.ndarray, group_bias: np.ndarray, dim: int = -1
) -> np.ndarray:
    """Inverse of ``group_quantize_compress_numpy``: float16 ``(*other axes, groups * ids * 4)``
    with that last axis moved to ``dim``."""
    *lead, groups, ids = t.shape
    codes = np.stack([(t >> s) & 15 for s in _SHIFTS], axis=-1).reshape(*lead, groups, ids * 4)
    out = (codes.astype(np.float16) * group_scale + group_bias).reshape(*lead, groups * ids * 4)
    dim = _check_dim(dim, out.ndim, "group_quantize_decompress_numpy")
    return out.transpose(_last_to(out.ndim, dim))


def _decompress(t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    rows, groups, ids = t.shape
    words = t.to(torch.int32)
    codes = torch.stack([(words >> s) & 15 for s in _SHIFTS], dim=-1).reshape(rows, groups, ids * 4)
    return (codes.to(scale.dtype) * scale + bias).reshape(rows, groups * ids * 4)


def group_quantize_decompress(
    t: Tensor, group_scale: Tensor, group_bias: Tensor, dim: int = -1
) -> Tensor:
    """Decompress packed ``t`` (uint16 ``(rows, groups, ids)``) with ``group_scale`` and
    ``group_bias`` (``(rows, groups[, 1])``) into ``(rows, groups * ids * 4)`` of the scale's
    dtype, with the decompressed axis moved to ``dim``. Differentiable in the scale and bias."""
    if len(t.shape) != 3:
        raise NotImplementedError(
            f"group_quantize_decompress: packed tensors of rank 3 only (rows, groups, ids); got {tuple(t.shape)}"
        )
    dim = _check_dim(dim, 2, "group_quantize_decompress")
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
    out = call_torch(_decompress, (t, fixed[0], fixed[1]), {})
    return out if dim == 1 else out.transpose(_last_to(2, dim))
