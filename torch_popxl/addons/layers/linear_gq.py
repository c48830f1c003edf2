"""``LinearGQ``: a linear layer whose weight is stored 4-bit group-quantised."""

from __future__ import annotations

from functools import partial

import numpy as np

from ... import dtypes as _dtypes
from ...ir.replica_grouping import ReplicaGrouping
from ...ir.tensor import Tensor
from ..module import Module
from ..ops.group_quantize_decompress import group_quantize_compress_numpy, group_quantize_decompress
from ..utils import WeightsDict
from ._common import host_array

__all__ = ["LinearGQ"]


class LinearGQ(Module):
    """``y = x @ decompress(W) (+ b)``; ``W`` ``(in, out)`` is kept as ``weight_compressed``
    (uint16, four 4-bit codes per element), ``weight_decompression_scale`` and
    ``weight_decompression_bias``, grouped along ``dim`` of ``W`` (-1 or 1: groups of outputs,
    ``(in, out // group_size, ...)``; 0: groups of inputs, ``(out, in // group_size, ...)``).
    Variables start at zero: write real weights with ``torch_mapping``."""

    def __init__(self, out_features: int, bias: bool = True, replica_grouping: ReplicaGrouping | None = None,
                 group_size: int = 0, dim: int = -1):  # fmt: skip
        super().__init__()
        if dim not in (-1, 0, 1) or isinstance(dim, bool):
            raise ValueError(
                f"LinearGQ: dim must be -1, 0 or 1 (an axis of the weight); got {dim!r}"
            )
        if group_size <= 0 or group_size % 4 or (dim != 0 and out_features % group_size):
            raise ValueError(
                f"LinearGQ: group_size must be a positive multiple of 4 dividing out_features={out_features}; "
                f"got {group_size}"
            )
        self.out_features = out_features
        self.bias = bias
        self.replica_grouping = replica_grouping
        self.group_size = group_size
        self.dim = dim

    def build(self, x: Tensor) -> Tensor:
        kept, grouped = (
            (self.out_features, x.shape[-1]) if self.dim == 0 else (x.shape[-1], self.out_features)
        )
        if grouped % self.group_size:
            raise ValueError(
                f"LinearGQ: group_size={self.group_size} must divide in_features={grouped} when dim=0"
            )
        groups = grouped // self.group_size
        rg = self.replica_grouping
        packed = self.add_variable_input("weight_compressed", partial(np.zeros, (kept, groups, self.group_size // 4)),
                                         _dtypes.uint16, replica_grouping=rg)  # fmt: skip
        scale = self.add_variable_input("weight_decompression_scale", partial(np.zeros, (kept, groups, 1)),
                                        x.dtype, replica_grouping=rg)  # fmt: skip
        offset = self.add_variable_input("weight_decompression_bias", partial(np.zeros, (kept, groups, 1)),
                                         x.dtype, replica_grouping=rg)  # fmt: skip
        y = x @ group_quantize_decompress(packed, scale, offset, self.dim)
        if self.bias:
            b = self.add_variable_input(
                "bias", partial(np.zeros, (self.out_features,)), x.dtype, replica_grouping=rg
            )
            y = y + b
        return y

    @staticmethod
    def torch_mapping(
        variables, nn_layer, dtype=_dtypes.float32, group_size: int = 64, dim: int = -1
    ) -> WeightsDict:
        """Compress a ``torch.nn.Linear``'s weight (transposed to ``(in, out)``) along ``dim``
        into the variables (``dim`` as the layer's)."""
        packed, scale, offset = group_quantize_compress_numpy(
            nn_layer.weight.detach().numpy().T, group_size, dim=dim
        )
        out = WeightsDict()
        out[variables.weight_compressed] = packed
        out[variables.weight_decompression_scale] = scale.astype(
            variables.weight_decompression_scale.dtype.as_numpy()
        )
        out[variables.weight_decompression_bias] = offset.astype(
            variables.weight_decompression_bias.dtype.as_numpy()
        )
        if "bias" in variables.keys() and nn_layer.bias is not None:
            out[variables.bias] = host_array(nn_layer.bias, variables.bias.dtype)
        return out
