"""Neural-network ops: matmul, normalisation, dropout, pooling and convolution (with upstream's
ONNX-style padding resolved once in ``_pads``), and the transposed convolution (ONNX
ConvTranspose, its output cropped by ``_transpose_pads``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from ..ir.tensor import Tensor
from ._common import _check_tensor, call_op
from .elementwise import _binary
from .rng import _check_seed, seeded_uniform
from .shape import cast

__all__ = [
    "matmul", "layer_norm", "group_norm", "batch_norm_inference", "dropout", "average_pool",
    "max_pool", "conv", "conv_transpose", "PadType"
]  # fmt: skip


PadType = Literal["not_set", "same_upper", "same_lower", "valid"]


# ---- matmul -------------------------------------------------------------------------------


def matmul(lhs: Tensor, rhs: Tensor, available_memory_proportion=None, serialise_mode=None,
           serialise_factor=1, output_type=None, partials_type=None) -> Tensor:  # fmt: skip
    out = _binary(torch.matmul, lhs, rhs, "matmul")
    if output_type is not None:
        out = cast(out, output_type)
    return out


# ---- normalisation and dropout ------------------------------------------------------------


def layer_norm(t: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    return call_op(torch.nn.functional.layer_norm, (t, (t.shape[-1],), weight, bias, eps), {})


def group_norm(t: Tensor, weight: Tensor, bias: Tensor, num_groups: int,
               eps: float = 1e-5) -> Tensor:  # fmt: skip
    """Group normalisation over the channels (axis 1) of ``t`` in ``num_groups`` groups."""
    t = _check_tensor(t, "group_norm")
    if num_groups <= 0 or t.shape[1] % num_groups:
        raise ValueError(
            f"group_norm: {t.shape[1]} channels of {t.id!r} cannot be split into "
            f"{num_groups} groups; num_groups must divide the channel count."
        )
    return call_op(F.group_norm, (t, num_groups, weight, bias, eps), {})


def batch_norm_inference(t: Tensor, scale: Tensor, bias: Tensor, mean: Tensor, var: Tensor,
                         epsilon: float = 1e-5, momentum: float = 0.9) -> Tensor:  # fmt: skip
    """``(t - mean) / sqrt(var + epsilon) * scale + bias`` over the channels (axis 1).

    ``momentum`` is accepted for upstream's signature; inference does not update statistics.
    """
    t = _check_tensor(t, "batch_norm_inference")
    return call_op(F.batch_norm, (t, mean, var), {"weight": scale, "bias": bias, "eps": epsilon})


def dropout(t: Tensor, seed_tensor: Tensor | None = None, p: float = 0.5) -> Tensor:
    """Dropout with probability ``p``: kept values are scaled by ``1 / (1 - p)``.

    One out-of-place op as upstream's DropoutOp, so graphs holding it can be differentiated
    and its gradient uses the forward's mask. With a ``seed_tensor`` (uint32[2]) the mask is a
    function of the seed alone, as upstream's (Note [samples come from the seed] in
    ``rng.py``): the same seed drops the same elements, in a recomputed forward and on every
    replica given that seed. Without one, replicas draw different masks from torch's generator.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1); got {p}.")
    keep = 1.0 - float(p)
    if seed_tensor is not None:
        _check_seed(seed_tensor, "dropout")

    def run(x, *seed):
        if keep == 1.0:  # draws nothing, as torch's dropout with p = 0
            return x.clone()
        if seed:
            u = seeded_uniform(seed[0], x.shape).to(x.device)
        else:
            u = torch.rand(x.shape, dtype=torch.float32, device=x.device)
        return x * (u < keep).to(x.dtype) / keep

    return call_op(run, (t,) if seed_tensor is None else (t, seed_tensor), {})


# ---- pooling and convolution --------------------------------------------------------------


def _spatial(t: Tensor, op: str) -> int:
    n = t.rank - 2
    if n not in (1, 2, 3):
        raise ValueError(
            f"{op}: expected an (N, C, ...) input with 1-3 spatial axes; got {t.shape}."
        )
    return n


def _pads(op: str, n: int, padding, auto_pad, in_shape, kernel, stride, dilation) -> list[int]:
    """Upstream's ``[x1_begin, x2_begin, ..., x1_end, x2_end, ...]`` padding resolved."""
    if auto_pad not in ("not_set", "same_upper", "same_lower", "valid"):
        raise ValueError(
            f"{op}: auto_pad must be 'not_set', 'same_upper', 'same_lower' or 'valid'; "
            f"got {auto_pad!r}."
        )
    if auto_pad == "valid":
        return [0] * (2 * n)
    if auto_pad in ("same_upper", "same_lower"):
        begins, ends = [], []
        for size, k, s, d in zip(in_shape, kernel, stride, dilation, strict=True):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small, big = total // 2, total - total // 2
            begins.append(small if auto_pad == "same_upper" else big)
            ends.append(big if auto_pad == "same_upper" else small)
        return begins + ends
    pads = [0] * (2 * n) if padding is None else [int(p) for p in padding]
    if len(pads) != 2 * n:
        raise ValueError(
            f"{op}: padding needs {2 * n} values (begin and end of each of the {n} spatial "
            f"axes); got {list(pads)}."
        )
    return pads


