"""Argument checks shared by the public collective wrappers of the op stanzas."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..ir.context import gcg
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor
from .reduce_ops import COLLECTIVE_DTYPES, kernel_name

__all__ = ["CollectiveOperator", "check_tensor", "float64_collectives", "grouping_of", "reduce_op"]

_DTYPES = COLLECTIVE_DTYPES
# All-gather and slices only move bytes, so upstream also allows float8 there (RTS float8
# variables are gathered and sliced, never reduced).
_MOVE_DTYPES = (*_DTYPES, "float8_143", "float8_152")
_float64_builders = 0  # the float64_collectives() contexts open


# Note [float64 collectives]
#     PopXL's collectives take the dtypes IPUs reduce (``COLLECTIVE_DTYPES``), and a PopXL
#     program given a float64 tensor gets PopXL's error. ``popxl.compile`` trains any torch
#     model, a float64 one included (Note [float64 models] in compile_common.py), and reduces
#     its float64 gradients and loss counts with the same kernels, which take every dtype
#     torch does: it builds its program inside ``float64_collectives()``.
@contextlib.contextmanager
def float64_collectives() -> Iterator[None]:
    """Inside, the collective wrappers also take float64 tensors (Note [float64
    collectives])."""
    global _float64_builders
    _float64_builders += 1
    try:
        yield
    finally:
        _float64_builders -= 1


class CollectiveOperator:
    """The reduction names accepted by the collectives."""

    Add = "add"
    Mean = "mean"
    Mul = "mul"
    Min = "min"
    Max = "max"
    LogicalAnd = "and"
    LogicalOr = "or"
    SquareAdd = "square_add"
    Local = "local"


def check_tensor(t, name: str, data_movement: bool = False) -> Tensor:
    """``t`` if it is a handle of the current graph with a dtype PopXL collectives support
    (``data_movement``: the op copies values without arithmetic, so float8 is allowed too)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} expects a popxl Tensor; got {type(t).__name__}.")
    graph = gcg()
    if t._graph is not graph:
        raise ValueError(f"{name}: tensor {t.id!r} is not in the current graph {graph.id!r}.")
    allowed = _MOVE_DTYPES if data_movement else _DTYPES
    if _float64_builders:  # Note [float64 collectives]
        allowed = (*allowed, "float64")
    if t.dtype.name not in allowed:
        raise TypeError(
            f"{name}: tensor {t.id!r} has dtype {t.dtype.name}; PopXL {name} supports "
            f"{', '.join(allowed)}. Cast it first (ops.cast)."
        )
    return t


def grouping_of(t: Tensor, group: ReplicaGrouping | None) -> tuple[int, int]:
    """``(group_size, stride)`` of ``group`` (all replicas when None)."""
    rg = t.ir._check_grouping(group)
    if not rg.is_const:
        raise NotImplementedError(
            f"Collectives need a constant-stride replica grouping; {rg!r} is not. Use "
            "ir.replica_grouping(stride, group_size)."
        )
    return rg.group_size, rg.stride


def reduce_op(op: str) -> str:
    """The kernel's name for a PopXL collective operator string (Note [one reduction table])."""
    return kernel_name(op)
