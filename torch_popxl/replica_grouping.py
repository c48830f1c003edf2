"""``popxl.replica_grouping``, upstream's module path for ReplicaGrouping; defined in ``ir/replica_grouping.py``."""

from .ir.replica_grouping import ReplicaGrouping

__all__ = ["ReplicaGrouping"]
