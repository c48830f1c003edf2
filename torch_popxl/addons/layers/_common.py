"""Helpers shared by the layers: host conversion for ``torch_mapping``."""

from __future__ import annotations

import numpy as np
import torch

from ... import dtypes as _dtypes

__all__ = ["host_array"]


def host_array(value, dtype=None) -> np.ndarray:
    """``value`` (torch tensor, parameter or array) as a numpy array of popxl ``dtype``."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        value = value.numpy()
    dt = _dtypes.float32 if dtype is None else _dtypes.dtype.as_dtype(dtype)
    return np.asarray(value).astype(dt.as_numpy(), copy=True)
