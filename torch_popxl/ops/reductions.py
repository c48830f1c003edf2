"""Reductions: every ``popxl.ops`` reduction over axes (upstream's ``sum``, ``mean``,
``prod``, ``median``, ``sumsquare``, ``l1``, ``l2``, ``logsum``, ``logsumexp`` and this
package's ``reduce_*`` names) is one row of ``_REDUCTIONS`` run by one function, ``_reduce``;
also the arg-reductions (``argmax``, ``argmin``, ``topk``), ``cumsum`` and ``histogram``.

Note [one reduction]
~~~~~~~~~~~~~~~~~~~~
``_reduce(t, axis, keepdims, op, row)`` is the only place that knows
* which axes: ``None`` means all of them, an int one axis, an iterable several; each must lie
  in ``[-max(rank, 1), max(rank, 1))`` (torch's rule: a 0-d tensor has the axis 0, or -1)
  and appear once (ValueError naming the op otherwise);
* what reducing over no axes means (a 0-d input, or ``axis=[]``): only the row's elementwise
  maps run (``sumsquare`` of a 0-d tensor is its square); a plain reduction is a copy;
* the dtype rule: PopXL's reductions keep an integer input's dtype where torch would promote
  sums and products to int64, and uint16/32/64 (which torch's CPU kernels lack) run in int64
  and are cast back by ``int_safe`` (ops/_intsafe.py).
A row says only what differs: the elementwise map before the reduction (``abs``, a square),
the torch reduction over a non-empty axis list, the map after it (``sqrt``, ``log``), and
whether the reduction takes the dtype rule's ``dtype=`` (sums and products).
``reduce_sum`` and ``sum`` (and each other pair) are the same row under two names.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import dtypes as _dtypes
from ..ir.tensor import Tensor
from ._common import _check_tensor, call_op
from ._intsafe import NARROW_UNSIGNED, int_safe
from .shape import cast

__all__ = [
    "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod",
    "reduce_sum_square", "reduce_median", "sum", "mean", "sumsquare", "prod", "median", "l1",
    "l2", "logsum", "logsumexp", "argmax", "argmin", "topk", "cumsum", "histogram"
]  # fmt: skip

_Axis = int | Iterable[int] | None


# ---- the reduction table ------------------------------------------------------------------


@dataclass(frozen=True)
class _Reduction:
    """One reduction (Note [one reduction])."""

    # (x, axes: a non-empty list, keepdim, **dtype) -> x reduced over axes
    reduce: Callable[..., torch.Tensor]
    before: Callable[[torch.Tensor], torch.Tensor] | None = None
    after: Callable[[torch.Tensor], torch.Tensor] | None = None
    keeps_int: bool = False  # takes the dtype rule's ``dtype=`` (torch promotes ints)


def _sum(x, axes, keepdim, **dtype):
    return torch.sum(x, axes, keepdim=keepdim, **dtype)


def _prod(x, axes, keepdim, **dtype):
    # torch.prod takes one axis: reduce the highest first so the others keep their index
    # (a 0-d tensor has the one axis 0, as in torch).
    for ax in sorted((a % builtins.max(x.dim(), 1) for a in axes), reverse=True):
        x = torch.prod(x, ax, keepdim=keepdim, **dtype)
    return x


def _median(x, axes, keepdim):
    # The lower median (torch's and PopART's convention for even counts) over several axes:
    # move the reduced axes last, flatten them, take the median, restore kept dims.
    if x.dim() == 0:
        return x.clone()  # the median of one value (a 0-d tensor's axis 0)
    axes = sorted(a % x.dim() for a in axes)
    rest = [d for d in range(x.dim()) if d not in axes]
    y = x.permute(*rest, *axes).reshape(*[x.shape[d] for d in rest], -1)
    out = y.median(-1).values
    if keepdim:
        out = out.reshape([1 if d in axes else x.shape[d] for d in range(x.dim())])
    return out


def _square(x):
    return x * x


_REDUCTIONS: dict[str, _Reduction] = {
    "sum": _Reduction(_sum, keeps_int=True),
    "mean": _Reduction(lambda x, axes, keepdim: torch.mean(x, axes, keepdim=keepdim)),
    "max": _Reduction(lambda x, axes, keepdim: torch.amax(x, axes, keepdim=keepdim)),
    "min": _Reduction(lambda x, axes, keepdim: torch.amin(x, axes, keepdim=keepdim)),
    "prod": _Reduction(_prod, keeps_int=True),
    "median": _Reduction(_median),
    "sumsquare": _Reduction(_sum, before=_square, keeps_int=True),
    "l1": _Reduction(_sum, before=torch.abs, keeps_int=True),
    "l2": _Reduction(_sum, before=_square, after=torch.sqrt, keeps_int=True),
    "logsum": _Reduction(_sum, after=torch.log, keeps_int=True),
    "logsumexp": _Reduction(lambda x, axes, keepdim: torch.logsumexp(x, axes, keepdim=keepdim)),
}


# ---- the one implementation ---------------------------------------------------------------


def _axes(t: Tensor, axis: _Axis, op: str) -> list[int]:
    axes = list(range(t.rank)) if axis is None else [axis] if isinstance(axis, int) else list(axis)
    # torch's rule: a 0-d tensor has the one axis 0 (also spelled -1).
    n = builtins.max(t.rank, 1)
    for ax in axes:
        if not -n <= ax < n:
            raise ValueError(f"{op}: axis {ax} is out of range for {t.id!r} of rank {t.rank}.")
    if len({ax % n for ax in axes}) != len(axes):
        raise ValueError(
            f"{op}: axis {axes} names an axis of {t.id!r} (rank {t.rank}) twice; list each "
            "axis once."
        )
    return axes


def _int_dtype(t: Tensor) -> dict:
    # PopXL reductions keep the input dtype; torch promotes integer sums to int64.
    # uint16/32/64 sum in int64 and are cast back by int_safe (ops/_intsafe.py).
    if not t.dtype.is_int:
        return {}
    dt = t.dtype.as_torch()
    return {"dtype": torch.int64 if dt in NARROW_UNSIGNED else dt}


def _reduce(t: Tensor, axis: _Axis, keepdims: bool, op: str, row: _Reduction) -> Tensor:
    t = _check_tensor(t, op)
    axes = _axes(t, axis, op)
    if not axes and row.before is None and row.after is None:
        return call_op(torch.clone, (t,), {})
    dtype = _int_dtype(t) if row.keeps_int else {}

    def run(x):
        if row.before is not None:
            x = row.before(x)
        if axes:
            x = row.reduce(x, axes, keepdims, **dtype)
        if row.after is not None:
            x = row.after(x)
        return x

    return call_op(int_safe(run), (t,), {})


# ---- upstream's names ---------------------------------------------------------------------


def sum(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``axis`` (all axes when None), in ``t``'s dtype."""
    return _reduce(t, axis, keepdims, "sum", _REDUCTIONS["sum"])


