"""``popxl.ops``: PopXL's op names as thin wrappers over captured torch functions.

Each op checks its PopXL-specific arguments, then runs the torch function on the handles;
the capture layer records the aten ops, so shapes and dtypes come from torch itself.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from .. import dtypes as _dtypes
from ..capture import call_torch
from ..errors import given
from ..ir.attrs import FLOAT_FORMATS, PrintOptions
from ..ir.context import gcg
from ..ir.graph import Op, OpKind
from ..ir.tensor import Constant, HostTensor, Tensor, _fake_like, constant
from ..opdefs.host import host_load, host_store
from ..opdefs.ipu_copy import ipu_copy
from . import addons_needs, collectives, var_updates
from ._intsafe import int_safe
from .addons_needs import *  # noqa: F403  (issue 15: names popxl-addons programs use)
from .call import CallSiteInfo, call, call_with_info, repeat, repeat_with_info
from .conditional import conditional, conditional_with_info
from .more import (
    PadType,
    _keep_int,
    add_,
    average_pool,
    batch_norm_inference,
    ceil,
    concat_,
    conv,
    create_random_seed,
    cumsum,
    detach_,
    dynamic_slice,
    dynamic_update,
    dynamic_update_,
    exp_,
    floor,
    gelu_,
    geluerf,
    group_norm,
    histogram,
    identity,
    increment_mod_,
    interpolate,
    io_tile_copy,
    isfinite,
    isinf,
    isnan,
    l1,
    l2,
    logsum,
    logsumexp,
    max_pool,
    mean,
    median,
    prod,
    random_normal,
    random_uniform,
    relu_,
    remote_code_load,
    roi_align,
    scatter,
    sign,
    split_random_seed,
    sum,
    sumsquare,
)
from .remote import remote_load, remote_load_, remote_store
from .var_updates import (
    accumulate_,
    accumulate_mean_,
    accumulate_moving_average_,
    accumulate_moving_average_square_,
    accumulate_square_,
    accumulator_scale_,
    accumulator_zero_,
    adam_updater,
    adam_var_update,
    adamax_updater,
    copy_var_update_,
    lamb_square,
    lamb_updater,
    scaled_add,
    scaled_add_,
    sparse_accumulate_,
)

__all__ = [
    # elementwise
    "add", "sub", "mul", "div", "neg", "negate", "abs", "exp", "log", "sqrt", "pow", "fmod",
    "relu", "gelu", "tanh", "sigmoid", "swish", "softmax", "log_softmax", "cos", "sin",
    "logical_and", "logical_or", "logical_not", "equal", "greater", "less", "where",
    "max", "min", "maximum", "minimum", "increment_mod", "clip",
    # linear algebra and shape
    "matmul", "reshape", "reshape_", "transpose", "transpose_", "flatten", "flatten_",
    "slice", "subsample", "concat", "split", "squeeze", "unsqueeze", "cast", "detach",
    "gather", "onehot", "argmax", "argmin", "topk", "layer_norm", "dropout", "ipu_copy",
    "init",
    # reductions
    "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod",
    "reduce_sum_square", "reduce_median",
    # losses
    "nll_loss", "nll_loss_with_softmax_grad",
    # host io, remote, calls
    "host_load", "host_store", "remote_load", "remote_load_", "remote_store",
    "call", "call_with_info", "repeat", "repeat_with_info", "CallSiteInfo", "print_tensor",
    "conditional", "conditional_with_info",
    # var updates
    "accumulate_", "accumulate_square_", "accumulate_mean_", "accumulate_moving_average_",
    "accumulate_moving_average_square_", "accumulator_scale_", "accumulator_zero_",
    "copy_var_update_", "sparse_accumulate_", "adam_updater", "adam_var_update",
    "lamb_square", "scaled_add", "scaled_add_",
    "collectives", "var_updates", "lamb_updater", "adamax_updater",
    # upstream's other op names (ops/more.py), slice_ and tied_gather
    "add_", "relu_", "gelu_", "exp_", "concat_", "detach_", "increment_mod_", "identity", "io_tile_copy", "ceil", "floor", "sign", "isfinite", "isinf", "isnan", "geluerf", "cumsum", "histogram", "mean", "sum", "sumsquare", "prod", "median", "l1", "l2", "logsum", "logsumexp", "group_norm", "batch_norm_inference", "average_pool", "max_pool", "conv", "PadType", "dynamic_slice", "dynamic_update", "dynamic_update_", "scatter", "random_uniform", "random_normal", "split_random_seed", "create_random_seed", "remote_code_load", "interpolate", "roi_align", "slice_", "tied_gather",
]  # fmt: skip


# What the binary ops accept on either side: a tensor, or host data made a constant of the
# other side's dtype (``add(t, 1.0)``).
_TensorLike = Tensor | HostTensor


def _coerce(t: Tensor, other) -> Tensor:
    if isinstance(other, Tensor):
        return other
    return constant(other, t.dtype)


def _check_tensor(t, op: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"ops.{op} expects a popxl Tensor; got {given(t)}.")
    return t


def _binary(fn, lhs, rhs, op):
    if not isinstance(lhs, Tensor) and isinstance(rhs, Tensor):
        lhs = _coerce(rhs, lhs)
    lhs = _check_tensor(lhs, op)
    return call_torch(int_safe(fn), (lhs, _coerce(lhs, rhs)), {})


def _unary(fn, t, op, **kwargs):
    return call_torch(int_safe(fn), (_check_tensor(t, op),), kwargs)


# ---- elementwise --------------------------------------------------------------------------


def add(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.add, lhs, rhs, "add")


def sub(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.sub, lhs, rhs, "sub")


def _div(a, b):
    # PopXL `/` on integer tensors is integer division (truncating), as in C++.
    if not a.dtype.is_floating_point and not a.dtype.is_complex:
        return torch.div(a, b, rounding_mode="trunc")
    return torch.div(a, b)


def mul(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.mul, lhs, rhs, "mul")


def div(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(_div, lhs, rhs, "div")


def fmod(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.fmod, lhs, rhs, "fmod")


def pow(t: Tensor, e) -> Tensor:
    return _binary(torch.pow, t, e, "pow")


def neg(t: Tensor) -> Tensor:
    return _unary(torch.neg, t, "neg")


negate = neg


def abs(t: Tensor) -> Tensor:
    return _unary(torch.abs, t, "abs")


def exp(t: Tensor) -> Tensor:
    return _unary(torch.exp, t, "exp")


def log(t: Tensor) -> Tensor:
    return _unary(torch.log, t, "log")


def sqrt(t: Tensor) -> Tensor:
    return _unary(torch.sqrt, t, "sqrt")


def cos(t: Tensor) -> Tensor:
    return _unary(torch.cos, t, "cos")


def sin(t: Tensor) -> Tensor:
    return _unary(torch.sin, t, "sin")


def relu(t: Tensor) -> Tensor:
    return _unary(torch.relu, t, "relu")


def gelu(t: Tensor) -> Tensor:
    # PopLibs' GELU is the tanh approximation.
    return _unary(torch.nn.functional.gelu, t, "gelu", approximate="tanh")


def tanh(t: Tensor) -> Tensor:
    return _unary(torch.tanh, t, "tanh")


def sigmoid(t: Tensor) -> Tensor:
    return _unary(torch.sigmoid, t, "sigmoid")


def swish(t: Tensor) -> Tensor:
    return _unary(torch.nn.functional.silu, t, "swish")


def softmax(t: Tensor, axis: int) -> Tensor:
    return _unary(torch.softmax, t, "softmax", dim=axis)


def log_softmax(t: Tensor, axis: int) -> Tensor:
    return _unary(torch.log_softmax, t, "log_softmax", dim=axis)


def logical_and(lhs: Tensor, rhs: Tensor) -> Tensor:
    return _binary(torch.logical_and, lhs, rhs, "logical_and")


def logical_or(lhs: Tensor, rhs: Tensor) -> Tensor:
    return _binary(torch.logical_or, lhs, rhs, "logical_or")


def logical_not(t: Tensor) -> Tensor:
    return _unary(torch.logical_not, t, "logical_not")


def equal(lhs: Tensor, rhs: Tensor) -> Tensor:
    return _binary(torch.eq, lhs, rhs, "equal")


def greater(input: Tensor, other: Tensor) -> Tensor:
    return _binary(torch.gt, input, other, "greater")


def less(input: Tensor, other: Tensor) -> Tensor:
    return _binary(torch.lt, input, other, "less")


def where(condition: Tensor, lhs, rhs) -> Tensor:
    condition = _check_tensor(condition, "where")
    ref = lhs if isinstance(lhs, Tensor) else rhs
    if not isinstance(ref, Tensor):
        raise TypeError("ops.where needs at least one of lhs / rhs to be a popxl Tensor.")
    return call_torch(torch.where, (condition, _coerce(ref, lhs), _coerce(ref, rhs)), {})


def maximum(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.maximum, lhs, rhs, "maximum")


def minimum(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.minimum, lhs, rhs, "minimum")


def max(ts: Iterable[Tensor]) -> Tensor:
    """Elementwise maximum of several tensors."""
    ts = list(ts)
    out = ts[0]
    for t in ts[1:]:
        out = maximum(out, t)
    return out


def min(ts: Iterable[Tensor]) -> Tensor:
    """Elementwise minimum of several tensors."""
    ts = list(ts)
    out = ts[0]
    for t in ts[1:]:
        out = minimum(out, t)
    return out


def clip(t: Tensor, min: float = -math.inf, max: float = math.inf) -> Tensor:
    return _unary(torch.clamp, t, "clip", min=min, max=max)


def increment_mod(t: Tensor, increment: float, modulus: float) -> Tensor:
    return fmod(add(t, increment), modulus)


# ---- linear algebra and shapes ------------------------------------------------------------


def matmul(lhs: Tensor, rhs: Tensor, available_memory_proportion=None, serialise_mode=None,
           serialise_factor=1, output_type=None, partials_type=None) -> Tensor:  # fmt: skip
    out = _binary(torch.matmul, lhs, rhs, "matmul")
    if output_type is not None:
        out = cast(out, output_type)
    return out


def _reshape_target(t: Tensor, shape: Sequence[int], name: str) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if builtins.sum(1 for s in shape if s == -1) > 1:
        raise ValueError(f"{name}: at most one -1 is allowed in the shape; got {shape}.")
    known = math.prod(s for s in shape if s != -1)
    if -1 not in shape and known != t.nelms or (-1 in shape and (known == 0 or t.nelms % known)):
        raise ValueError(
            f"{name}: cannot reshape {t.id!r} of shape {t.shape} ({t.nelms} elements) to "
            f"{shape}; the new shape must hold the same number of elements."
        )
    return shape


def reshape(t: Tensor, shape: Sequence[int]) -> Tensor:
    return call_torch(torch.reshape, (t, _reshape_target(t, shape, "reshape")), {})


def reshape_(t: Tensor, shape: Sequence[int]) -> Tensor:
    """The in-place (aliasing) reshape; see Note [reshape_ of a permuted tensor]."""
    shape = _reshape_target(t, shape, "reshape_")
    if _is_viewable(t, shape):
        return call_torch(torch.Tensor.view, (t, shape), {})
    return call_torch(torch.reshape, (t, shape), {})


# Note [reshape_ of a permuted tensor]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Upstream's reshape_ aliases its input whatever the input's layout: Poplar tensors are
# expressions over tile memory, so a reshape of a transposed tensor is still a view. A torch
# view needs strides, which a permuted tensor folded into fewer axes may not have (torch's
# "Cannot view a tensor with shape ... and strides ..."). There the result is a reshaped copy:
# the values are upstream's; in-place writes through the result do not reach the input (GPT-3
# and BERT's attention reshape transposed heads and only read the result).


def _is_viewable(t: Tensor, shape: tuple[int, ...]) -> bool:
    probe = torch.empty_strided(t._fake.shape, t._fake.stride(), device="meta")
    try:
        probe.view(shape)
    except (RuntimeError, ValueError):  # meta tensors raise one, torch's refs the other
        return False
    return True


def transpose(t: Tensor, permutation: Sequence[int] | None = None) -> Tensor:
    perm = tuple(reversed(range(t.rank))) if permutation is None else tuple(permutation)
    if sorted(p % t.rank if t.rank else p for p in perm) != list(range(t.rank)):
        raise ValueError(
            f"transpose: {perm} is not a permutation of the {t.rank} axes of {t.id!r}."
        )
    return call_torch(torch.permute, (t, perm), {})


def transpose_(t: Tensor, permutation: Sequence[int] | None = None) -> Tensor:
    return transpose(t, permutation)


def flatten(t: Tensor) -> Tensor:
    return reshape(t, (t.nelms,))


def flatten_(t: Tensor) -> Tensor:
    """The in-place (aliasing) flatten: ``reshape_(t, (t.nelms,))``."""
    return reshape_(t, (t.nelms,))


def slice(t: Tensor, start=None, stop=None, step=None, axis=None) -> Tensor:
    """numpy-style slicing along ``axis`` (ints or lists, one entry per axis)."""

    def as_list(x):
        return None if x is None else ([x] if isinstance(x, int) else list(x))

    starts, stops, steps, axes = map(as_list, (start, stop, step, axis))
    n = len(next(x for x in (starts, stops, steps, [0]) if x is not None))
    axes = axes or list(range(n))
    key: list = [builtins_slice(None)] * t.rank
    for i, ax in enumerate(axes):
        key[ax] = builtins_slice(
            starts[i] if starts else None, stops[i] if stops else None, steps[i] if steps else None
        )
    return _getitem(t, tuple(key))


builtins_slice = __builtins__["slice"] if isinstance(__builtins__, dict) else __builtins__.slice


def slice_(t: Tensor, start=None, stop=None, step=None, axis=None) -> Tensor:
    """``slice`` whose output is a view of ``t`` (upstream's in-place slice)."""
    return slice(t, start, stop, step, axis)


def tied_gather(t: Tensor, indices: Tensor, axis: int = 0, available_memory_proportion=None,
                zero_OOR: bool = False) -> Tensor:  # noqa: N803  # fmt: skip
    """``gather`` whose gradient upstream shares the weight's tile layout; same values."""
    return gather(t, indices, axis, available_memory_proportion, zero_OOR)


def subsample(t: Tensor, strides: int | Sequence[int]) -> Tensor:
    """Every ``strides[i]``-th element along axis ``i`` (an int means ``[int]``, for a rank-1
    ``t``)."""
    t = _check_tensor(t, "subsample")
    strides = [strides] if isinstance(strides, int | np.integer) else list(strides)
    if len(strides) != t.rank:
        raise ValueError(
            "The length of subsample `strides` must match the rank of the input tensor. Got "
            f"{len(strides)} strides {strides} for {t.id!r} of shape {t.shape}."
        )
    if any(isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 1 for s in strides):
        raise ValueError(f"subsample: strides must be positive ints; got {strides}.")
    return _getitem(t, tuple(builtins_slice(None, None, int(s)) for s in strides))


def concat(ts: Iterable[Tensor], axis: int = 0) -> Tensor:
    ts = [_check_tensor(t, "concat") for t in ts]
    _check_concat_types(ts)
    return call_torch(torch.cat, (ts,), {"dim": axis})


def _check_concat_types(ts: list[Tensor]) -> None:
    # Upstream raises rather than promoting (torch.cat would promote float16 to float32).
    types = [t.dtype for t in ts]
    if len(set(types)) > 1:
        raise TypeError(
            f"All inputs to a concat operation must have the same type: {types}. Cast them to "
            "one dtype first (ops.cast)."
        )


def split(t: Tensor, splits: int | list[int], axis: int = 0) -> list[Tensor]:
    """Split into ``splits`` equal parts (int) or parts of the listed sizes."""
    size = t.shape[axis]
    if isinstance(splits, int):
        if size % splits:
            raise ValueError(f"split: axis {axis} of size {size} is not divisible by {splits}.")
        sizes = [size // splits] * splits
    else:
        sizes = list(splits)
        if builtins.sum(sizes) != size:
            raise ValueError(f"split: sizes {sizes} do not add up to axis {axis} size {size}.")
    return list(call_torch(torch.split, (t, sizes), {"dim": axis}))


def squeeze(t: Tensor, axes: Sequence[int] | None = None) -> Tensor:
    if axes is None:
        return call_torch(torch.squeeze, (t,), {})
    return call_torch(torch.squeeze, (t, tuple(axes)), {})


def unsqueeze(t: Tensor, axes: Sequence[int]) -> Tensor:
    for ax in sorted(axes):
        t = call_torch(torch.unsqueeze, (t, ax), {})
    return t


def cast(t: Tensor, data_type) -> Tensor:
    dt = _dtypes.dtype.as_dtype(data_type)
    return call_torch(torch.Tensor.to, (t, dt.as_torch()), {})


def detach(t: Tensor) -> Tensor:
    return call_torch(torch.Tensor.detach, (t,), {})


def gather(t: Tensor, indices: Tensor, axis: int = 0, available_memory_proportion=None,
           zero_OOR: bool = False) -> Tensor:  # fmt: skip
    """numpy ``take``: output shape ``t.shape[:axis] + indices.shape + t.shape[axis+1:]``.

    With ``zero_OOR=True`` an index outside ``[0, t.shape[axis])`` (negative ones included)
    gives zeros, as upstream; without it upstream returns unspecified data, and the simulator
    raises when the program runs.
    """
    if not isinstance(indices, Tensor):
        indices = constant(np.asarray(indices), _dtypes.int32)
    flat = call_torch(torch.reshape, (indices, (-1,)), {})
    flat = call_torch(torch.Tensor.to, (flat, torch.int64), {})
    if zero_OOR:
        out = call_torch(_take_zero_out_of_range, (t, axis, flat), {})
    else:
        out = call_torch(torch.index_select, (t, axis, flat), {})
    shape = (*t.shape[:axis], *indices.shape, *t.shape[axis + 1 :])
    return call_torch(torch.reshape, (out, shape), {})


def _take_zero_out_of_range(x: torch.Tensor, axis: int, idx: torch.Tensor) -> torch.Tensor:
    size = x.shape[axis]
    valid = (idx >= 0) & (idx < size)
    rows = torch.index_select(x, axis, torch.where(valid, idx, torch.zeros_like(idx)))
    # `where`, not a multiply by the mask, so inf/nan rows picked by the clamped index vanish.
    shape = [1] * x.dim()
    shape[axis] = idx.shape[0]
    return torch.where(valid.reshape(shape), rows, torch.zeros((), dtype=x.dtype))


def onehot(t: Tensor, num_classes: Tensor | int, values: Tensor, axis: int = -1) -> Tensor:
    """One-hot encode ``t`` (ONNX OneHot): the output has a class axis of size ``num_classes``
    inserted at ``axis`` (negative counts from the end of the output), holding ``values[1]``
    where the class equals the index and ``values[0]`` elsewhere. Indices outside
    ``[0, num_classes)`` give a row of ``values[0]``.

    ``num_classes`` is a scalar popxl Constant (its value fixes the output shape, as upstream
    PopXL reads it at graph-construction time) or a Python int. ``axis`` defaults to -1 (the
    ONNX default); upstream PopXL requires it.
    """
    t = _check_tensor(t, "onehot")
    values = _check_tensor(values, "onehot")
    n = _onehot_depth(num_classes)
    if values.shape != (2,):
        raise ValueError(
            f"onehot: values must have shape (2,) holding [off_value, on_value]; got "
            f"{values.id!r} of shape {values.shape}."
        )
    rank = t.rank + 1
    if not -rank <= axis < rank:
        raise ValueError(
            f"onehot: axis {axis} is out of range for the rank-{rank} output of {t.id!r} "
            f"(shape {t.shape}); use an axis in [{-rank}, {rank - 1}]."
        )
    return call_torch(_onehot_torch, (t, values, n, axis % rank), {})


def _onehot_depth(num_classes) -> int:
    if isinstance(num_classes, Tensor):
        if not isinstance(num_classes, Constant):
            raise TypeError(
                f"onehot: num_classes {num_classes.id!r} must be a popxl.constant (its value "
                "sets the output shape, so it must be known when the graph is built); got a "
                f"{type(num_classes).__name__}. Pass popxl.constant(n, popxl.int32) or an int."
            )
        data = num_classes.data
        if data.size != 1 or not np.issubdtype(data.dtype, np.integer):
            raise ValueError(
                "onehot: num_classes must be a scalar integer constant; got one of shape "
                f"{data.shape} and dtype {data.dtype}."
            )
        n = int(data.reshape(()))
    elif isinstance(num_classes, int | np.integer) and not isinstance(num_classes, bool):
        n = int(num_classes)
    else:
        raise TypeError(
            f"onehot: num_classes must be a scalar popxl constant or an int; got {num_classes!r}."
        )
    if n < 1:
        raise ValueError(f"onehot: num_classes must be at least 1; got {n}.")
    return n


def _onehot_torch(t, values, n, axis):
    classes = torch.arange(n, device=t.device)
    hot = t.to(torch.int64).unsqueeze(-1) == classes
    return torch.where(hot, values[1], values[0]).movedim(-1, axis)


def argmax(t: Tensor, dim: int = 0, keepdim: bool = False) -> Tensor:
    return cast(call_torch(torch.argmax, (t,), {"dim": dim, "keepdim": keepdim}), _dtypes.int32)


def argmin(t: Tensor, dim: int = 0, keepdim: bool = False) -> Tensor:
    return cast(call_torch(torch.argmin, (t,), {"dim": dim, "keepdim": keepdim}), _dtypes.int32)


def topk(t: Tensor, k: int, axis: int, largest: bool = True, sorted: bool = True):
    values, idx = call_torch(
        torch.topk, (t, k), {"dim": axis, "largest": largest, "sorted": sorted}
    )
    return values, cast(idx, _dtypes.int32)


def layer_norm(t: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    return call_torch(torch.nn.functional.layer_norm, (t, (t.shape[-1],), weight, bias, eps), {})


def dropout(t: Tensor, seed_tensor: Tensor | None = None, p: float = 0.5) -> Tensor:
    """Dropout with probability ``p``. Replicas draw different masks (vmap randomness)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1); got {p}.")
    return call_torch(torch.nn.functional.dropout, (t,), {"p": p, "training": True})


def init(shape, dtype, name: str | None = None, init_type: str = "zero", meta_shape=None) -> Tensor:
    if init_type not in ("zero", "undef"):
        raise ValueError(f"init_type must be 'zero' or 'undef'; got {init_type!r}.")
    dt = _dtypes.dtype.as_dtype(dtype)
    out = call_torch(torch.zeros, (tuple(shape),), {"dtype": dt.as_torch()})
    if meta_shape:
        out._meta_shape = tuple(meta_shape)
    return out


# ---- reductions ---------------------------------------------------------------------------


def _axes(t: Tensor, axis) -> list[int]:
    if axis is None:
        return list(range(t.rank))
    return [axis] if isinstance(axis, int) else list(axis)


def _reduce(fn, t: Tensor, axis, keepdims, **kwargs):
    axes = _axes(t, axis)
    if not axes:
        return call_torch(torch.clone, (t,), {})
    return call_torch(fn, (t, axes), {"keepdim": keepdims, **kwargs})


def _same_int_dtype(t: Tensor) -> dict:
    # PopXL reductions keep the input dtype; torch promotes integer sums and products to int64.
    return _keep_int(t)


def reduce_sum(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    return _reduce(int_safe(torch.sum), t, axis, keepdims, **_same_int_dtype(t))


def reduce_mean(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    return _reduce(torch.mean, t, axis, keepdims)


def reduce_max(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    return _reduce(torch.amax, t, axis, keepdims)


def reduce_min(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    return _reduce(torch.amin, t, axis, keepdims)


def reduce_prod(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    out = t
    for ax in sorted(_axes(t, axis), reverse=True):
        out = call_torch(
            int_safe(torch.prod), (out, ax), {"keepdim": keepdims, **_same_int_dtype(t)}
        )
    return out


def reduce_sum_square(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    return reduce_sum(mul(t, t), axis, keepdims)


def reduce_median(t: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    axes = _axes(t, axis)
    if len(axes) != 1:
        flat = reshape(t, (-1,))
        return call_torch(torch.median, (flat,), {})
    return call_torch(torch.median, (t, axes[0]), {"keepdim": keepdims})[0]


# ---- losses -------------------------------------------------------------------------------


def _label_rows(probs: Tensor, labels: Tensor):
    p2 = reshape(probs, (-1, probs.shape[-1]))
    l1 = call_torch(torch.Tensor.to, (reshape(labels, (-1,)), torch.int64), {})
    return p2, l1


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}.")


def nll_loss(probs: Tensor, labels: Tensor, ignore_index: int | None = None,
             reduction: str = "mean", log_prob: bool = False) -> Tensor:  # fmt: skip
    """Negative log likelihood of ``labels`` under ``probs`` (or log-probs)."""
    _check_reduction(reduction)
    p2, l1 = _label_rows(probs, labels)
    picked = call_torch(torch.gather, (p2, 1, call_torch(torch.unsqueeze, (l1, 1), {})), {})
    picked = reshape(picked, (-1,))
    if log_prob:
        rows = neg(picked)
    else:
        eps = 6.104e-5 if probs.dtype == _dtypes.float16 else 1e-7
        rows = neg(log(call_torch(torch.clamp, (picked,), {"min": eps})))
    return _reduce_rows(rows, l1, labels, ignore_index, reduction)


def _reduce_rows(rows, l1, labels, ignore_index, reduction):
    count = None
    if ignore_index is not None:
        mask = call_torch(torch.ne, (l1, ignore_index), {})
        rows = where(mask, rows, 0.0)
        count = call_torch(torch.clamp, (reduce_sum(cast(mask, rows.dtype)),), {"min": 1.0})
    if reduction == "none":
        return reshape(rows, labels.shape)
    total = reduce_sum(rows)
    if reduction == "sum":
        return total
    if count is not None:
        return div(total, count)
    return div(total, float(rows.shape[0]))


def nll_loss_with_softmax_grad(probs: Tensor, labels: Tensor, loss_grad=1,
                               ignore_index: int | None = None,
                               reduction: str = "mean") -> tuple[Tensor, Tensor]:  # fmt: skip
    """Loss of softmax ``probs`` and its gradient with respect to the softmax input."""
    _check_reduction(reduction)
    if ignore_index is None and reduction != "none" and not isinstance(loss_grad, Tensor):
        return _nll_softmax_grad_fused(probs, labels, float(loss_grad), reduction)
    if not isinstance(loss_grad, Tensor):
        loss_grad = constant(float(loss_grad), _dtypes.float32)
    p2, l1 = _label_rows(probs, labels)
    num_classes = probs.shape[-1]
    picked = call_torch(torch.gather, (p2, 1, call_torch(torch.unsqueeze, (l1, 1), {})), {})
    rows = neg(log(add(reshape(picked, (-1,)), 1e-7)))
    loss = _reduce_rows(rows, l1, labels, ignore_index, reduction)
    onehot_ = call_torch(torch.nn.functional.one_hot, (l1, num_classes), {})
    dx = sub(p2, cast(onehot_, probs.dtype))
    lg = cast(loss_grad, probs.dtype)
    if ignore_index is not None:
        mask = cast(call_torch(torch.ne, (l1, ignore_index), {}), probs.dtype)
        dx = mul(dx, call_torch(torch.unsqueeze, (mask, 1), {}))
        count = call_torch(torch.clamp, (reduce_sum(mask),), {"min": 1.0})
    if reduction == "none":
        dx = mul(dx, reshape(lg, (-1, 1)) if lg.nelms > 1 else lg)
    elif reduction == "sum":
        dx = mul(dx, lg)
    elif ignore_index is not None:
        dx = mul(dx, div(lg, count))
    else:
        # PopART divides the mean gradient by the first dimension only (see spec §9).
        dx = mul(dx, div(lg, float(probs.shape[0])))
    return loss, reshape(dx, probs.shape)


def _nll_softmax_grad_torch(probs, labels, loss_grad: float, reduction: str):
    # The same maths as the general path in a few fused torch ops (it runs every training
    # step): -log(p[label] + 1e-7) and dx = (p - onehot) * scale.
    p2 = probs.reshape(-1, probs.shape[-1])
    l1 = labels.reshape(-1).long()
    # gather + sum rather than nll_loss: under vmap nll_loss runs a Python decomposition.
    picked = torch.log(p2.gather(1, l1.unsqueeze(1)) + 1e-7).sum()
    loss = -picked if reduction == "sum" else -(picked / l1.shape[0])
    minus_one = torch.full((l1.shape[0], 1), -1.0, dtype=p2.dtype, device=p2.device)
    dx = p2.scatter_add(1, l1.unsqueeze(1), minus_one)
    # PopART divides the mean gradient by the first dimension only (see spec §9).
    scale = loss_grad if reduction == "sum" else loss_grad / probs.shape[0]
    return loss, (dx * scale).reshape(probs.shape)


def _nll_softmax_grad_fused(probs: Tensor, labels: Tensor, loss_grad: float, reduction: str):
    return call_torch(_nll_softmax_grad_torch, (probs, labels, loss_grad, reduction), {})


# ---- indexing -----------------------------------------------------------------------------


def _getitem(t: Tensor, key) -> Tensor:
    if isinstance(key, Tensor) or isinstance(key, np.ndarray | list):
        idx = key if isinstance(key, Tensor) else constant(np.asarray(key))
        if idx.dtype == _dtypes.bool:
            return where(idx, t, 0)
        return gather(t, idx, 0)
    t, key = _positive_steps(t, key)
    return call_torch(torch.Tensor.__getitem__, (t, key), {})


def _positive_steps(t: Tensor, key):
    """Rewrite negative-step slices (numpy semantics; torch has none) as flip + positive step.

    Original indices ``start, start+step, ...`` (step < 0) are ``dim-1-start, ...`` counting
    from the end, so flipping the axis turns them into an increasing slice.
    """
    items = key if isinstance(key, tuple) else (key,)
    if not any(isinstance(k, builtins_slice) and k.step is not None and k.step < 0 for k in items):
        return t, key
    used = builtins.sum(1 for k in items if k is not None and k is not Ellipsis)
    out, flips, ax = [], [], 0
    for k in items:
        if k is Ellipsis:
            ax += t.rank - used
        elif isinstance(k, builtins_slice) and k.step is not None and k.step < 0:
            dim = t.shape[ax]
            start, stop, step = k.indices(dim)
            n = len(range(start, stop, step))
            k = builtins_slice(
                dim - 1 - start, dim - 1 - start + n * -step if n else dim - 1 - start, -step
            )
            flips.append(ax)
        if k is not None and k is not Ellipsis:
            ax += 1
        out.append(k)
    return call_torch(torch.flip, (t, flips), {}), tuple(out)


# ---- host IO and printing -----------------------------------------------------------------


def print_tensor(t: Tensor, title: str | None = None, print_self: bool = True,
                 print_gradient: bool = False, summarise_threshold: int = 1000,
                 edge_items: int = 3, max_line_width: int = 75, digits: int = 8,
                 float_format: str = "auto", separator: str = ",", open_bracket: str = "(",
                 close_bracket: str = ")") -> Tensor:  # fmt: skip
    """Print ``t`` to stderr at run time, once per replica, as ``{title}: {values}``; returns
    ``t`` unchanged (an identity for gradients).

    ``title`` defaults to ``print_{t.name}`` as upstream. Floats are printed with ``digits``
    significant digits (``float_format`` "auto", C++ showpoint style: ``0.0000000``), or
    ``digits`` decimals ("fixed", "scientific"), or ``digits`` significant digits without
    trailing zeros ("none"); elements are joined by ``separator`` inside ``open_bracket`` /
    ``close_bracket``, rows wrap at ``max_line_width``, and tensors with more than
    ``summarise_threshold`` elements show ``edge_items`` at each end of every axis.
    With ``print_gradient``, the gradient graph made by ``autodiff`` prints the gradient as
    ``{title}_gradient``.
    """
    graph = gcg()
    _check_tensor(t, "print_tensor")
    if float_format not in FLOAT_FORMATS:
        raise ValueError(
            f"print_tensor: float_format must be one of {', '.join(FLOAT_FORMATS)}; got "
            f"{float_format!r}."
        )
    for name, value in (("summarise_threshold", summarise_threshold), ("edge_items", edge_items),
                        ("max_line_width", max_line_width), ("digits", digits)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"print_tensor: {name} must be a non-negative int; got {value!r}.")
    out = Tensor._create(graph, t.name + "_print", _fake_like(t.shape, t.dtype), t.meta_shape)
    graph._append_op(
        Op(
            OpKind.PRINT,
            "PrintTensor",
            (t,),
            (out,),
            PrintOptions(
                title=f"print_{t.name}" if title is None else title,
                print_self=print_self,
                threshold=summarise_threshold,
                edge_items=edge_items,
                line_width=max_line_width,
                digits=digits,
                float_format=float_format,
                separator=separator,
                open_bracket=open_bracket,
                close_bracket=close_bracket,
                print_gradient=print_gradient,
            ),
        )
    )
    return out


__all__ += addons_needs.__all__  # noqa: F405  (issue 15: re-exported above)
