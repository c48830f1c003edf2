"""``linear_layout``: re-map a tensor linearly over IPU tiles. Tile placement has no counterpart
in the simulator, so the op is a copy (values and gradient unchanged)."""

from __future__ import annotations

import torch

from ....capture import call_torch
from ....ir.tensor import Tensor

__all__ = ["linear_layout"]


def linear_layout(t: Tensor, bs: int = 1) -> Tensor:
    """A copy of ``t`` (upstream: tile mapping in grains of ``bs`` elements)."""
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise ValueError(f"linear_layout: bs (the grain size) must be a positive int, got {bs!r}")
    return call_torch(torch.clone, (t,), {})