def _pad_input(x, pads: list[int], value: float):
    n = len(pads) // 2
    if not any(pads):
        return x
    # F.pad takes (last axis begin, last axis end, previous axis begin, ...).
    spec = []
    for i in reversed(range(n)):
        spec += [pads[i], pads[n + i]]
    return F.pad(x, spec, value=value)


def _tuple(v, n: int, default: int) -> tuple[int, ...]:
    if v is None:
        return (default,) * n
    v = tuple(int(x) for x in v)
    return v


def average_pool(t: Tensor, kernel_size: Sequence[int], stride: Sequence[int] | None = None,
                 padding: Sequence[int] | None = None, out_pads=None,
                 dilation: Sequence[int] | None = None, in_dilations=None,
                 auto_pad: PadType = "not_set", ceil_mode: bool | None = None) -> Tensor:  # fmt: skip
    """Average pooling over the spatial axes of an ``(N, C, ...)`` tensor.

    Padded positions are excluded from each average (ONNX ``count_include_pad=0``).
    """
    t = _check_tensor(t, "average_pool")
    n = _spatial(t, "average_pool")
    kernel, stride_ = tuple(kernel_size), _tuple(stride, n, 1)
    dil = _tuple(dilation, n, 1)
    if any(d != 1 for d in dil) or in_dilations or out_pads:
        raise ValueError(
            "average_pool: dilation, in_dilations and out_pads other than the defaults are not "
            "supported by the simulator; pool a dilated input explicitly instead."
        )
    pads = _pads("average_pool", n, padding, auto_pad, t.shape[2:], kernel, stride_, dil)
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[n - 1]

    def run(x):
        ones = torch.ones_like(x[:1, :1])
        summed = pool(_pad_input(x, pads, 0.0), kernel, stride_, 0, bool(ceil_mode), True)
        counts = pool(_pad_input(ones, pads, 0.0), kernel, stride_, 0, bool(ceil_mode), True)
        return summed / counts

    return call_op(run, (t,), {})


def max_pool(t: Tensor, kernel_size: Sequence[int], stride: Sequence[int] | None = None,
             padding: Sequence[int] | None = None, out_pads=None,
             dilation: Sequence[int] | None = None, in_dilations=None,
             auto_pad: PadType = "not_set", ceil_mode: bool | None = None,
             storage_order: bool | None = None) -> Tensor:  # fmt: skip
    """Max pooling over the spatial axes of an ``(N, C, ...)`` tensor."""
    t = _check_tensor(t, "max_pool")
    n = _spatial(t, "max_pool")
    kernel, stride_ = tuple(kernel_size), _tuple(stride, n, 1)
    dil = _tuple(dilation, n, 1)
    if in_dilations or out_pads:
        raise ValueError("max_pool: in_dilations and out_pads are not supported by the simulator.")
    pads = _pads("max_pool", n, padding, auto_pad, t.shape[2:], kernel, stride_, dil)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[n - 1]

    def run(x):
        return pool(_pad_input(x, pads, -math.inf), kernel, stride_, 0, dil, bool(ceil_mode))

    return call_op(run, (t,), {})


def conv(t: Tensor, weight: Tensor, stride: Sequence[int] | None = None,
         padding: Sequence[int] | None = None, dilation: Sequence[int] | None = None,
         groups: int = 1, pad_type: PadType = "not_set", available_memory_proportions=None,
         partials_types=None, enable_conv_dithering=None) -> Tensor:  # fmt: skip
    """Convolution of an ``(N, C_in, ...)`` input with ``(C_out, C_in / groups, ...)`` weights."""
    run = conv_function("conv", t, weight, stride, padding, dilation, groups, pad_type)
    return call_op(run, (t, weight), {})


def conv_function(op: str, t: Tensor, weight: Tensor, stride, padding, dilation, groups: int,
                  pad_type: PadType):  # fmt: skip
    """The checked convolution as a torch function of ``(input, weight)`` (``conv`` and the
    float8 ``conv_pow2scaled`` run it)."""
    t = _check_tensor(t, op)
    n = _spatial(t, op)
    if t.shape[1] != weight.shape[1] * groups:
        raise ValueError(
            f"{op}: input {t.id!r} has {t.shape[1]} channels but the weight expects "
            f"{weight.shape[1]} x {groups} groups = {weight.shape[1] * groups}."
        )
    stride_, dil = _tuple(stride, n, 1), _tuple(dilation, n, 1)
    pads = _pads(op, n, padding, pad_type, t.shape[2:], weight.shape[2:], stride_, dil)
    fn = (F.conv1d, F.conv2d, F.conv3d)[n - 1]

    def run(x, w):
        return fn(_pad_input(x, pads, 0.0), w, None, stride_, 0, dil, groups)

    return run


