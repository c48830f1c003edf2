"""How a variable's host value maps onto replicas, and back (popxl.md §2.1, §4.5).

A variable with ``num_groups > 1`` has a host value with a leading group axis
(``[num_groups, *shape]``); with one group it is the bare ``shape``. Replica r holds group
``assignment[r]``'s value; reading back keeps each group's first member. ``Session`` (on-chip
variables) and ``remote_io`` (remote and RTS variables) both ask here, so the layout rule is
written once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from ..ir.tensor import Variable

__all__ = ["by_group", "first_members", "from_groups", "replica_values"]

# torch tensors and numpy arrays alike: only indexing is used
_Array = TypeVar("_Array")


def by_group(v: Variable, value: _Array) -> _Array:
    """``v``'s host value as ``[num_groups, *shape]`` (a view: one group gains the axis)."""
    return value if v.replica_grouping.num_groups > 1 else value[None]  # type: ignore[index]


def from_groups(v: Variable, per_group: _Array) -> _Array:
    """The inverse of ``by_group``: ``[num_groups, *shape]`` -> ``v``'s host value (an array
    even when 0-d: ``[0, ...]``, not ``[0]``, which would give a numpy scalar)."""
    return per_group if v.replica_grouping.num_groups > 1 else per_group[0, ...]  # type: ignore[index]


def replica_values(v: Variable, value: torch.Tensor, groups: list[int]) -> torch.Tensor:
    """``[len(groups), *shape]``: the row each replica of group ``groups[i]`` holds. One group's
    value is expanded, not copied (a large weight is not materialised R times)."""
    if v.replica_grouping.num_groups == 1:
        return value.unsqueeze(0).expand(len(groups), *value.shape)
    return value[torch.tensor(groups, device=value.device)]


def first_members(v: Variable) -> list[int]:
    """The first (lowest) replica of each group of ``v``'s grouping, by group."""
    assignment = v.replica_grouping.assignment
    return [assignment.index(g) for g in range(v.replica_grouping.num_groups)]
