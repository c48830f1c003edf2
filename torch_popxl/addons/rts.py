"""Replicated tensor sharding helpers (spec addons §11).

Two API generations are accepted:

* shard groups (popxl-addons 3.1+, primary): ``replica_sharded_spec(t, shard_over)``,
  ``reduce_replica_sharded_graph(tensors, op, shard_groups=..., replica_group=...)``;
* thresholds (2.6/3.0): ``replica_sharded_spec(t, threshold=...)``,
  ``reduce_replica_sharded_graph(tensors, op, threshold=...)``. They map onto the first: a
  tensor is sharded over all replicas iff it is not sharded yet, has at least ``threshold``
  elements, divides evenly, and there is more than one replica to shard over.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import given
from ..ir.context import gcg, io_tiles
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor, TensorSpec, graph_input, graph_output
from ..ops import collectives
from .graph import GraphWithNamedArgs
from .named_replica_grouping import NamedReplicaGrouping
from .named_tensors import NamedTensors

__all__ = [
    "replica_sharded_spec",
    "reduce_replica_sharded_tensor",
    "reduce_replica_sharded_graph",
    "gather_replica_sharded_tensor",
    "all_gather_replica_sharded_graph",
    "replica_sharded_slice_graph",
    "shard_group_for_threshold",
]

_LEGACY_THRESHOLD = 1024


def _nelms(t: Any) -> int:
    return int(math.prod(t.shape))


def _all_replicas() -> ReplicaGrouping:
    return gcg().ir.replica_grouping()


def _same_grouping(a: ReplicaGrouping, b: ReplicaGrouping) -> bool:
    return list(a.assignment) == list(b.assignment)


def shard_group_for_threshold(
    t: Any, threshold: int, replica_grouping: ReplicaGrouping | None = None
) -> ReplicaGrouping:
    """The shard group the threshold API picks for ``t``: the grouping if ``t`` qualifies, else size 1."""
    rg = replica_grouping if replica_grouping is not None else _all_replicas()
    n = _nelms(t)
    if not t.meta_shape and rg.group_size > 1 and n >= threshold and n % rg.group_size == 0:
        return rg
    return gcg().ir.replica_grouping(group_size=1)


# ---- specs ----------------------------------------------------------------------------------


def replica_sharded_spec(t: Tensor | TensorSpec, shard_over: ReplicaGrouping | int | None = None, *,
                         threshold: int | None = None,
                         replica_grouping: ReplicaGrouping | None = None) -> TensorSpec:  # fmt: skip
    """The spec of ``t``'s shard: flat ``(nelms // group_size,)`` with ``meta_shape = t.shape``.

    Unchanged (``t.spec``) if ``t`` is already sharded, the group has one replica, or the
    elements do not divide. With ``threshold=`` (2.6/3.0 API) ``t`` must also have at least
    ``threshold`` elements; a positional int is read as that threshold.
    """
    spec = TensorSpec(t.shape, t.dtype, t.meta_shape)
    if isinstance(shard_over, int) and not isinstance(shard_over, bool):
        threshold, shard_over = shard_over, None
    if shard_over is None:
        threshold = _LEGACY_THRESHOLD if threshold is None else threshold
        shard_over = shard_group_for_threshold(t, threshold, replica_grouping)
    if not isinstance(shard_over, ReplicaGrouping):
        raise TypeError(
            f"replica_sharded_spec: shard_over must be a ReplicaGrouping; got {given(shard_over)}."
        )
    g, n = shard_over.group_size, _nelms(t)
    if t.meta_shape or g == 1 or n % g:
        return spec
    return TensorSpec((n // g,), t.dtype, tuple(t.shape))


# ---- reductions -----------------------------------------------------------------------------


def reduce_replica_sharded_tensor(t: Tensor, op: str = "add", replica_group: ReplicaGrouping | None = None,
                                  shard_group: ReplicaGrouping | None = None) -> Tensor:  # fmt: skip
    """Reduce ``t`` over ``replica_group`` and shard the result over ``shard_group``.

    * shard group of size > 1 dividing ``t``: a reduce-scatter (configured for RTS) when it
      equals the replica group, else an all-reduce followed by a sharded slice;
    * otherwise an all-reduce (nothing when the replica group has one member).

    ``op="mean"`` divides by the replica group size. ``op="local"`` (PopXL's no-reduction
    operator) keeps each replica's own data: its shard, or ``t`` itself when not sharded.
    """
    rg = replica_group if replica_group is not None else _all_replicas()
    sg = shard_group if shard_group is not None else rg
    n = _nelms(t)
    if op == "local":
        if sg.group_size > 1 and n % sg.group_size == 0:
            return collectives.replica_sharded_slice(t, sg)
        return t
    if sg.group_size > 1 and n % sg.group_size == 0:
        if _same_grouping(rg, sg):
            return collectives.replicated_reduce_scatter(
                t, op, rg, configure_output_for_replicated_tensor_sharding=True
            )
        if rg.group_size > 1:
            t = collectives.replicated_all_reduce(t, op, rg)
        return collectives.replica_sharded_slice(t, sg)
    if rg.group_size > 1:
        return collectives.replicated_all_reduce(t, op, rg)
    return t


def _groups_for(
    names: list[str], shard_groups: NamedReplicaGrouping | dict | None, default: ReplicaGrouping
):
    out = {}
    for name in names:
        if shard_groups is not None and name in shard_groups:
            out[name] = shard_groups[name]
        else:
            out[name] = default
    return out


def reduce_replica_sharded_graph(tensors: NamedTensors, op: str = "add", use_io_tiles: bool | int = False,
                                 shard_groups: NamedReplicaGrouping | None = None,
                                 replica_group: ReplicaGrouping | None = None, *,
                                 threshold: int | None = None) -> tuple[GraphWithNamedArgs, list[str]]:  # fmt: skip
    """A graph "replica_reduce" reducing every tensor (sorted key order) with
    ``reduce_replica_sharded_tensor``; returns it and the output keys.

    Use: ``NamedTensors.pack(names, graph.bind(tensors).call())``. ``threshold=`` selects the
    2.6/3.0 rule for the shard groups (a positional int third argument is read as it too).
    """
    if isinstance(use_io_tiles, int) and not isinstance(use_io_tiles, bool):
        threshold, use_io_tiles = use_io_tiles, False
    graph = gcg().ir.create_empty_graph("replica_reduce")
    names, ts = tensors.unpack()
    names = list(names)
    rg = replica_group if replica_group is not None else _all_replicas()
    if threshold is not None:
        groups = {
            n: shard_group_for_threshold(t, threshold, rg) for n, t in zip(names, ts, strict=True)
        }
    else:
        groups = _groups_for(names, shard_groups, rg)
    args = {}
    with graph, _tiles(use_io_tiles):
        for name, t in zip(names, ts, strict=True):
            x = graph_input(t.shape, t.dtype, t.name, meta_shape=t.meta_shape)
            args[name] = x
            graph_output(reduce_replica_sharded_tensor(x, op, rg, groups[name]))
    return GraphWithNamedArgs(graph, NamedTensors.from_dict(args)), names


# ---- gathers --------------------------------------------------------------------------------


def gather_replica_sharded_tensor(t: Tensor, use_io_tiles: bool = False,
                                  replica_group: ReplicaGrouping | None = None) -> Tensor:  # fmt: skip
    """All-gather a sharded tensor back to its ``meta_shape``; unsharded tensors pass through."""
    if not t.meta_shape:
        return t
    with _tiles(use_io_tiles):
        return collectives.replicated_all_gather(t, group=replica_group)


def all_gather_replica_sharded_graph(tensors: NamedTensors, use_io_tiles: bool = False,
                                     replica_groups: NamedReplicaGrouping | None = None,
                                     ) -> tuple[GraphWithNamedArgs, list[str]]:  # fmt: skip
    """A graph "all_gather" gathering every sharded tensor (sorted key order)."""
    graph = gcg().ir.create_empty_graph("all_gather")
    names, ts = tensors.unpack()
    names = list(names)
    groups = _groups_for(names, replica_groups, _all_replicas())
    args = {}
    with graph, _tiles(use_io_tiles):
        for name, t in zip(names, ts, strict=True):
            x = graph_input(t.shape, t.dtype, t.name, meta_shape=t.meta_shape)
            args[name] = x
            graph_output(gather_replica_sharded_tensor(x, replica_group=groups[name]))
    return GraphWithNamedArgs(graph, NamedTensors.from_dict(args)), names


def replica_sharded_slice_graph(tensors: NamedTensors, threshold: int = _LEGACY_THRESHOLD,
                                use_io_tiles: bool = False,
                                shard_groups: NamedReplicaGrouping | None = None,
                                ) -> tuple[GraphWithNamedArgs, list[str]]:  # fmt: skip
    """(3.0 API) A graph slicing every tensor with at least ``threshold`` elements into its shard."""
    graph = gcg().ir.create_empty_graph("replica_sharded_slice")
    names, ts = tensors.unpack()
    names = list(names)
    args = {}
    with graph, _tiles(use_io_tiles):
        for name, t in zip(names, ts, strict=True):
            x = graph_input(t.shape, t.dtype, t.name, meta_shape=t.meta_shape)
            args[name] = x
            given = (
                shard_groups[name] if shard_groups is not None and name in shard_groups else None
            )
            sg = shard_group_for_threshold(t, threshold, given)
            graph_output(collectives.replica_sharded_slice(x, sg) if sg.group_size > 1 else x)
    return GraphWithNamedArgs(graph, NamedTensors.from_dict(args)), names


class _NoTiles:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _tiles(use_io_tiles: bool):
    return io_tiles() if use_io_tiles else _NoTiles()
