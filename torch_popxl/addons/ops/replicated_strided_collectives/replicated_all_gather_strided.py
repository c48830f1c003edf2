"""All-gather over any constant-stride replica grouping."""

from __future__ import annotations

from ....ir.replica_grouping import ReplicaGrouping
from ....ir.tensor import Tensor
from ....opdefs.all_gather import replicated_all_gather

__all__ = ["replicated_all_gather_strided"]


def replicated_all_gather_strided(t: Tensor, group: ReplicaGrouping | None = None) -> Tensor:
    """The members' flattened values of ``t`` concatenated in group order: a 1-D tensor, or
    ``meta_shape`` when ``t`` is a replica-sharded tensor (padding dropped). Gradient: each
    member's own slice."""
    return replicated_all_gather(t, 0, group, output_shape="meta_shape")
