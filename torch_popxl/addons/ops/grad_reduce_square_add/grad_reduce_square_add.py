"""``grad_reduce_square_add``: the squared norm of a loss-scaled gradient, unscaled."""

from __future__ import annotations

from typing import Any

import torch

from ....ir.tensor import Tensor

__all__ = ["grad_reduce_square_add"]


def grad_reduce_square_add(t: Tensor, loss_scaling: int | float | Tensor) -> Tensor:
    """``sum(t ** 2) / loss_scaling ** 2`` as a float32 scalar (accumulated in float32, so
    float16 gradients do not overflow). ``ops.sqrt`` of it is the gradient norm."""
    traced: Any = t  # torch methods on popxl handles record ops
    x: Any = traced.to(torch.float32)
    total: Any = (x * x).sum()
    if isinstance(loss_scaling, Tensor):
        scale: Any = loss_scaling
        ls: Any = scale.to(torch.float32)
        return total / (ls * ls)
    return total * (1.0 / (float(loss_scaling) * float(loss_scaling)))
