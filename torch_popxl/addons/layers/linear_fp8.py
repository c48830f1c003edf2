"""``LinearFP8``: a linear layer whose matmuls run in float8 with power-of-two scales.

Forward: the weight and the input are cast to float8_143 after scaling each by a power of two
chosen by ``scale_metric`` (``fp8_amax_scale``, ``fp8_mse_scale`` or the fixed ``scale``); the
product ``matmul_pow2scaled`` removes both scales and gives float16 (float32 inputs get a
float32 result). Backward (``build_grad``): the output gradient is cast to float8_152 with its own
scale, less 3 for headroom and clipped to [-31, 31], and multiplies the float8 weight and input
kept from the forward; the bias gradient is the plain sum of the output gradient.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from ... import dtypes as _dtypes
from ... import ops
from ...ir.replica_grouping import ReplicaGrouping
from ...ir.tensor import Tensor, Variable, constant
from ..module import Module
from ..ops.fp8_amax_scale import fp8_amax_scale
from ..ops.fp8_mse_scale import fp8_mse_scale
from ..utils import WeightsDict
from .linear import truncated_normal

__all__ = ["LinearFP8"]

_METRICS = ("amax", "mse", "manual_scale")


class LinearFP8(Module):
    """``y = x @ W (+ b)`` through float8; variables ``weight`` (in, out) and ``bias`` (out,)."""

    def __init__(self, out_features: int, bias: bool = True, scale_metric: str = "amax",
                 scale: int = 0, replica_grouping: ReplicaGrouping | None = None):  # fmt: skip
        if scale_metric not in _METRICS:
            raise ValueError(
                f"LinearFP8: the scale_metric option {scale_metric!r} is not available. Please "
                "provide one of the following options: amax, mse or manual_scale."
            )
        super().__init__()
        self.out_features = out_features
        self.bias = bias
        self.scale_metric = scale_metric
        self.scale = scale
        self.replica_grouping = replica_grouping
        self.forward_fp8_type = _dtypes.float8_143
        self.grad_fp8_type = _dtypes.float8_152

    def fp8_scale(self, t: Tensor, dtype: _dtypes.dtype) -> Tensor:
        """The log2 scale ``scale_metric`` gives ``t`` for a cast to ``dtype`` (int32 scalar)."""
        if self.scale_metric == "amax":
            return fp8_amax_scale(t, dtype)
        if self.scale_metric == "mse":
            return fp8_mse_scale(t, dtype)
        return constant(self.scale, _dtypes.int32)

    def build(self, x: Tensor) -> Tensor:
        w = self.add_variable_input("weight", partial(truncated_normal, (x.shape[-1], self.out_features)), x.dtype,
                                    replica_grouping=self.replica_grouping)  # fmt: skip
        w_scale = self.fp8_scale(w, self.forward_fp8_type)
        w_fp8 = ops.pow2scale_cast_to_fp8(w, data_type=self.forward_fp8_type, log2_scale=w_scale)
        x_scale = self.fp8_scale(x, self.forward_fp8_type)
        x_fp8 = ops.pow2scale_cast_to_fp8(x, data_type=self.forward_fp8_type, log2_scale=x_scale)
        self.aux["w_log2scale"] = w_scale
        self.aux["w_fp8"] = w_fp8
        self.aux["x_log2scale"] = x_scale
        self.aux["x_fp8"] = x_fp8
        y = ops.matmul_pow2scaled(x_fp8, w_fp8, log2_scale=-w_scale - x_scale)  # float16
        if x.dtype == _dtypes.float32:
            y = ops.cast(y, _dtypes.float32)
        if self.bias:
            b = self.add_variable_input("bias", partial(np.zeros, y.shape[-1]), x.dtype,
                                        replica_grouping=self.replica_grouping)  # fmt: skip
            y = y + b
        return y

    def build_grad(self, dLdy: Tensor) -> Tensor:
        dy_scale = self.fp8_scale(dLdy, self.grad_fp8_type) - constant(3, _dtypes.int32)
        dy_scale = ops.clip(dy_scale, -31, 31)
        dy_fp8 = ops.pow2scale_cast_to_fp8(dLdy, data_type=self.grad_fp8_type, log2_scale=dy_scale)
        dLdx = ops.matmul_pow2scaled(
            dy_fp8, self.aux["w_fp8"].T, log2_scale=-self.aux["w_log2scale"] - dy_scale
        )
        dLdw = ops.matmul_pow2scaled(
            dy_fp8.T, self.aux["x_fp8"], log2_scale=-self.aux["x_log2scale"] - dy_scale
        ).T
        self.var_grad["weight"] = dLdw
        if self.bias:
            self.var_grad["bias"] = ops.sum(dLdy, 0)
        return dLdx

    @staticmethod
    def torch_mapping(variables, nn_layer, dtype: _dtypes.dtype = _dtypes.float32) -> WeightsDict:
        """``{weight: W.T, bias: b}`` in ``dtype`` from a ``torch.nn.Linear``."""
        weights = WeightsDict()
        w: Variable = variables.weight
        weights[w] = nn_layer.weight.detach().numpy().T.astype(dtype.as_numpy())
        if "bias" in variables.keys() and nn_layer.bias is not None:
            b: Variable = variables.bias
            weights[b] = nn_layer.bias.detach().numpy().astype(dtype.as_numpy())
        return weights
