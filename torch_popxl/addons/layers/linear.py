"""``Linear``: ``y = x @ W (+ b)`` with ``W`` of shape ``(in_features, out_features)``."""

from __future__ import annotations

from functools import partial

import numpy as np

from ...ir.replica_grouping import ReplicaGrouping
from ...ir.tensor import Tensor, Variable
from ..module import Module
from ..utils import WeightsDict

__all__ = ["Linear", "truncated_normal"]


def truncated_normal(shape: tuple[int, ...], std: float = 0.02, bound: float = 2.0,
                     rng: np.random.Generator | None = None) -> np.ndarray:  # fmt: skip
    """Normal(0, std) samples redrawn until they lie within ``bound`` standard deviations."""
    draw = rng.standard_normal if rng is not None else np.random.standard_normal
    out = draw(shape)
    bad = np.abs(out) > bound
    while bad.any():
        out[bad] = draw(int(bad.sum()))
        bad = np.abs(out) > bound
    return out * std


class Linear(Module):
    """Fully connected layer; variables ``weight`` (in, out) and, if ``bias``, ``bias`` (out,)."""

    def __init__(
        self, out_features: int, bias: bool = True, replica_grouping: ReplicaGrouping | None = None
    ):
        super().__init__()
        self.out_features = out_features
        self.bias = bias
        self.replica_grouping = replica_grouping

    def build(self, x: Tensor) -> Tensor:
        w = self.add_variable_input("weight", partial(truncated_normal, (x.shape[-1], self.out_features)), x.dtype,
                                    replica_grouping=self.replica_grouping)  # fmt: skip
        y = x @ w
        if self.bias:
            b = self.add_variable_input("bias", partial(np.zeros, (self.out_features,)), x.dtype,
                                        replica_grouping=self.replica_grouping)  # fmt: skip
            y = y + b
        return y

    @staticmethod
    def torch_mapping(variables, nn_layer) -> WeightsDict:
        """``{weight: W.T, bias: b}`` from a ``torch.nn.Linear`` (which stores ``(out, in)``)."""
        weights = WeightsDict()
        w: Variable = variables.weight
        weights[w] = nn_layer.weight.detach().numpy().T.astype(w.dtype.as_numpy())
        if "bias" in variables and nn_layer.bias is not None:
            b: Variable = variables.bias
            weights[b] = nn_layer.bias.detach().numpy().astype(b.dtype.as_numpy())
        return weights
