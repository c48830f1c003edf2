"""Rotary positional embeddings (RoPE, RoFormer arXiv:2104.09864).

The last axis is read as complex numbers ``(x[2k], x[2k+1])``; pair ``k`` at sequence position
``m`` is rotated by ``m * theta_k`` with ``theta_k = base ** (-2k / rotary_dim)``. Elements at
and beyond ``rotary_dim`` pass through unchanged.

The layout is upstream's: ``t`` is ``(batch, seq, heads, head_dim)`` (the attention's
activations before the heads are transposed; popxl-addons' rotary_pos_embedx.cpp broadcasts the
``(1 or batch, seq, rotary_dim // 2)`` tables over the heads axis, and its test compares with
Hugging Face GPT-J's ``apply_rotary_pos_emb`` on that layout).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .... import dtypes as _dtypes
from ....capture import call_torch
from ....ir.tensor import Tensor, constant

__all__ = ["rotary_pos_embed", "trig_tables", "trig_table_constants"]


def trig_tables(seq_len: int, rotary_dim: int, base: int = 10000,
                np_dtype: Any = "float32") -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(sin, cos)`` of ``m * theta_k``, each of shape ``(seq_len, rotary_dim // 2)``."""
    theta = base ** (-np.arange(0, rotary_dim, 2).astype(np_dtype) / rotary_dim)
    phi = np.outer(np.arange(seq_len).astype(np_dtype), theta)
    return np.sin(phi), np.cos(phi)


def trig_table_constants(seq_len: int, rotary_dim: int, base: int = 10000, dtype=_dtypes.float32):
    """``trig_tables`` as popxl constants of ``dtype``."""
    sin, cos = trig_tables(seq_len, rotary_dim, base, dtype.as_numpy())
    return constant(sin, dtype), constant(cos, dtype)


def _rope(t: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    # Tables broadcast over the heads axis: (1 or batch, seq, r/2) -> (1 or batch, seq, 1, r/2).
    sin, cos = sin.unsqueeze(2), cos.unsqueeze(2)
    rot, rest = t[..., :rotary_dim], t[..., rotary_dim:]
    pairs = rot.reshape(*rot.shape[:-1], rotary_dim // 2, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    out = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return torch.cat([out.reshape(rot.shape), rest], dim=-1)


def rotary_pos_embed(t: Tensor, sin: Tensor, cos: Tensor, rotary_dim: int | None = None) -> Tensor:
    """Rotate ``t`` ``(batch, seq, heads, head_dim)`` by the ``trig_tables`` ``sin`` / ``cos``
    (``(seq, rotary_dim // 2)``, or ``(1 or batch, seq, rotary_dim // 2)``); ``rotary_dim``
    defaults to ``head_dim``. Differentiable."""
    rotary_dim = rotary_dim or t.shape[-1]
    if len(t.shape) != 4:
        raise ValueError(
            f"rotary_pos_embed: t must be (batch, seq, heads, head_dim), got {tuple(t.shape)}"
        )
    if rotary_dim % 2 or rotary_dim > t.shape[-1]:
        raise ValueError(
            f"rotary_pos_embed: rotary_dim={rotary_dim} must be even and at most head_dim={t.shape[-1]}"
        )
    if len(sin.shape) == 2:
        sin = sin.reshape((1, *sin.shape))
    if len(cos.shape) == 2:
        cos = cos.reshape((1, *cos.shape))
    batch, seq = t.shape[0], t.shape[1]
    want = (seq, rotary_dim // 2)
    for name, table in (("sin", sin), ("cos", cos)):
        if (
            len(table.shape) != 3
            or tuple(table.shape[1:]) != want
            or table.shape[0] not in (1, batch)
        ):
            raise ValueError(
                f"rotary_pos_embed: {name} must be (seq, rotary_dim // 2) = {want} (from "
                f"trig_tables), or that with a leading axis of 1 or batch={batch}, for t of shape "
                f"{tuple(t.shape)} (batch, seq, heads, head_dim); got {tuple(table.shape)}."
            )
    return call_torch(_rope, (t, sin, cos, rotary_dim), {})
