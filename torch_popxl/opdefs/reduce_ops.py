"""The reduction operators of the collectives, one row each: the one table ``all_reduce``,
``reduce_scatter``, the fused ``mm_all_reduce`` and the torch.distributed path read.

Note [one reduction table]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A row says everything about one ``CollectiveOperator`` string: the kernel's name for it (PopXL
maps ``'mul'`` onto MEAN, a quirk of the source kept so programs behave as on hardware),
whether it needs a numeric dtype, its per-replica reference (``reference``, the
specification the C++ kernels are tested against, popxl.md §5), and how partial results cross
instances: the form a partial takes (narrow floats widen to float32, integer means sum exactly
in int64, ``square_add`` squares first, ``and``/``or`` become min/max of 0/1 bytes), the
reduction that combines partials (``combine``: sum, min or max, with its neutral element for
an instance holding no member of a group) and the final division of a mean.

The C++ kernels mirror the rows once, in ``enum class ReduceOp``, ``parse_reduce_op`` and
``check_reduce_dtype`` of csrc/collective_common.h (same names, same numeric-dtype rule and
wording); the fused ``mm_all_reduce_stacked`` (csrc/fused.cpp) parses its op through the same
``parse_reduce_op`` and finishes the folded sum with ``finish_from_sum`` ('add' and 'mean', the
reductions that distribute over a sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ARITHMETIC_OPS",
    "COLLECTIVE_DTYPES",
    "NARROW_FLOATS",
    "REDUCE_OPS",
    "VALID_OPS",
    "ReduceOp",
    "combine_rows",
    "finish",
    "kernel_name",
    "neutral",
    "partial_form",
    "reduce_op",
    "reference_reduce",
]

# Reduced in float32 across instances: partial sums in these dtypes would round twice.
NARROW_FLOATS = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
# The popxl dtypes PopXL's reducing collectives accept (all_gather and slices, which only
# move bytes, also take float8: ``_api.py``).
COLLECTIVE_DTYPES = ("float32", "float16", "int32", "uint32")


def _sum(values: list[Tensor], square: bool) -> Tensor:
    # Floating-point sums are accumulated in float64 and rounded to x's dtype once, so the
    # reference is the ideal result. Integer sums stay in x's dtype and wrap on overflow, as
    # integer hardware does.
    dtype = values[0].dtype
    wide = torch.float64 if dtype.is_floating_point else dtype
    total = None
    for v in values:
        w = v.to(wide)
        w = w * w if square else w
        total = w if total is None else total + w
    assert total is not None
    return total.to(dtype)


def _mean(values: list[Tensor]) -> Tensor:
    dtype, count = values[0].dtype, len(values)
    if dtype.is_floating_point:
        total = values[0].to(torch.float64)
        for v in values[1:]:
            total = total + v.to(torch.float64)
        return (total / count).to(dtype)
    # Integer mean: exact int64 sum, then division truncating toward zero.
    total = values[0].to(torch.int64)
    for v in values[1:]:
        total = total + v.to(torch.int64)
    return torch.div(total, count, rounding_mode="trunc").to(dtype)


def _fold(fn: Callable[[Tensor, Tensor], Tensor], values: list[Tensor]) -> Tensor:
    result = values[0].clone()
    for v in values[1:]:
        result = fn(result, v)
    return result


def _logical(fn: Callable[[Tensor, Tensor], Tensor], values: list[Tensor]) -> Tensor:
    result = values[0] != 0
    for v in values[1:]:
        result = fn(result, v != 0)
    return result.to(values[0].dtype)


@dataclass(frozen=True)
class ReduceOp:
    """One reduction operator (Note [one reduction table])."""

    name: str  # the CollectiveOperator string a program passes
    kernel: str  # the name the kernels take ('mul' -> 'mean')
    numeric: bool  # needs a numeric dtype (bool is refused)
    reference: Callable[[list[Tensor]], Tensor]  # the members' values -> the result
    combine: str  # how partials combine across instances: 'sum', 'min' or 'max'
    logical: bool = False  # partials are 0/1 bytes (and/or)
    square: bool = False  # partials are squared first (square_add)
    mean: bool = False  # the combined sum is divided by the member count


REDUCE_OPS: dict[str, ReduceOp] = {
    r.name: r
    for r in (
        ReduceOp("add", "add", True, lambda vs: _sum(vs, False), "sum"),
        ReduceOp("mean", "mean", True, _mean, "sum", mean=True),
        ReduceOp("mul", "mean", True, _mean, "sum", mean=True),  # PopXL: 'mul' is MEAN
        ReduceOp("min", "min", False, lambda vs: _fold(torch.minimum, vs), "min"),
        ReduceOp("max", "max", False, lambda vs: _fold(torch.maximum, vs), "max"),
        ReduceOp(
            "and", "and", False, lambda vs: _logical(torch.logical_and, vs), "min", logical=True
        ),  # fmt: skip
        ReduceOp(
            "or", "or", False, lambda vs: _logical(torch.logical_or, vs), "max", logical=True
        ),  # fmt: skip
        ReduceOp(
            "square_add", "square_add", True, lambda vs: _sum(vs, True), "sum", square=True
        ),  # fmt: skip
    )
}
VALID_OPS = tuple(REDUCE_OPS)
ARITHMETIC_OPS = tuple(r.name for r in REDUCE_OPS.values() if r.numeric)


def kernel_name(op: str) -> str:
    """The kernel's name for a PopXL collective operator string."""
    if op not in REDUCE_OPS:
        raise ValueError(
            f"Not a valid op {op!r} for a collective; expected one of {sorted(REDUCE_OPS)}."
        )
    return REDUCE_OPS[op].kernel


