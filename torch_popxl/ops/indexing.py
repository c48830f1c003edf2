"""Indexing ops: numpy-style slicing (``slice``, ``subsample``, and ``Tensor.__getitem__``'s
``_getitem``), gathers, one-hot, the run-time-indexed ``dynamic_*`` windows and ``scatter``.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

import numpy as np
import torch

from .. import dtypes as _dtypes
from ..capture import call_torch
from ..errors import given
from ..ir.tensor import Constant, Tensor, constant
from ._common import _check_tensor, call_op
from .elementwise import where

__all__ = [
    "slice", "slice_", "subsample", "gather", "tied_gather", "onehot", "dynamic_slice",
    "dynamic_update", "dynamic_update_", "scatter"
]  # fmt: skip


# ---- slicing ------------------------------------------------------------------------------


def slice(t: Tensor, start=None, stop=None, step=None, axis=None) -> Tensor:
    """numpy-style slicing along ``axis`` (ints or lists, one entry per axis)."""
    return _getitem(t, _slice_key(t, start, stop, step, axis))


def _slice_key(t: Tensor, start, stop, step, axis) -> tuple:
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
    return tuple(key)


builtins_slice = __builtins__["slice"] if isinstance(__builtins__, dict) else __builtins__.slice


def slice_(t: Tensor, start=None, stop=None, step=None, axis=None) -> Tensor:
    """``slice`` whose output is a view of ``t`` (upstream's in-place slice): updates of either
    side reach the other."""
    return _getitem(t, _slice_key(t, start, stop, step, axis), alias=True)


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


def _getitem(t: Tensor, key, alias: bool = False) -> Tensor:
    """``t[key]``: a new tensor (``Tensor.__getitem__``, ``slice``), or with ``alias`` a view
    of ``t`` (``slice_``)."""
    for k in key if isinstance(key, tuple) else (key,):
        # bool is an int to Python, but upstream refuses it as a key (as it does floats).
        ok = (
            k is None or k is Ellipsis or isinstance(k, builtins_slice | Tensor | np.ndarray | list)
        )
        if not ok and (isinstance(k, bool) or not isinstance(k, int | np.integer)):
            raise TypeError(
                f"Tensor index {k!r} of type {type(k).__name__} is not supported: index with "
                "ints, slices, None, ... or an integer or boolean tensor / array / list."
            )
    if isinstance(key, Tensor) or isinstance(key, np.ndarray | list):
        idx = key if isinstance(key, Tensor) else constant(np.asarray(key))
        if idx.dtype == _dtypes.bool:
            return where(idx, t, 0)
        return gather(t, idx, 0)
    t, key = _positive_steps(t, key)
    return (call_torch if alias else call_op)(torch.Tensor.__getitem__, (t, key), {})


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
    return call_op(torch.flip, (t, flips), {}), tuple(out)


# ---- gather and one-hot -------------------------------------------------------------------


def gather(t: Tensor, indices: Tensor, axis: int = 0, available_memory_proportion=None,
           zero_OOR: bool = False) -> Tensor:  # fmt: skip
    """numpy ``take``: output shape ``t.shape[:axis] + indices.shape + t.shape[axis+1:]``.

    With ``zero_OOR=True`` an index outside ``[0, t.shape[axis])`` (negative ones included)
    gives zeros, as upstream; without it upstream returns unspecified data, and the simulator
    raises when the program runs.
    """
    if not isinstance(indices, Tensor):
        indices = constant(np.asarray(indices), _dtypes.int32)
    flat = call_op(torch.reshape, (indices, (-1,)), {})
    flat = call_op(torch.Tensor.to, (flat, torch.int64), {})
    if zero_OOR:
        out = call_op(_take_zero_out_of_range, (t, axis, flat), {})
    else:
        out = call_op(torch.index_select, (t, axis, flat), {})
    shape = (*t.shape[:axis], *indices.shape, *t.shape[axis + 1 :])
    return call_op(torch.reshape, (out, shape), {})


def tied_gather(t: Tensor, indices: Tensor, axis: int = 0, available_memory_proportion=None,
                zero_OOR: bool = False) -> Tensor:  # noqa: N803  # fmt: skip
    """``gather`` whose gradient upstream shares the weight's tile layout; same values."""
    return gather(t, indices, axis, available_memory_proportion, zero_OOR)


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
    return call_op(_onehot_torch, (t, values, n, axis % rank), {})


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
    axes, sizes = _dynamic_check(
        "dynamic_slice", _check_tensor(t, "dynamic_slice"), index, axes, sizes
    )

    def run(x, idx):
        for i, (ax, size) in enumerate(zip(axes, sizes, strict=True)):
            x = x.index_select(ax, _window(x, idx, i, ax, size))
        return x

    return call_op(run, (t, index), {})


def _update(x, idx, u, axes, sizes):
    # Write the window one axis at a time: select the rows of the outer axes, write the
    # innermost window, then write those rows back.
    ax, size = axes[0], sizes[0]
    pos = _window(x, idx, len(idx.reshape(-1)) - len(axes), ax, size)
    if len(axes) == 1:
        return x.index_copy(ax, pos, u)
    inner = _update(x.index_select(ax, pos), idx, u, axes[1:], sizes[1:])
    return x.index_copy(ax, pos, inner)


def _check_update_shape(op: str, t: Tensor, t_update, axes, sizes) -> None:
    """The update fills the slice exactly: ``t``'s shape with each axis in ``axes`` cut to its
    size (upstream's dynamic update copies it in whole; a misfit fails later on an IPU)."""
    t_update = _check_tensor(t_update, op)
    want = list(t.shape)
    for axis, size in zip(axes, sizes, strict=True):
        want[axis] = size
    if tuple(t_update.shape) != tuple(want):
        raise ValueError(
            f"{op}: t_update {t_update.id!r} has shape {t_update.shape}, but the slice of "
            f"{t.id!r} (shape {t.shape}) along axes {list(axes)} with sizes {list(sizes)} has "
            f"shape {tuple(want)}; give t_update that shape (reshape it, or add the axes "
            "of size 1)."
        )


def dynamic_update(t: Tensor, index: Tensor, t_update: Tensor, axes: Sequence[int],
                   sizes: Sequence[int], no_overlap: bool = False) -> Tensor:  # fmt: skip
    """A copy of ``t`` with ``t_update`` written at the run-time ``index`` along ``axes``."""
    axes, sizes = _dynamic_check(
        "dynamic_update", _check_tensor(t, "dynamic_update"), index, axes, sizes
    )
    _check_update_shape("dynamic_update", t, t_update, axes, sizes)

    def run(x, idx, u):
        return _update(x, idx, u.to(x.dtype), axes, sizes)

    return call_op(run, (t, index, t_update), {})


def dynamic_update_(t: Tensor, index: Tensor, t_update: Tensor, axes: Sequence[int],
                    sizes: Sequence[int], no_overlap: bool = False) -> Tensor:  # fmt: skip
    """``dynamic_update`` writing into ``t`` in place; returns ``t``."""
    axes, sizes = _dynamic_check(
        "dynamic_update_", _check_tensor(t, "dynamic_update_"), index, axes, sizes
    )
    _check_update_shape("dynamic_update_", t, t_update, axes, sizes)

    def run(x, idx, u):
        return x.copy_(_update(x, idx, u.to(x.dtype), axes, sizes))

    return call_op(run, (t, index, t_update), {})


def scatter(t: Tensor, indices: Tensor, values: Tensor, axis: int = 0,
            available_memory_proportion=None) -> Tensor:  # fmt: skip
    """ONNX ScatterElements: a copy of ``t`` with ``out[.., indices[i], ..] = values[i]``."""
    t = _check_tensor(t, "scatter")
    if tuple(indices.shape) != tuple(values.shape):
        raise ValueError(
            f"scatter: indices shape {indices.shape} and values shape {values.shape} must match."
        )

    def run(x, idx, v):
        return x.scatter(axis, idx.to(torch.int64), v.to(x.dtype))

    return call_op(run, (t, indices, values), {})
