"""``popxl.ops.collectives``: replica collectives (spec §5).

Each op records one per-replica ``torch_popxl`` custom op; the executor runs all replicas at
once under ``vmap`` and the op's vmap rule calls the C++ kernel on the stacked replica layout.
The wrappers live in their op stanzas (``torch_popxl/opdefs/``); this module re-exports them.
"""

from __future__ import annotations

import enum

import torch

from ..ir.tensor import Tensor
from ..opdefs._api import CollectiveOperator
from ..opdefs.all_gather import replicated_all_gather
from ..opdefs.all_reduce import replicated_all_reduce, replicated_all_reduce_
from ..opdefs.reduce_scatter import replica_sharded_slice, replicated_reduce_scatter
from ..opdefs.take_own import replicated_slice
from ._common import call_op

__all__ = [
    "replicated_all_reduce",
    "replicated_all_reduce_",
    "replicated_all_gather",
    "replicated_reduce_scatter",
    "replica_sharded_slice",
    "replicated_slice",
    "CollectiveOperator",
    "CommGroup",
    "CommGroupType",
    "all_reduce",
    "all_reduce_identical_inputs",
    "all_reduce_identical_grad_inputs",
]


class CommGroupType(enum.Enum):
    """How replicas are split into communication groups (upstream's ``CommGroupType``)."""

    All = 0  #: one group of all replicas
    Consecutive = 1  #: groups of ``replicaGroupSize`` consecutive replicas
    Orthogonal = 2  #: groups of replicas ``replicaGroupSize`` apart
    Ungrouped = 3  #: every replica on its own


class CommGroup:
    """A communication group: its ``type`` and ``replicaGroupSize`` (upstream's names)."""

    def __init__(self, type: CommGroupType = CommGroupType.All, replicaGroupSize: int = 0):  # noqa: A002, N803
        if not isinstance(type, CommGroupType):
            raise TypeError(f"CommGroup: type must be a CommGroupType; got {type!r}.")
        if replicaGroupSize < 0:
            raise ValueError(f"CommGroup: replicaGroupSize must be >= 0; got {replicaGroupSize}.")
        self.type = type
        self.replicaGroupSize = int(replicaGroupSize)  # noqa: N815 -- upstream's name

    def __eq__(self, other) -> bool:
        return isinstance(other, CommGroup) and (self.type, self.replicaGroupSize) == (
            other.type,
            other.replicaGroupSize,
        )

    def __hash__(self) -> int:
        return hash((self.type, self.replicaGroupSize))

    def __repr__(self) -> str:
        return f"CommGroup(type={self.type}, replicaGroupSize={self.replicaGroupSize})"


_ALL_REDUCE_OPS = {"add": torch.add, "mul": torch.mul, "min": torch.minimum, "max": torch.maximum}


def _all_reduce_checked(ts, ipus, op: str, name: str) -> list[Tensor]:
    ts = list(ts)
    if not ts or not all(isinstance(t, Tensor) for t in ts):
        raise TypeError(f"{name}: ts must be a non-empty list of popxl Tensors; got {ts!r}.")
    if ipus is not None and len(ipus) != len(ts):
        raise ValueError(f"{name}: {len(ts)} tensors but {len(ipus)} ipus; give one ipu each.")
    if op not in _ALL_REDUCE_OPS:
        raise ValueError(f"{name}: op must be one of {sorted(_ALL_REDUCE_OPS)}; got {op!r}.")
    shapes = {tuple(t.shape) for t in ts}
    if len(shapes) != 1:
        raise ValueError(f"{name}: all tensors need the same shape; got {sorted(shapes)}.")
    return ts


def _copies(ts, ipus, value_of) -> list[Tensor]:
    outs = []
    for i, t in enumerate(ts):
        out = call_op(torch.clone, (value_of(i),), {})
        out._ipu = ipus[i] if ipus is not None else t._ipu
        outs.append(out)
    return outs


def all_reduce(ts: list[Tensor], ipus: list[int] | None = None, op: str = "add") -> list[Tensor]:
    """Reduce ``ts`` (one tensor per IPU of one replica) and give every IPU the result.

    The simulator models one device, so the result is the reduction of the tensors, copied
    once per input. Differentiable: each input's gradient is the sum of the outputs' gradients.
    """
    ts = _all_reduce_checked(ts, ipus, op, "all_reduce")
    fn = _ALL_REDUCE_OPS[op]
    total = ts[0]
    for t in ts[1:]:
        total = call_op(fn, (total, t), {})
    return _copies(ts, ipus, lambda _i: total)


def all_reduce_identical_inputs(ts: list[Tensor], ipus: list[int] | None = None,
                                op: str = "add") -> list[Tensor]:  # fmt: skip
    """An all-reduce whose inputs are known to be identical: the forward is a copy of each
    input (upstream's gradient is an all-reduce; autodiff here differentiates the copy)."""
    ts = _all_reduce_checked(ts, ipus, op, "all_reduce_identical_inputs")
    return _copies(ts, ipus, lambda i: ts[i])


def all_reduce_identical_grad_inputs(ts: list[Tensor], ipus: list[int] | None = None,
                                     op: str = "add") -> list[Tensor]:  # fmt: skip
    """An all-reduce whose incoming gradients are identical: the forward is ``all_reduce``."""
    _all_reduce_checked(ts, ipus, op, "all_reduce_identical_grad_inputs")
    return all_reduce(ts, ipus, op)