def mean(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    """Arithmetic mean over ``axis`` (all axes when None)."""
    return _reduce(t, axis, keepdims, "mean", _REDUCTIONS["mean"])


def prod(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    """Product over ``axis`` in ``t``'s dtype."""
    return _reduce(t, axis, keepdims, "prod", _REDUCTIONS["prod"])


def median(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    """The lower median over ``axis`` (torch's and PopART's convention for even counts)."""
    return _reduce(t, axis, keepdims, "median", _REDUCTIONS["median"])


def sumsquare(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    """Sum of squares over ``axis``."""
    return _reduce(t, axis, keepdims, "sumsquare", _REDUCTIONS["sumsquare"])


def l1(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    """Sum of absolute values over ``axis``."""
    return _reduce(t, axis, keepdims, "l1", _REDUCTIONS["l1"])


def l2(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    """Euclidean norm over ``axis``."""
    return _reduce(t, axis, keepdims, "l2", _REDUCTIONS["l2"])


def logsum(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    """``log(sum(t))`` over ``axis``."""
    return _reduce(t, axis, keepdims, "logsum", _REDUCTIONS["logsum"])


def logsumexp(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    """``log(sum(exp(t)))`` over ``axis``, computed stably."""
    return _reduce(t, axis, keepdims, "logsumexp", _REDUCTIONS["logsumexp"])


# ---- this package's reduce_* names (the same rows) ----------------------------------------


def reduce_sum(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    return _reduce(t, axis, keepdims, "reduce_sum", _REDUCTIONS["sum"])


def reduce_mean(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    return _reduce(t, axis, keepdims, "reduce_mean", _REDUCTIONS["mean"])


def reduce_max(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    return _reduce(t, axis, keepdims, "reduce_max", _REDUCTIONS["max"])


def reduce_min(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    return _reduce(t, axis, keepdims, "reduce_min", _REDUCTIONS["min"])


def reduce_prod(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    return _reduce(t, axis, keepdims, "reduce_prod", _REDUCTIONS["prod"])


def reduce_sum_square(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    return _reduce(t, axis, keepdims, "reduce_sum_square", _REDUCTIONS["sumsquare"])


def reduce_median(t: Tensor, axis: _Axis = None, keepdims: bool = False) -> Tensor:
    return _reduce(t, axis, keepdims, "reduce_median", _REDUCTIONS["median"])


# ---- arg-reductions, scans, histograms ----------------------------------------------------


def argmax(t: Tensor, dim: int = 0, keepdim: bool = False) -> Tensor:
    return cast(call_op(torch.argmax, (t,), {"dim": dim, "keepdim": keepdim}), _dtypes.int32)


def argmin(t: Tensor, dim: int = 0, keepdim: bool = False) -> Tensor:
    return cast(call_op(torch.argmin, (t,), {"dim": dim, "keepdim": keepdim}), _dtypes.int32)


def topk(t: Tensor, k: int, axis: int, largest: bool = True, sorted: bool = True):
    values, idx = call_op(torch.topk, (t, k), {"dim": axis, "largest": largest, "sorted": sorted})
    return values, cast(idx, _dtypes.int32)


def cumsum(t: Tensor, dim: int = 0) -> Tensor:
    """Cumulative sum along ``dim``, keeping ``t``'s dtype."""
    t = _check_tensor(t, "cumsum")
    if not -t.rank <= dim < max(t.rank, 1):
        raise ValueError(f"cumsum: dim {dim} is out of range for {t.id!r} of rank {t.rank}.")
    return call_op(int_safe(torch.cumsum), (t, dim), {"dtype": t.dtype.as_torch()})


def histogram(t: Tensor, levels: Sequence[float], absolute_of_input: bool) -> Tensor:
    """Counts of ``t``'s elements in the bins ``(-inf, l0), [l0, l1), ..., [l_last, inf)``.

    Returns a uint32 tensor of ``len(levels) + 1`` counts.
    """
    t = _check_tensor(t, "histogram")
    edges = sorted(float(v) for v in levels)

    def run(x):
        x = x.abs() if absolute_of_input else x
        bounds = torch.tensor(edges, dtype=x.dtype, device=x.device)
        bins = torch.bucketize(x.reshape(-1), bounds, right=True)
        counts = F.one_hot(bins, len(edges) + 1).sum(0)
        return counts.to(torch.uint32)

    return call_op(run, (t,), {})