def conv_transpose(t: Tensor, weight: Tensor, stride: Sequence[int] | None = None,
                   padding: Sequence[int] | None = None, dilation: Sequence[int] | None = None,
                   groups: int = 1, pad_type: PadType = "not_set",
                   output_padding: Sequence[int] = (), output_shape: Sequence[int] = (),
                   available_memory_proportions=None, partials_types=None,
                   enable_conv_dithering=None) -> Tensor:  # fmt: skip
    """Transposed convolution (ONNX ConvTranspose) of an ``(N, C_in, ...)`` input with
    ``(C_in, C_out / groups, ...)`` weights (torch's ``ConvTranspose`` layout).

    The output's spatial size is ``stride * (in - 1) + output_padding + (kernel - 1) *
    dilation + 1 - pad_begin - pad_end``; an ``output_shape`` (the spatial sizes, or the whole
    shape) fixes it instead and the padding follows from it (Note [transposed convolution
    padding]).
    """
    run = conv_transpose_function("conv_transpose", t, weight, stride, padding, dilation, groups,
                                  pad_type, output_padding, output_shape)  # fmt: skip
    return call_op(run, (t, weight), {})


# Note [transposed convolution padding]
#     ONNX ConvTranspose (which upstream's op follows) computes the full transposed
#     convolution, of spatial size ``F = stride * (in - 1) + (kernel - 1) * dilation + 1``,
#     appends ``output_padding`` zeros at the end and then removes ``pad_begin`` / ``pad_end``
#     elements from either side. With ``output_shape`` or a "same" pad type the total padding
#     is ``F + output_padding - out`` (``out = in * stride`` for "same"), split with the odd
#     element at the end for "same_upper" and at the beginning otherwise; a negative total
#     (an output larger than the full convolution) pads with zeros instead of cropping.


def conv_transpose_function(op: str, t: Tensor, weight: Tensor, stride, padding, dilation,
                            groups: int, pad_type: PadType, output_padding,
                            output_shape):  # fmt: skip
    """The checked transposed convolution as a torch function of ``(input, weight)``."""
    t = _check_tensor(t, op)
    n = _spatial(t, op)
    if weight.rank != t.rank or t.shape[1] != weight.shape[0]:
        raise ValueError(
            f"{op}: input {t.id!r} of shape {t.shape} needs a weight of shape (C_in={t.shape[1]}, "
            f"C_out / groups, *kernel) with {n} kernel axes; got {weight.shape}."
        )
    if groups < 1 or t.shape[1] % groups:
        raise ValueError(f"{op}: groups ({groups}) must divide the {t.shape[1]} input channels.")
    stride_, dil = _tuple(stride, n, 1), _tuple(dilation, n, 1)
    out_pad = list(output_padding) or [0] * n
    if len(out_pad) not in (n, 2 * n):
        raise ValueError(f"{op}: output_padding needs {n} values; got {list(output_padding)}.")
    out_pad = [int(p) for p in out_pad[:n]]  # ONNX's per-axis values (upstream's docs show 2n)
    full = [s * (i - 1) + (k - 1) * d + 1 + p
            for i, k, s, d, p in zip(t.shape[2:], weight.shape[2:], stride_, dil, out_pad,
                                     strict=True)]  # fmt: skip
    pads = _transpose_pads(op, n, padding, pad_type, output_shape, full, t.shape[2:], stride_)
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1]

    def run(x, w):
        y = fn(x, w, None, stride_, 0, 0, groups, dil)
        spec = []  # F.pad from the last axis: a negative pad crops
        for i in reversed(range(n)):
            spec += [-pads[i], out_pad[i] - pads[n + i]]
        return F.pad(y, spec) if any(spec) else y

    return run


def _transpose_pads(op: str, n: int, padding, pad_type, output_shape, full, in_shape,
                    stride) -> list[int]:  # fmt: skip
    """Begin and end crops of each spatial axis (Note [transposed convolution padding])."""
    if pad_type not in ("not_set", "same_upper", "same_lower", "valid"):
        raise ValueError(
            f"{op}: pad_type must be 'not_set', 'same_upper', 'same_lower' or 'valid'; "
            f"got {pad_type!r}."
        )
    out = [int(s) for s in output_shape][-n:] if len(output_shape) else None
    if out is not None and len(output_shape) not in (n, n + 2):
        raise ValueError(
            f"{op}: output_shape needs the {n} spatial sizes (or the whole output shape); got "
            f"{list(output_shape)}."
        )
    if out is None and pad_type in ("same_upper", "same_lower"):
        out = [i * s for i, s in zip(in_shape, stride, strict=True)]
    if out is None:
        return (
            [0] * (2 * n)
            if pad_type == "valid"
            else _pads(op, n, padding, "not_set", (), (), (), ())
        )
    begins, ends = [], []
    for f, o in zip(full, out, strict=True):
        total = f - o
        half = int(total / 2)  # C++ division, toward zero
        begins.append(half if pad_type == "same_upper" else total - half)
        ends.append(total - half if pad_type == "same_upper" else half)
    return begins + ends
