"""``NamedReplicaGrouping``: a DotTree of ``popxl.ReplicaGrouping`` leaves."""

from __future__ import annotations

from collections.abc import Iterable

from ..ir.context import gir
from ..ir.replica_grouping import ReplicaGrouping
from .dot_tree import DotTree

__all__ = ["NamedReplicaGrouping", "get_instance_replica_grouping"]


class NamedReplicaGrouping(DotTree[ReplicaGrouping]):
    """Replica groupings addressed by dotted keys (one per variable)."""

    @classmethod
    def build_groups(cls, names: Iterable[str], value: ReplicaGrouping) -> NamedReplicaGrouping:
        """The same grouping for every name."""
        return cls.from_dict({n: value for n in names})


def get_instance_replica_grouping(
    replica_grouping: ReplicaGrouping | None = None,
) -> ReplicaGrouping:
    """The grouping restricted to this instance (one process holds every replica here)."""
    if replica_grouping is None:
        return gir().replica_grouping()
    return replica_grouping
