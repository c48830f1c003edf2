"""``Conv2D``: 2D convolution of ``(N, C, H, W)`` inputs (PopXL ``ops.conv`` conventions)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np
import torch

from ...capture import call_torch
from ...ir.replica_grouping import ReplicaGrouping
from ...ir.tensor import Tensor
from ..module import Module
from ..utils import WeightsDict
from ._common import host_array
from .linear import truncated_normal

__all__ = ["Conv2D"]

_PAD_TYPES = ("not_set", "same_upper", "same_lower", "valid")


def _same_padding(size: int, k: int, stride: int, dilation: int, upper: bool) -> tuple[int, int]:
    # ONNX auto_pad: the output has ceil(size / stride) positions; an odd total padding puts the
    # extra element at the end ("same_upper") or at the beginning ("same_lower").
    total = max((math.ceil(size / stride) - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    small, big = total // 2, total - total // 2
    return (small, big) if upper else (big, small)


def _conv2d(x, w, stride, pads, dilation, groups):
    # pads: (h_begin, w_begin, h_end, w_end) as in ONNX / popxl.ops.conv
    hb, wb, he, we = pads
    if (hb, wb) != (he, we):
        x = torch.nn.functional.pad(x, (wb, we, hb, he))
        padding = (0, 0)
    else:
        padding = (hb, wb)
    return torch.nn.functional.conv2d(x, w, None, tuple(stride), padding, tuple(dilation), groups)


class Conv2D(Module):
    """Convolution with ``weight`` ``(out_channels, C / groups, k_h, k_w)`` (truncated normal,
    std 0.02) and, if ``bias``, ``bias`` ``(1, out_channels, 1, 1)`` (zeros).

    ``paddings`` is ``(h_begin, w_begin, h_end, w_end)`` or one of ``"same_upper"``,
    ``"same_lower"``, ``"valid"``. Memory and tile-layout options are accepted for
    compatibility and do not change results.
    """

    def __init__(self, out_channels: int, kernel_size, strides=(1, 1), paddings=(0, 0, 0, 0),
                 dilations=(1, 1), groups: int = 1, bias: bool = True,
                 available_memory_proportions=None, partials_types=None,
                 enable_conv_dithering=None, replica_grouping: ReplicaGrouping | None = None):  # fmt: skip
        super().__init__()
        self.out_channels = out_channels
        self.k_h, self.k_w = (
            kernel_size if isinstance(kernel_size, tuple | list) else (kernel_size,) * 2
        )
        self.strides = tuple(strides)
        self.dilations = tuple(dilations)
        self.groups = groups
        if isinstance(paddings, str):
            if paddings not in _PAD_TYPES:
                raise ValueError(
                    f"Conv2D: paddings must be a 4-tuple or one of {_PAD_TYPES[1:]}, got {paddings!r}"
                )
            self.pad_type, self.paddings = paddings, (0, 0, 0, 0)
        else:
            if len(paddings) != 4:
                raise ValueError(
                    f"Conv2D: explicit paddings are (h_begin, w_begin, h_end, w_end), got {tuple(paddings)}"
                )
            self.pad_type, self.paddings = "not_set", tuple(paddings)
        self.bias: Any = bias
        self._use_bias = bias  # self.bias becomes the variable in build, as upstream
        self.replica_grouping = replica_grouping
        self.available_memory_proportions = available_memory_proportions
        self.partials_types = partials_types
        self.enable_conv_dithering = enable_conv_dithering

    def _pads(self, h: int, w: int) -> tuple[int, int, int, int]:
        if self.pad_type == "not_set":
            return self.paddings
        if self.pad_type == "valid":
            return (0, 0, 0, 0)
        upper = self.pad_type == "same_upper"
        hb, he = _same_padding(h, self.k_h, self.strides[0], self.dilations[0], upper)
        wb, we = _same_padding(w, self.k_w, self.strides[1], self.dilations[1], upper)
        return (hb, wb, he, we)

    def build(self, x: Tensor) -> Tensor:
        if len(x.shape) != 4 or x.shape[1] % self.groups:
            raise ValueError(
                f"Conv2D: the input must be (N, C, H, W) with C divisible by groups={self.groups}; "
                f"got {tuple(x.shape)}"
            )
        _, c, h, w = x.shape
        shape = (self.out_channels, c // self.groups, self.k_h, self.k_w)
        self.weight = self.add_variable_input("weight", partial(truncated_normal, shape), x.dtype,
                                              replica_grouping=self.replica_grouping)  # fmt: skip
        y = call_torch(
            _conv2d,
            (x, self.weight, self.strides, self._pads(h, w), self.dilations, self.groups),
            {},
        )
        if self._use_bias:
            self.bias = self.add_variable_input("bias", partial(np.zeros, (1, self.out_channels, 1, 1)), x.dtype,
                                                replica_grouping=self.replica_grouping)  # fmt: skip
            y = y + self.bias
        return y

    @staticmethod
    def torch_mapping(variables, nn_layer, dtype=None) -> WeightsDict:
        """``{weight, bias}`` from a ``torch.nn.Conv2d`` (same weight layout)."""
        w = variables.weight
        out = WeightsDict({w: host_array(nn_layer.weight, dtype or w.dtype)})
        if "bias" in variables and nn_layer.bias is not None:
            b = variables.bias
            out[b] = host_array(nn_layer.bias, dtype or b.dtype).reshape(b.shape)
        return out
