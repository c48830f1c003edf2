"""``popxl.ops.collectives``: replica collectives (spec §5).

Each op records one per-replica ``torch_popxl`` custom op; the executor runs all replicas at
once under ``vmap`` and the op's vmap rule calls the C++ kernel on the stacked replica layout.
"""

from __future__ import annotations

import math

import torch

from ..capture import call_torch
from ..ir.context import gcg
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor
from ..opdefs import kernels  # noqa: F401  (registers the custom ops)

__all__ = [
    "replicated_all_reduce",
    "replicated_all_reduce_",
    "replicated_all_gather",
    "replicated_reduce_scatter",
    "replica_sharded_slice",
    "replicated_slice",
    "CollectiveOperator",
]

# PopXL maps the op strings onto its CollectiveOperator enum; 'mul' maps to MEAN (a quirk
# of the source, kept so programs behave as on hardware).
_OPS = {"add": "add", "mean": "mean", "mul": "mean", "min": "min", "max": "max",
        "and": "and", "or": "or", "square_add": "square_add"}  # fmt: skip
_DTYPES = ("float32", "float16", "int32", "uint32")


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


def _ops():
    return torch.ops.torch_popxl


def _check(t, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} expects a popxl Tensor; got {type(t).__name__}.")
    graph = gcg()
    if t._graph is not graph:
        raise ValueError(f"{name}: tensor {t.id!r} is not in the current graph {graph.id!r}.")
    if t.dtype.name not in _DTYPES:
        raise TypeError(
            f"{name}: tensor {t.id!r} has dtype {t.dtype.name}; PopXL collectives support "
            f"{', '.join(_DTYPES)}. Cast it first (ops.cast)."
        )
    return t


def _group(t: Tensor, group: ReplicaGrouping | None) -> tuple[int, int]:
    rg = t.ir._check_grouping(group)
    if not rg.is_const:
        raise NotImplementedError(
            f"Collectives need a constant-stride replica grouping; {rg!r} is not. Use "
            "ir.replica_grouping(stride, group_size)."
        )
    return rg.group_size, rg.stride


def _op(op: str) -> str:
    if op not in _OPS:
        raise ValueError(f"Not a valid op {op!r} for a collective; expected one of {sorted(_OPS)}.")
    return _OPS[op]


def replicated_all_reduce(
    t: Tensor, op: str = "add", group: ReplicaGrouping | None = None
) -> Tensor:
    """Reduce ``t`` over the replicas of each group; every member gets the result."""
    _check(t, "replicated_all_reduce")
    g, s = _group(t, group)
    out = call_torch(_ops().replicated_all_reduce, (t, _op(op), g, s), {})
    out._meta_shape = t.meta_shape
    return out


def replicated_all_reduce_(
    t: Tensor, op: str = "add", group: ReplicaGrouping | None = None
) -> Tensor:
    """In-place ``replicated_all_reduce``; returns ``t`` (modified)."""
    out = replicated_all_reduce(t, op, group)
    return call_torch(torch.Tensor.copy_, (t, out), {})


def replicated_all_gather(t: Tensor, axis: int = 0, group: ReplicaGrouping | None = None,
                          output_shape: str = "auto") -> Tensor:  # fmt: skip
    """Gather ``t`` from every member of the group (modes: concat, new_axis, meta_shape, auto)."""
    _check(t, "replicated_all_gather")
    if not isinstance(axis, int):
        raise ValueError(f"replicated_all_gather: axis must be an int; got {axis!r}.")
    if output_shape not in ("new_axis", "concat", "meta_shape", "auto"):
        raise ValueError(
            f"replicated_all_gather: output_shape must be 'new_axis', 'concat', 'meta_shape' or "
            f"'auto'; got {output_shape!r}."
        )
    if output_shape == "auto":
        output_shape = "meta_shape" if t.meta_shape else "concat"
    g, s = _group(t, group)
    axis = axis % t.rank if t.rank else 0
    y = call_torch(_ops().replicated_all_gather, (t, g, s), {})  # [G, *t.shape]
    if output_shape == "new_axis":
        if axis == 0:
            return y
        # PopXL's quirk for axis > 0: flatten each member with `axis` moved first, concat,
        # reshape to (G, *t.shape) and move the new axis to `axis` (spec §5.5).
        y = call_torch(torch.movedim, (y, axis + 1, 1), {})
        y = call_torch(torch.reshape, (y, (g, *t.shape)), {})
        return call_torch(torch.movedim, (y, 0, axis), {})
    if output_shape == "concat":
        y = call_torch(torch.movedim, (y, 0, axis), {})
        shape = list(t.shape)
        shape[axis] *= g
        return call_torch(torch.reshape, (y, tuple(shape)), {})
    flat = call_torch(torch.reshape, (y, (-1,)), {})
    if not t.meta_shape:
        return flat
    n = math.prod(t.meta_shape)
    return call_torch(torch.reshape, (flat[:n], tuple(t.meta_shape)), {})


def replicated_reduce_scatter(t: Tensor, op: str = "add", group: ReplicaGrouping | None = None,
                              configure_output_for_replicated_tensor_sharding: bool = False) -> Tensor:  # fmt: skip
    """Flatten, zero-pad, reduce over the group; member i keeps chunk i (1-D)."""
    _check(t, "replicated_reduce_scatter")
    g, s = _group(t, group)
    out = call_torch(_ops().replicated_reduce_scatter, (t, _op(op), g, s), {})
    if configure_output_for_replicated_tensor_sharding:
        out._meta_shape = tuple(t.shape)
    return out


def replica_sharded_slice(t: Tensor, group: ReplicaGrouping | None = None) -> Tensor:
    """Each replica keeps its own chunk of ``t`` (no reduction); an RTS shard of ``t``."""
    _check(t, "replica_sharded_slice")
    g, s = _group(t, group)
    out = call_torch(_ops().replicated_reduce_scatter, (t, "local", g, s), {})
    out._meta_shape = tuple(t.shape)
    # Programs pair shards with their variables by sorted name (spec addons §16).
    out.graph._rename_tensor(out, f"{t.name}_sharded_slice")
    return out


def replicated_slice(t: Tensor, axis: int = 0, group: ReplicaGrouping | None = None) -> Tensor:
    """Replica with index i in its group takes block i of ``t`` along ``axis``."""
    _check(t, "replicated_slice")
    g, s = _group(t, group)
    axis = axis % t.rank
    if t.shape[axis] % g:
        raise ValueError(
            f"replicated_slice: axis {axis} of {t.id!r} has size {t.shape[axis]}, not divisible by "
            f"the group size {g}."
        )
    block = t.shape[axis] // g
    x = call_torch(torch.movedim, (t, axis, 0), {})
    x = call_torch(torch.reshape, (x, (g, block, *x.shape[1:])), {})
    x = call_torch(_ops().replicated_take_own, (x, g, s), {})
    if block == 1:
        # PopXL drops the sliced axis when each block has size 1 (spec §5.4); the other
        # axes are still in their original order after moving `axis` to the front.
        return call_torch(torch.squeeze, (x, 0), {})
    return call_torch(torch.movedim, (x, 0, axis), {})
