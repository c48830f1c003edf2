"""The rest of ``popxl.ops``: in-place variants, reductions, normalisation, pooling,
convolution, dynamic slicing, random numbers and seeds, and small elementwise ops.

Like the ops in ``ops/__init__.py`` they are thin wrappers: each checks its PopXL-specific
arguments and runs a torch function on the handles, which the capture layer records.
In-place variants (trailing ``_``) modify their first input and return it (an alias), as
upstream's in-place ops do.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from .. import dtypes as _dtypes
from ..capture import call_torch
from ..errors import given
from ..ir.context import gcg
from ..ir.graph import Graph
from ..ir.tensor import Tensor, constant
from ._intsafe import NARROW_UNSIGNED, int_safe, int_safe_inplace

__all__ = [
    "add_", "relu_", "gelu_", "exp_", "concat_", "detach_", "increment_mod_",
    "identity", "io_tile_copy", "ceil", "floor", "sign", "isfinite", "isinf", "isnan",
    "geluerf", "cumsum", "histogram",
    "mean", "sum", "sumsquare", "prod", "median", "l1", "l2", "logsum", "logsumexp",
    "group_norm", "batch_norm_inference", "average_pool", "max_pool", "conv", "PadType",
    "dynamic_slice", "dynamic_update", "dynamic_update_", "scatter",
    "random_uniform", "random_normal", "split_random_seed", "create_random_seed",
    "remote_code_load", "interpolate", "roi_align",
]  # fmt: skip

PadType = Literal["not_set", "same_upper", "same_lower", "valid"]


def _check(t, op: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"ops.{op} expects a popxl Tensor; got {given(t)}.")
    return t


def _as_tensor(x, like: Tensor) -> Tensor:
    return x if isinstance(x, Tensor) else constant(x, like.dtype)


# ---- in-place variants --------------------------------------------------------------------


def add_(lhs: Tensor, rhs) -> Tensor:
    """``lhs += rhs`` in place; returns ``lhs`` (an alias). Differentiable."""
    lhs = _check(lhs, "add_")
    return call_torch(int_safe_inplace(torch.Tensor.add_), (lhs, _as_tensor(rhs, lhs)), {})


def _copy_into(t: Tensor, fn, op: str, *args, **kwargs) -> Tensor:
    def run(x, *a):
        return x.copy_(fn(x, *a, **kwargs))

    return call_torch(run, (_check(t, op), *args), {})


def relu_(t: Tensor) -> Tensor:
    """ReLU of ``t`` in place; returns ``t``."""
    return call_torch(torch.Tensor.relu_, (_check(t, "relu_"),), {})


def gelu_(t: Tensor) -> Tensor:
    """GELU (tanh approximation, as ``ops.gelu``) of ``t`` in place; returns ``t``."""
    return _copy_into(t, F.gelu, "gelu_", approximate="tanh")


def exp_(t: Tensor) -> Tensor:
    """``exp(t)`` in place; returns ``t``."""
    return call_torch(torch.Tensor.exp_, (_check(t, "exp_"),), {})


def concat_(ts: Iterable[Tensor], axis: int = 0) -> Tensor:
    """Concatenation whose output aliases its inputs upstream; the values are ``concat``'s."""
    ts = [_check(t, "concat_") for t in ts]
    types = [t.dtype for t in ts]
    if len(set(types)) > 1:
        raise TypeError(
            f"All inputs to a concat operation must have the same type: {types}. Cast them to "
            "one dtype first (ops.cast)."
        )
    return call_torch(torch.cat, (ts,), {"dim": axis})


def detach_(t: Tensor) -> Tensor:
    """``detach`` whose output aliases ``t``; gradients do not flow through it."""
    return call_torch(torch.Tensor.detach, (_check(t, "detach_"),), {})


def increment_mod_(t: Tensor, increment: float, modulus: float) -> Tensor:
    """``t = (t + increment) % modulus`` in place (fmod semantics); returns ``t``."""
    if modulus == 0:
        raise ValueError("increment_mod_: modulus must be non-zero; got 0.")

    def run(x):
        return x.copy_(int_safe(torch.fmod)(int_safe(torch.add)(x, increment), modulus))

    return call_torch(run, (_check(t, "increment_mod_"),), {})


# ---- small elementwise ops ----------------------------------------------------------------