def reduce_op(name: str, op: str, dtype: torch.dtype, allow_local: bool = False) -> ReduceOp | None:
    """The row of ``op``, after checking it for ``dtype`` (``'local'``, reduce-scatter's slice
    without reduction, has no row: None)."""
    valid = VALID_OPS + (("local",) if allow_local else ())
    if op not in valid:
        raise ValueError(f"{name}: unknown op {op!r}; valid ops are {', '.join(valid)}.")
    row = REDUCE_OPS.get(op)
    if row is not None and row.numeric and dtype == torch.bool:
        raise TypeError(
            f"{name}: op {op!r} needs a numeric dtype, got bool. Use 'or', 'and', 'min' or "
            "'max' for boolean masks, or convert the tensor to an integer dtype first."
        )
    return row


def reference_reduce(values: list[Tensor], op: str) -> Tensor:
    """Elementwise reduction of the members' values, in their dtype."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown op {op!r}; valid ops are {VALID_OPS}")
    row = REDUCE_OPS[op]
    if values[0].dtype == torch.bool and row.numeric:
        raise TypeError(f"op {op!r} needs a numeric dtype, got bool")
    return row.reference(values)


def partial_form(x: Tensor, op: str) -> tuple[Tensor, str]:
    """``x`` (stacked over this instance's replicas) in the form its partial reduction
    crosses instances in, and the reduction ('sum', 'min' or 'max') that combines partials."""
    row = REDUCE_OPS[op]
    dtype = x.dtype
    if row.logical:
        return (x != 0).to(torch.uint8), row.combine
    if row.combine != "sum":
        return (x.to(torch.uint8) if dtype == torch.bool else x), row.combine
    if dtype in NARROW_FLOATS:
        wide = torch.float32
    elif row.mean and not (dtype.is_floating_point or dtype.is_complex):
        wide = torch.int64  # exact sum, then truncating division, as the kernel does
    else:
        wide = dtype
    v = x.to(wide)
    return (v * v if row.square else v), "sum"


def combine_rows(v: Tensor, reduction: str, dim: int) -> Tensor:
    """Partials ``v`` combined over ``dim`` by ``reduction`` ('sum', 'min' or 'max')."""
    if reduction == "sum":
        return v.sum(dim, dtype=v.dtype)
    return v.amin(dim) if reduction == "min" else v.amax(dim)


def finish(total: Tensor, op: str, count: int, dtype: torch.dtype) -> Tensor:
    """The combined partials of ``count`` members as the result of ``op`` in ``dtype``: a mean
    divides (truncating toward zero for integers, as the kernel does)."""
    if REDUCE_OPS[op].mean:
        floating = total.dtype.is_floating_point
        total = total / count if floating else torch.div(total, count, rounding_mode="trunc")
    return total.to(dtype)


def neutral(dtype: torch.dtype, reduction: str):
    """The neutral element of ``reduction``: what an instance sends for a group it holds no
    member of."""
    if reduction == "sum":
        return 0
    if dtype.is_floating_point:
        return math.inf if reduction == "min" else -math.inf
    info = torch.iinfo(dtype)
    return info.max if reduction == "min" else info.min
