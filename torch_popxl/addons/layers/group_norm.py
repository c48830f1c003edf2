"""``GroupNorm``: normalise groups of channels (axis 1) of an ``(N, C, *)`` tensor."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ...capture import call_torch
from ...ir.replica_grouping import ReplicaGrouping
from ...ir.tensor import Tensor
from ..module import Module
from ..utils import WeightsDict
from ._common import host_array

__all__ = ["GroupNorm"]


class GroupNorm(Module):
    """Group normalisation with per-channel ``weight`` (ones) and ``bias`` (zeros)."""

    def __init__(self, num_groups: int, replica_grouping: ReplicaGrouping | None = None,
                 eps: float = 1e-5, cache: bool = False):  # fmt: skip
        super().__init__(cache)
        self.num_groups = num_groups
        self.replica_grouping = replica_grouping
        self.eps = eps

    def build(self, x: Tensor) -> Tensor:
        if len(x.shape) < 2 or x.shape[1] % self.num_groups:
            raise ValueError(
                f"GroupNorm: the input must have shape (N, C, *) with C divisible by num_groups="
                f"{self.num_groups}; got {tuple(x.shape)}"
            )
        c = x.shape[1]
        self.weight = self.add_variable_input("weight", partial(np.ones, c), x.dtype,
                                              replica_grouping=self.replica_grouping)  # fmt: skip
        self.bias = self.add_variable_input("bias", partial(np.zeros, c), x.dtype,
                                            replica_grouping=self.replica_grouping)  # fmt: skip
        return call_torch(torch.nn.functional.group_norm,
                          (x, self.num_groups, self.weight, self.bias, self.eps), {})  # fmt: skip

    @staticmethod
    def torch_mapping(variables, nn_layer, dtype=None) -> WeightsDict:
        """``{weight, bias}`` from a ``torch.nn.GroupNorm``."""
        w, b = variables.weight, variables.bias
        return WeightsDict({w: host_array(nn_layer.weight, dtype or w.dtype),
                            b: host_array(nn_layer.bias, dtype or b.dtype)})  # fmt: skip