def identity(t: Tensor) -> Tensor:
    """A copy of ``t``."""
    return call_torch(torch.clone, (_check(t, "identity"),), {})


def io_tile_copy(t: Tensor) -> Tensor:
    """Copy between compute and IO tiles: a copy on the simulator, which has one tile set."""
    return call_torch(torch.clone, (_check(t, "io_tile_copy"),), {})


def ceil(t: Tensor) -> Tensor:
    return call_torch(torch.ceil, (_check(t, "ceil"),), {})


def floor(t: Tensor) -> Tensor:
    return call_torch(torch.floor, (_check(t, "floor"),), {})


def sign(t: Tensor) -> Tensor:
    return call_torch(int_safe(torch.sign), (_check(t, "sign"),), {})


def isfinite(t: Tensor) -> Tensor:
    return call_torch(torch.isfinite, (_check(t, "isfinite"),), {})


def isinf(t: Tensor) -> Tensor:
    return call_torch(torch.isinf, (_check(t, "isinf"),), {})


def isnan(t: Tensor) -> Tensor:
    return call_torch(torch.isnan, (_check(t, "isnan"),), {})


def geluerf(t: Tensor) -> Tensor:
    """GELU with the exact erf formula (``ops.gelu`` is the tanh approximation)."""
    return call_torch(F.gelu, (_check(t, "geluerf"),), {})


def cumsum(t: Tensor, dim: int = 0) -> Tensor:
    """Cumulative sum along ``dim``, keeping ``t``'s dtype."""
    t = _check(t, "cumsum")
    if not -t.rank <= dim < max(t.rank, 1):
        raise ValueError(f"cumsum: dim {dim} is out of range for {t.id!r} of rank {t.rank}.")
    return call_torch(int_safe(torch.cumsum), (t, dim), {"dtype": t.dtype.as_torch()})


def histogram(t: Tensor, levels: Sequence[float], absolute_of_input: bool) -> Tensor:
    """Counts of ``t``'s elements in the bins ``(-inf, l0), [l0, l1), ..., [l_last, inf)``.

    Returns a uint32 tensor of ``len(levels) + 1`` counts.
    """
    t = _check(t, "histogram")
    edges = sorted(float(v) for v in levels)

    def run(x):
        x = x.abs() if absolute_of_input else x
        bounds = torch.tensor(edges, dtype=x.dtype, device=x.device)
        bins = torch.bucketize(x.reshape(-1), bounds, right=True)
        counts = F.one_hot(bins, len(edges) + 1).sum(0)
        return counts.to(torch.uint32)

    return call_torch(run, (t,), {})


# ---- reductions (upstream's names) --------------------------------------------------------


def _axes(t: Tensor, axis) -> list[int]:
    if axis is None:
        return list(range(t.rank))
    return [axis] if isinstance(axis, int) else list(axis)


def _reduce(fn, t: Tensor, axis, keepdims: bool, op: str, **kwargs) -> Tensor:
    t = _check(t, op)
    axes = _axes(t, axis)
    for ax in axes:
        if not -t.rank <= ax < max(t.rank, 1):
            raise ValueError(f"{op}: axis {ax} is out of range for {t.id!r} of rank {t.rank}.")
    if not axes:
        return call_torch(torch.clone, (t,), {})
    return call_torch(fn, (t, axes), {"keepdim": keepdims, **kwargs})


def _keep_int(t: Tensor) -> dict:
    # PopXL reductions keep the input dtype; torch promotes integer sums to int64.
    # uint16/32/64 sum in int64 and are cast back by int_safe (ops/_intsafe.py).
    if not t.dtype.is_int:
        return {}
    dt = t.dtype.as_torch()
    return {"dtype": torch.int64 if dt in NARROW_UNSIGNED else dt}


def mean(t: Tensor, axis: int | Iterable[int] | None = None, keepdims: bool = False) -> Tensor:
    """Arithmetic mean over ``axis`` (all axes when None)."""
    return _reduce(torch.mean, t, axis, keepdims, "mean")


