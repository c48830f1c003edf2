"""``LayerNorm``: normalise the last axis of an ``(N, C)`` tensor, scale ``weight`` and shift ``bias``."""

from __future__ import annotations

from functools import partial

import numpy as np

from ...ir.tensor import Tensor
from ...ops import layer_norm
from ..module import Module
from ..utils import WeightsDict
from ._common import host_array

__all__ = ["LayerNorm"]


class LayerNorm(Module):
    """Layer normalisation over the last axis; ``weight`` starts at ones and ``bias`` at zeros."""

    def build(self, x: Tensor, eps: float = 1e-5) -> Tensor:
        if len(x.shape) != 2:
            raise ValueError(
                f"LayerNorm: the input must have shape (N, C), got {tuple(x.shape)}; flatten the "
                "leading axes (and any normalised axes into the last one) first"
            )
        w = self.add_variable_input("weight", partial(np.ones, x.shape[-1]), x.dtype)
        b = self.add_variable_input("bias", partial(np.zeros, x.shape[-1]), x.dtype)
        return layer_norm(x, w, b, eps=eps)

    @staticmethod
    def torch_mapping(variables, nn_layer, dtype=None) -> WeightsDict:
        """``{weight, bias}`` from a ``torch.nn.LayerNorm`` (multi-axis shapes are flattened)."""
        w, b = variables.weight, variables.bias
        return WeightsDict({
            w: host_array(nn_layer.weight, dtype or w.dtype).reshape(w.shape),
            b: host_array(nn_layer.bias, dtype or b.dtype).reshape(b.shape),
        })  # fmt: skip
