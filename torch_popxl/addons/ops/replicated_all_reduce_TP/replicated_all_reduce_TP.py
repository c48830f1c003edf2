"""Differentiable all-reduces of tensor-parallel layers (``opdefs/all_reduce_tp.py``).

In a tensor-parallel block the input is replicated over the TP group and each member computes a
slice: ``replicated_all_reduce_identical_inputs`` marks the entry (identity forward, all-reduce
of the partial input gradients), ``replicated_all_reduce_identical_grad_inputs`` the exit
(all-reduce of the partial outputs, identical gradients passed through).
"""

from __future__ import annotations

from ....ir.replica_grouping import ReplicaGrouping
from ....ir.tensor import Tensor
from ....opdefs.all_reduce_tp import replicated_all_reduce_TP

__all__ = [
    "replicated_all_reduce_identical_inputs",
    "replicated_all_reduce_identical_grad_inputs",
    "replicated_all_reduce",
]


def replicated_all_reduce_identical_inputs(t: Tensor, op: str = "add",
                                           group: ReplicaGrouping | None = None) -> Tensor:  # fmt: skip
    """Identity on inputs that are identical across ``group``; its gradient is an all-reduce."""
    return replicated_all_reduce_TP(t, op, group, mode="identical_inputs")


def replicated_all_reduce_identical_grad_inputs(t: Tensor, op: str = "add",
                                                group: ReplicaGrouping | None = None) -> Tensor:  # fmt: skip
    """All-reduce over ``group`` whose (identical) gradients pass through unchanged."""
    return replicated_all_reduce_TP(t, op, group, mode="identical_grad_inputs")


def replicated_all_reduce(
    t: Tensor, op: str = "add", group: ReplicaGrouping | None = None
) -> Tensor:
    """All-reduce over ``group`` (all replicas by default) whose gradient is an all-reduce."""
    return replicated_all_reduce_TP(t, op, group, mode="plain")