def sum(t: Tensor, axis: int | Iterable[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``axis`` (all axes when None), in ``t``'s dtype."""
    return _reduce(int_safe(torch.sum), t, axis, keepdims, "sum", **_keep_int(t))


def sumsquare(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """Sum of squares over ``axis``."""

    def run(x, axes, keepdim):
        return (x * x).sum(axes, keepdim=keepdim)

    t = _check(t, "sumsquare")
    return call_torch(run, (t, _axes(t, axis), keepdims), {})


def prod(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """Product over ``axis`` in ``t``'s dtype."""

    t = _check(t, "prod")
    keep = _keep_int(t)

    def run(x, axes, keepdim):
        for ax in sorted((a % x.dim() for a in axes), reverse=True):
            x = torch.prod(x, ax, keepdim=keepdim, **keep)
        return x

    return call_torch(int_safe(run), (t, _axes(t, axis), keepdims), {})


def median(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """The lower median over ``axis`` (torch's and PopART's convention for even counts)."""
    t = _check(t, "median")
    axes = sorted(a % max(t.rank, 1) for a in _axes(t, axis))

    def run(x):
        # Move the reduced axes last, flatten them, take the median, restore kept dims.
        rest = [d for d in range(x.dim()) if d not in axes]
        y = x.permute(*rest, *axes).reshape(*[x.shape[d] for d in rest], -1)
        out = y.median(-1).values
        if keepdims:
            shape = [1 if d in axes else x.shape[d] for d in range(x.dim())]
            out = out.reshape(shape)
        return out

    return call_torch(run, (t,), {})


def l1(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """Sum of absolute values over ``axis``."""

    def run(x, axes, keepdim):
        return x.abs().sum(axes, keepdim=keepdim)

    t = _check(t, "l1")
    return call_torch(run, (t, _axes(t, axis), keepdims), {})


def l2(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """Euclidean norm over ``axis``."""

    def run(x, axes, keepdim):
        return (x * x).sum(axes, keepdim=keepdim).sqrt()

    t = _check(t, "l2")
    return call_torch(run, (t, _axes(t, axis), keepdims), {})


def logsum(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """``log(sum(t))`` over ``axis``."""

    def run(x, axes, keepdim):
        return x.sum(axes, keepdim=keepdim).log()

    t = _check(t, "logsum")
    return call_torch(run, (t, _axes(t, axis), keepdims), {})


def logsumexp(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """``log(sum(exp(t)))`` over ``axis``, computed stably."""
    return _reduce(torch.logsumexp, t, axis, keepdims, "logsumexp")


# ---- normalisation, pooling, convolution --------------------------------------------------


def group_norm(t: Tensor, weight: Tensor, bias: Tensor, num_groups: int,
               eps: float = 1e-5) -> Tensor:  # fmt: skip
    """Group normalisation over the channels (axis 1) of ``t`` in ``num_groups`` groups."""
    t = _check(t, "group_norm")
    if num_groups <= 0 or t.shape[1] % num_groups:
        raise ValueError(
            f"group_norm: {t.shape[1]} channels of {t.id!r} cannot be split into "
            f"{num_groups} groups; num_groups must divide the channel count."
        )
    return call_torch(F.group_norm, (t, num_groups, weight, bias, eps), {})


def batch_norm_inference(t: Tensor, scale: Tensor, bias: Tensor, mean: Tensor, var: Tensor,
                         epsilon: float = 1e-5, momentum: float = 0.9) -> Tensor:  # fmt: skip
    """``(t - mean) / sqrt(var + epsilon) * scale + bias`` over the channels (axis 1).

    ``momentum`` is accepted for upstream's signature; inference does not update statistics.
    """
    t = _check(t, "batch_norm_inference")
    return call_torch(F.batch_norm, (t, mean, var), {"weight": scale, "bias": bias, "eps": epsilon})


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
    t = _check(t, "average_pool")
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

    return call_torch(run, (t,), {})


def max_pool(t: Tensor, kernel_size: Sequence[int], stride: Sequence[int] | None = None,
             padding: Sequence[int] | None = None, out_pads=None,
             dilation: Sequence[int] | None = None, in_dilations=None,
             auto_pad: PadType = "not_set", ceil_mode: bool | None = None,
             storage_order: bool | None = None) -> Tensor:  # fmt: skip
    """Max pooling over the spatial axes of an ``(N, C, ...)`` tensor."""
    t = _check(t, "max_pool")
    n = _spatial(t, "max_pool")
    kernel, stride_ = tuple(kernel_size), _tuple(stride, n, 1)
    dil = _tuple(dilation, n, 1)
    if in_dilations or out_pads:
        raise ValueError("max_pool: in_dilations and out_pads are not supported by the simulator.")
    pads = _pads("max_pool", n, padding, auto_pad, t.shape[2:], kernel, stride_, dil)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[n - 1]

    def run(x):
        return pool(_pad_input(x, pads, -math.inf), kernel, stride_, 0, dil, bool(ceil_mode))

    return call_torch(run, (t,), {})


def conv(t: Tensor, weight: Tensor, stride: Sequence[int] | None = None,
         padding: Sequence[int] | None = None, dilation: Sequence[int] | None = None,
         groups: int = 1, pad_type: PadType = "not_set", available_memory_proportions=None,
         partials_types=None, enable_conv_dithering=None) -> Tensor:  # fmt: skip
    """Convolution of an ``(N, C_in, ...)`` input with ``(C_out, C_in / groups, ...)`` weights."""
    t = _check(t, "conv")
    n = _spatial(t, "conv")
    if t.shape[1] != weight.shape[1] * groups:
        raise ValueError(
            f"conv: input {t.id!r} has {t.shape[1]} channels but the weight expects "
            f"{weight.shape[1]} x {groups} groups = {weight.shape[1] * groups}."
        )
    stride_, dil = _tuple(stride, n, 1), _tuple(dilation, n, 1)
    pads = _pads("conv", n, padding, pad_type, t.shape[2:], weight.shape[2:], stride_, dil)
    fn = (F.conv1d, F.conv2d, F.conv3d)[n - 1]

    def run(x, w):
        return fn(_pad_input(x, pads, 0.0), w, None, stride_, 0, dil, groups)

    return call_torch(run, (t, weight), {})


# ---- dynamic slicing and scatter ----------------------------------------------------------


def _dynamic_check(op, t: Tensor, index: Tensor, axes, sizes) -> tuple[list[int], list[int]]:
    axes, sizes = [int(a) for a in axes], [int(s) for s in sizes]
    if len(axes) != len(sizes):
        raise ValueError(f"{op}: axes {axes} and sizes {sizes} must have the same length.")
    if not isinstance(index, Tensor):
        raise TypeError(f"{op}: index must be a popxl Tensor; got {given(index)}.")
    if index.nelms != len(axes):
        raise ValueError(f"{op}: index {index.id!r} needs {len(axes)} elements (one per axis); "
                         f"it has shape {index.shape}.")  # fmt: skip
    for a, s in zip(axes, sizes, strict=True):
        if not 0 < s <= t.shape[a]:
            raise ValueError(f"{op}: size {s} on axis {a} must be in [1, {t.shape[a]}].")
    return axes, sizes


def _window(x, index, ax_i: int, ax: int, size: int):
    # Start positions are taken modulo the axis size so an index never reads outside the
    # tensor (upstream leaves out-of-range indices undefined).
    start = index.reshape(-1)[ax_i].to(torch.int64)
    return (start + torch.arange(size, device=x.device)) % x.shape[ax]


def dynamic_slice(t: Tensor, index: Tensor, axes: Sequence[int], sizes: Sequence[int],
                  no_overlap: bool = False) -> Tensor:  # fmt: skip
    """The ``sizes`` window of ``t`` starting at the run-time ``index`` along ``axes``."""
    axes, sizes = _dynamic_check("dynamic_slice", _check(t, "dynamic_slice"), index, axes, sizes)

    def run(x, idx):
        for i, (ax, size) in enumerate(zip(axes, sizes, strict=True)):
            x = x.index_select(ax, _window(x, idx, i, ax, size))
        return x

    return call_torch(run, (t, index), {})


def _update(x, idx, u, axes, sizes):
    # Write the window one axis at a time: select the rows of the outer axes, write the
    # innermost window, then write those rows back.
    ax, size = axes[0], sizes[0]
    pos = _window(x, idx, len(idx.reshape(-1)) - len(axes), ax, size)
    if len(axes) == 1:
        return x.index_copy(ax, pos, u)
    inner = _update(x.index_select(ax, pos), idx, u, axes[1:], sizes[1:])
    return x.index_copy(ax, pos, inner)


def dynamic_update(t: Tensor, index: Tensor, t_update: Tensor, axes: Sequence[int],
                   sizes: Sequence[int], no_overlap: bool = False) -> Tensor:  # fmt: skip
    """A copy of ``t`` with ``t_update`` written at the run-time ``index`` along ``axes``."""
    axes, sizes = _dynamic_check("dynamic_update", _check(t, "dynamic_update"), index, axes, sizes)

    def run(x, idx, u):
        return _update(x, idx, u.to(x.dtype), axes, sizes)

    return call_torch(run, (t, index, t_update), {})


def dynamic_update_(t: Tensor, index: Tensor, t_update: Tensor, axes: Sequence[int],
                    sizes: Sequence[int], no_overlap: bool = False) -> Tensor:  # fmt: skip
    """``dynamic_update`` writing into ``t`` in place; returns ``t``."""
    axes, sizes = _dynamic_check(
        "dynamic_update_", _check(t, "dynamic_update_"), index, axes, sizes
    )

    def run(x, idx, u):
        return x.copy_(_update(x, idx, u.to(x.dtype), axes, sizes))

    return call_torch(run, (t, index, t_update), {})


def scatter(t: Tensor, indices: Tensor, values: Tensor, axis: int = 0,
            available_memory_proportion=None) -> Tensor:  # fmt: skip
    """ONNX ScatterElements: a copy of ``t`` with ``out[.., indices[i], ..] = values[i]``."""
    t = _check(t, "scatter")
    if tuple(indices.shape) != tuple(values.shape):
        raise ValueError(
            f"scatter: indices shape {indices.shape} and values shape {values.shape} must match."
        )

    def run(x, idx, v):
        return x.scatter(axis, idx.to(torch.int64), v.to(x.dtype))

    return call_torch(run, (t, indices, values), {})


# ---- random numbers and seeds -------------------------------------------------------------


def _check_seed(seed: Tensor, op: str) -> None:
    if not isinstance(seed, Tensor) or tuple(seed.shape) != (2,) or seed.dtype != _dtypes.uint32:
        raise ValueError(f"seed Tensor must be shape=(2,) dtype=uint32. Provided {seed}")


def random_uniform(seed_tensor: Tensor, shape: Sequence[int], low: float = 0.0,
                   high: float = 1.0, dtype=_dtypes.float32) -> Tensor:  # fmt: skip
    """Uniform samples in ``[low, high)``; replicas draw different samples."""
    _check_seed(seed_tensor, "random_uniform")
    dt = _dtypes.dtype.as_dtype(dtype)
    if not dt.is_floating_point:
        raise ValueError(f"random_uniform: dtype must be a float type; got {dt}.")

    def run(seed):
        # The seed is an input so the sample depends on it in the IR (as upstream).
        u = torch.rand(tuple(shape), dtype=dt.as_torch(), device=seed.device)
        return u * (high - low) + low

    return call_torch(run, (seed_tensor,), {})


def random_normal(seed_tensor: Tensor, shape: Sequence[int], mean: float = 0.0,
                  std: float = 1.0, dtype=_dtypes.float32) -> Tensor:  # fmt: skip
    """Normal samples with ``mean`` and ``std``; replicas draw different samples."""
    _check_seed(seed_tensor, "random_normal")
    dt = _dtypes.dtype.as_dtype(dtype)
    if not dt.is_floating_point:
        raise ValueError(f"random_normal: dtype must be a float type; got {dt}.")

    def run(seed):
        return torch.randn(tuple(shape), dtype=dt.as_torch(), device=seed.device) * std + mean

    return call_torch(run, (seed_tensor,), {})


def create_random_seed(seed: Tensor, modifier: Tensor) -> Tensor:
    """A new (2,) uint32 seed derived from ``seed`` and a scalar ``modifier``."""
    _check_seed(seed, "create_random_seed")

    def run(s, m):
        # An affine mix modulo 2**32 (a bijection of the low word for each modifier) so
        # different modifiers give different seeds; computed in int64 (see ops/_intsafe.py).
        w = s.to(torch.int64)
        m = m.to(torch.int64)
        hi = (w[0] * 69069 + m * 2654435761 + 1) % (1 << 32)
        lo = (w[1] * 1664525 + m * 40503 + 1013904223) % (1 << 32)
        return torch.stack([hi, lo]).to(torch.uint32)

    return call_torch(run, (seed, modifier), {})


def split_random_seed(seed: Tensor, n: int = 2) -> tuple[Tensor, ...]:
    """``n`` new seeds from ``seed``: ``seed, s1 = ops.split_random_seed(seed)``."""
    _check_seed(seed, "split_random_seed")
    return tuple(create_random_seed(seed, constant(i, _dtypes.uint32)) for i in range(n))


# ---- code loading -------------------------------------------------------------------------


# Upstream's code locations (popxl/ops/remote_code_load.py, CODE_LOCATION); only
# "executable" is implemented there, the buffers raise NotImplementedError.
_CODE_LOCATIONS = ("executable", "compute_buffer", "io_buffer")


def remote_code_load(graph: Graph, destination: str) -> None:
    """Load ``graph``'s code from Streaming Memory into ``destination`` ("executable") before
    it is called.

    The simulator keeps all code resident; the load is recorded, and the memory report shows
    the graph's code as kept in streaming memory and loaded on demand (``Code location``).
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"remote_code_load: graph must be a popxl Graph; got {given(graph)}.")
    if destination not in _CODE_LOCATIONS:
        raise ValueError(
            f"Not a valid location: {destination!r}. Must choose from: "
            f"{', '.join(_CODE_LOCATIONS)} (remote_code_load destination)."
        )
    parent = gcg()
    if parent == graph:
        raise ValueError(
            f"The remote_code_load op cannot load the code for the graph it resides in "
            f"({graph.id})."
        )
    if graph.ir is not parent.ir:
        raise ValueError(
            f"remote_code_load: {graph.id!r} belongs to {graph.ir!r}, not to {parent.ir!r} of the "
            "current graph; load a graph of the same Ir."
        )
    if destination != "executable":
        raise NotImplementedError(
            f"destination == '{destination}' for remote_code_load op, graph {graph.id} not "
            "supported (upstream implements only 'executable')."
        )
    parent.ir._check_mutable()
    parent.ir._code_loads.append((parent, graph, destination))


_NEAREST_ROUNDING: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "round_prefer_floor": lambda x: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x: np.floor(x + 0.5),
    "floor": np.floor,
    "ceil": np.ceil,
}
_RESIZE_MODES = ("nearest", "linear", "cubic")
_RESIZE_COORDINATES = (
    "half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize",
)  # fmt: skip
_CUBIC_A = -0.75  # ONNX Resize's default cubic_coeff_a (also torch's bicubic)


def interpolate(t: Tensor, scale_factor: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
                mode: str = "nearest", nearest_mode: str = "round_prefer_floor",
                coordinate_transformation_mode: str = "half_pixel", *,
                output_size: Sequence[int] | None = None) -> Tensor:  # fmt: skip
    """Resize ``t`` (ONNX Resize, as upstream PopXL): each output axis has
    ``floor(length * scale)`` elements; output index ``i`` reads the source coordinate given by
    ``coordinate_transformation_mode`` (half_pixel ``(i + 0.5) / scale - 0.5``,
    pytorch_half_pixel (0 for a length-1 output), align_corners
    ``i * (length - 1) / (out_length - 1)``, asymmetric ``i / scale``, tf_crop_and_resize with
    the full region), sampled with ``mode`` "nearest" (rounded by ``nearest_mode``), "linear" or
    "cubic" (coefficient -0.75); samples beyond the edges repeat the edge element.

    ``output_size`` (keyword only, not in upstream PopXL) gives the output shape instead of
    ``scale_factor``.
    """
    t = _check(t, "interpolate")
    if mode not in _RESIZE_MODES:
        raise ValueError(f"interpolate type {mode} is not valid, must be nearest, linear or cubic.")
    if nearest_mode not in _NEAREST_ROUNDING:
        raise ValueError(
            f"interpolate type {nearest_mode} is not valid, must be round_prefer_floor, "
            "round_prefer_ceil, floor or ceil."
        )
    if coordinate_transformation_mode not in _RESIZE_COORDINATES:
        raise ValueError(
            f"interpolate type {coordinate_transformation_mode} is not valid, must be "
            "half_pixel, pytorch_half_pixel, align_corners, asymmetric or tf_crop_and_resize."
        )
    if mode != "nearest" and not t.dtype.is_floating_point:
        raise TypeError(
            f"interpolate: mode={mode!r} needs a floating-point tensor; {t.id!r} is "
            f"{t.dtype.name}. Cast it first, or use mode='nearest'."
        )
    if output_size is not None:
        sizes = [int(s) for s in output_size]
        if len(sizes) != t.rank or builtins.min(sizes, default=1) < 1:
            raise ValueError(
                f"interpolate: output_size needs {t.rank} positive values (one per axis of "
                f"{t.id!r}); got {list(output_size)}."
            )
        scales = [o / i for o, i in zip(sizes, t.shape, strict=True)]
    else:
        scales = [float(s) for s in scale_factor]
        if len(scales) != t.rank:
            raise ValueError(
                f"interpolate: scale_factor needs {t.rank} values (one per axis of {t.id!r}); "
                f"got {scales}."
            )
        if builtins.min(scales, default=1.0) <= 0:
            raise ValueError(f"interpolate: scale_factor values must be positive; got {scales}.")
        sizes = [math.floor(i * s) for i, s in zip(t.shape, scales, strict=True)]
        if 0 in sizes and t.nelms:
            raise ValueError(
                f"interpolate: scale_factor {scales} gives an empty output shape {sizes} for "
                f"{t.id!r} of shape {t.shape}."
            )
    # Per axis: source indices and weights, computed here in float64 (they depend only on the
    # shapes) and applied as gathers plus a weighted sum; resize is separable per axis.
    plan = []
    for ax, (length, size, scale) in enumerate(zip(t.shape, sizes, scales, strict=True)):
        src = _resize_source(coordinate_transformation_mode, length, size, scale)
        taps = _resize_taps(mode, nearest_mode, src, length)
        if len(taps) == 1 and size == length and np.array_equal(taps[0][0], np.arange(length)):
            continue
        plan.append((ax, taps))

    def run(x):
        for ax, taps in plan:
            shape = [1] * x.dim()
            shape[ax] = -1
            total = None
            for idx, weight in taps:
                picked = x.index_select(ax, torch.from_numpy(idx).to(x.device))
                if weight is not None:
                    w = torch.from_numpy(weight).to(device=x.device, dtype=x.dtype)
                    picked = picked * w.reshape(shape)
                total = picked if total is None else total + picked
            x = total
        return x

    return call_torch(run, (t,), {})


def _resize_source(ctm: str, length: int, size: int, scale: float) -> np.ndarray:
    # float32 arithmetic in torch's order (reciprocal scale times the shifted index), so linear
    # weights round as torch.nn.functional.interpolate's do
    f32 = np.float32
    i = np.arange(size, dtype=f32)
    if ctm in ("half_pixel", "pytorch_half_pixel"):
        src = f32(1.0 / scale) * (i + f32(0.5)) - f32(0.5)
        return src if size > 1 or ctm == "half_pixel" else np.zeros(size, f32)
    if ctm == "asymmetric":
        return f32(1.0 / scale) * i
    corners = f32((length - 1) / (size - 1)) * i if size > 1 else np.zeros(size, f32)
    if ctm == "align_corners" or size > 1:
        return corners
    # tf_crop_and_resize over the whole region (upstream PopXL passes no roi)
    return np.full(size, 0.5 * (length - 1), f32)


def _resize_taps(mode: str, nearest_mode: str, src: np.ndarray, length: int):
    """[(source indices, weights or None)] whose weighted sum gives each output element;
    indices beyond the input repeat the edge element."""

    def clamp(idx):
        return np.clip(idx, 0, length - 1).astype(np.int64)

    if mode == "nearest":
        return [(clamp(_NEAREST_ROUNDING[nearest_mode](src)), None)]
    base = np.floor(src)
    s = src - base
    if mode == "linear":
        return [(clamp(base), np.float32(1.0) - s), (clamp(base + 1), s)]
    a = _CUBIC_A
    coeffs = [
        ((a * (s + 1) - 5 * a) * (s + 1) + 8 * a) * (s + 1) - 4 * a,
        ((a + 2) * s - (a + 3)) * s * s + 1,
        ((a + 2) * (1 - s) - (a + 3)) * (1 - s) * (1 - s) + 1,
        ((a * (2 - s) - 5 * a) * (2 - s) + 8 * a) * (2 - s) - 4 * a,
    ]
    return [(clamp(base + k - 1), c) for k, c in enumerate(coeffs)]


# ---- region-of-interest pooling -----------------------------------------------------------


def roi_align(t: Tensor, rois: Tensor, batch_index: Tensor, output_size: tuple[int, int],
              spatial_scale: float, sampling_ratio: int) -> Tensor:  # fmt: skip
    """Average-pool each region of interest of ``t`` into ``output_size`` bins (ONNX RoiAlign-10,
    the semantics of ``torchvision.ops.roi_align(..., aligned=False)``).

    ``t`` is ``[N, C, H, W]``; ``rois`` is ``[K, 4]`` boxes ``[x1, y1, x2, y2]`` in image
    coordinates (scaled by ``spatial_scale`` onto ``t``); ``batch_index`` is ``[K]`` integers
    naming each box's image. Each bin averages ``sampling_ratio`` x ``sampling_ratio``
    bilinear samples. Returns ``[K, C, output_size[0], output_size[1]]``.
    """
    t, rois, batch_index = (_check(x, "roi_align") for x in (t, rois, batch_index))
    if t.rank != 4:
        raise ValueError(f"roi_align: t must be [N, C, H, W]; got shape {t.shape}.")
    if rois.rank != 2 or rois.shape[1] != 4:
        raise ValueError(f"roi_align: rois must be [num_rois, 4] boxes [x1, y1, x2, y2]; got "
                         f"shape {rois.shape}.")  # fmt: skip
    if batch_index.shape != (rois.shape[0],) or not batch_index.dtype.is_int:
        raise ValueError(
            f"roi_align: batch_index must be an integer tensor of shape ({rois.shape[0]},) (one "
            f"image index per box); got {batch_index.dtype.name} {batch_index.shape}."
        )
    size = tuple(output_size)
    if len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
        raise ValueError(f"roi_align: output_size must be two positive ints (height, width); "
                         f"got {output_size!r}.")  # fmt: skip
    if not isinstance(sampling_ratio, int) or sampling_ratio < 1:
        # ONNX's adaptive grid (sampling_ratio 0) depends on each box's size: data-dependent.
        raise ValueError(
            f"roi_align: sampling_ratio must be a positive int (samples per bin side); got "
            f"{sampling_ratio!r}. The adaptive grid of sampling_ratio=0 is not supported."
        )
    scale = float(spatial_scale)

    def run(x, boxes, idx):
        n_h, n_w = size
        feats = x.index_select(0, idx.to(torch.int64))  # [K, C, H, W]
        ay = _roi_interpolation(boxes[:, 1], boxes[:, 3], scale, n_h, sampling_ratio, x.shape[2])
        ax = _roi_interpolation(boxes[:, 0], boxes[:, 2], scale, n_w, sampling_ratio, x.shape[3])
        out = torch.einsum("kph,kchw,kqw->kcpq", ay.to(x.dtype), feats, ax.to(x.dtype))
        return out

    return call_torch(run, (t, rois, batch_index), {})


def _roi_interpolation(start, end, scale: float, bins: int, grid: int, extent: int):
    """``[K, bins, extent]`` weights: row ``(k, b)`` averages the 1-D bilinear samples of bin
    ``b`` of box ``k`` along one axis (the 2-D sample weights are products of these)."""
    lo = start.to(torch.float32) * scale
    length = torch.clamp(end.to(torch.float32) * scale - lo, min=1.0)  # legacy: no -0.5 shift
    step = length / bins
    offsets = torch.arange(bins, dtype=torch.float32).reshape(1, bins, 1)
    sub = (torch.arange(grid, dtype=torch.float32).reshape(1, 1, grid) + 0.5) / grid
    pos = lo.reshape(-1, 1, 1) + (offsets + sub) * step.reshape(-1, 1, 1)  # [K, bins, grid]
    # Samples more than one pixel outside the map contribute zero; others clamp to the edge.
    inside = (pos >= -1.0) & (pos <= extent)
    pos = torch.clamp(pos, min=0.0)
    low = torch.clamp(torch.floor(pos), max=extent - 1)
    at_edge = low >= extent - 1
    pos = torch.where(at_edge, low, pos)
    high = torch.where(at_edge, low, low + 1)
    frac = pos - low
    cells = torch.arange(extent, dtype=torch.float32)
    weights = (1 - frac).unsqueeze(-1) * (cells == low.unsqueeze(-1)) + frac.unsqueeze(-1) * (
        cells == high.unsqueeze(-1)
    )
    weights = weights * inside.unsqueeze(-1)
    return weights.sum(2) / grid
