"""``NamedReplicaGrouping`` (a DotTree of ``popxl.ReplicaGrouping`` leaves) and helpers that
restrict a grouping to one instance (process) or one IPU-Link domain."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from ..ir.context import gir
from ..ir.replica_grouping import ReplicaGrouping
from .dot_tree import DotTree

__all__ = [
    "NamedReplicaGrouping",
    "fill_none_group",
    "get_instance_replica_grouping",
    "is_cross_instance",
    "get_ild_size_from_popdist",
    "get_ild_replica_grouping",
    "is_cross_ild",
]

# IPU-Link domains have at most 64 IPUs; without a popdist environment naming the size, the
# domain is assumed to hold min(replicas, 64), as upstream.
_MAX_ILD = 64


def fill_none_group(rg: ReplicaGrouping | None, none_value: ReplicaGrouping) -> ReplicaGrouping:
    """``rg``, or ``none_value`` when ``rg`` is None."""
    return none_value if rg is None else rg


class NamedReplicaGrouping(DotTree[ReplicaGrouping]):
    """Replica groupings addressed by dotted keys (one per variable)."""

    @classmethod
    def build_groups(
        cls, names: Iterable[str], value: ReplicaGrouping | None = None
    ) -> NamedReplicaGrouping:
        """The same grouping (all replicas of the current Ir when None) for every name."""
        value = value if value is not None else gir().replica_grouping()
        names = list(names)
        return cls.pack(names, [value] * len(names))


def _restrict(rg: ReplicaGrouping | None, size: int, what: str) -> ReplicaGrouping:
    ir = gir()
    rg = rg if rg is not None else ir.replica_grouping()
    if rg.stride > size:
        raise ValueError(
            f"replica grouping stride {rg.stride} must be at most the {what} size {size}; "
            "use a grouping whose stride fits inside one " + what
        )
    if rg.group_size * rg.stride > size:
        return ir.replica_grouping(stride=rg.stride, group_size=size // rg.stride)
    return rg


def is_cross_instance(replica_grouping: ReplicaGrouping) -> bool:
    """Whether a group of ``replica_grouping`` spans more than one instance."""
    return replica_grouping.group_size * replica_grouping.stride > gir().instance_replication_factor


def get_instance_replica_grouping(
    replica_grouping: ReplicaGrouping | None = None,
) -> ReplicaGrouping:
    """The grouping with the same stride restricted to the replicas of one instance (all
    replicas of the instance when None)."""
    return _restrict(replica_grouping, gir().instance_replication_factor, "instance")


def get_ild_size_from_popdist() -> int:
    """The IPU-Link domain size: ``ipuLinkDomainSize`` of ``POPLAR_TARGET_OPTIONS`` (JSON) if
    set, else ``min(replication_factor, 64)``."""
    try:
        opts = json.loads(os.environ.get("POPLAR_TARGET_OPTIONS", "{}"))
    except json.JSONDecodeError as error:
        raise ValueError(f"POPLAR_TARGET_OPTIONS is not valid JSON: {error}") from None
    size = opts.get("ipuLinkDomainSize")
    return int(size) if size is not None else min(gir().replication_factor, _MAX_ILD)


def is_cross_ild(replica_grouping: ReplicaGrouping) -> bool:
    """Whether a group of ``replica_grouping`` spans more than one IPU-Link domain."""
    return replica_grouping.group_size * replica_grouping.stride > get_ild_size_from_popdist()


def get_ild_replica_grouping(replica_grouping: ReplicaGrouping | None = None) -> ReplicaGrouping:
    """The grouping with the same stride restricted to one IPU-Link domain."""
    return _restrict(replica_grouping, get_ild_size_from_popdist(), "IPU-Link domain")
