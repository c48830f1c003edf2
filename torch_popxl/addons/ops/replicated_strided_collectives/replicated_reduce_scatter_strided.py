"""Reduce-scatter over any constant-stride replica grouping."""

from __future__ import annotations

from ....ir.replica_grouping import ReplicaGrouping
from ....ir.tensor import Tensor
from ....opdefs.reduce_scatter import replicated_reduce_scatter

__all__ = ["replicated_reduce_scatter_strided"]


def replicated_reduce_scatter_strided(t: Tensor, op: str = "add", group: ReplicaGrouping | None = None,
                                      configure_output_for_replicated_tensor_sharding: bool = False) -> Tensor:  # fmt: skip
    """Reduce ``t`` over ``group`` and keep this member's flat chunk (zero-padded)."""
    return replicated_reduce_scatter(t, op, group, configure_output_for_replicated_tensor_sharding)
