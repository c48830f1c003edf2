"""Phased execution building blocks at popxl-addons' 2.x path ``transforms.phased``.

Phased execution keeps each layer's variables (and optimizer state) in remote buffers and runs
the program as a sequence of phases, each ``load -> compute -> store``: only the variables of
the phase that runs are on chip. The pieces are the remote-buffer helpers of ``addons.remote``
and the RTS graphs of ``addons.rts``; this module gives them the older signatures the
2.x tutorials call, where a tensor is replica-sharded over all replicas when it has at least
``sharded_threshold`` elements (default 1024) that divide evenly:

* ``named_variable_buffers(factories, entries, sharded_threshold)``,
  ``named_buffers(tensors, entries, sharded_threshold)``;
* ``reduce_replica_sharded_graph(tensors, op, threshold, use_io_tiles)``;
* ``all_gather_replica_sharded_graph(tensors, use_io_tiles)``;
* ``load_remote_graph`` / ``store_remote_graph`` (unchanged).

``docs/memory_report.md`` ("Phases") says how the memory report shows what is live in each
phase of such a program.
"""

from __future__ import annotations

from ...ir.tensor import Tensor, TensorSpec
from .. import remote as _remote
from .. import rts as _rts
from ..graph import GraphWithNamedArgs
from ..named_tensors import NamedTensors
from ..remote import NamedRemoteBuffers, load_remote_graph, store_remote_graph
from ..variable_factory import NamedVariableFactories

__all__ = [
    "NamedRemoteBuffers",
    "all_gather_replica_sharded_graph",
    "reduce_replica_sharded_graph",
    "load_remote_graph",
    "store_remote_graph",
    "named_buffers",
    "named_variable_buffers",
    "replica_sharded_spec",
]

_DEFAULT_THRESHOLD = 1024


def _check_threshold(name: str, threshold: int) -> int:
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise TypeError(
            f"{name}: the sharding threshold must be a non-negative int (elements); got "
            f"{threshold!r}."
        )
    return threshold


def replica_sharded_spec(t: Tensor | TensorSpec, threshold: int = _DEFAULT_THRESHOLD) -> TensorSpec:
    """The spec of ``t``'s shard over all replicas when it has at least ``threshold``
    elements that divide evenly and is not sharded yet; otherwise ``t``'s own spec."""
    return _rts.replica_sharded_spec(
        t, threshold=_check_threshold("replica_sharded_spec", threshold)
    )


def named_buffers(tensors: NamedTensors, entries: int = 1,
                  sharded_threshold: int = _DEFAULT_THRESHOLD) -> NamedRemoteBuffers:  # fmt: skip
    """One buffer (``entries`` slots) per tensor; tensors with at least ``sharded_threshold``
    elements get a buffer of their shard (``replica_sharded_spec``)."""
    threshold = _check_threshold("named_buffers", sharded_threshold)
    return _remote.named_buffers(tensors, entries, sharded_threshold=threshold)


def named_variable_buffers(factories: NamedVariableFactories, entries: int = 1,
                           sharded_threshold: int = _DEFAULT_THRESHOLD) -> NamedRemoteBuffers:  # fmt: skip
    """One buffer (``entries`` slots) per factory; factories with at least
    ``sharded_threshold`` elements that divide over the replicas get a replica-sharded buffer
    (already sharded factories keep their shard shape)."""
    threshold = _check_threshold("named_variable_buffers", sharded_threshold)
    return _remote.named_variable_buffers(factories, entries, sharded_threshold=threshold)


def reduce_replica_sharded_graph(tensors: NamedTensors, op: str = "add",
                                 threshold: int = _DEFAULT_THRESHOLD,
                                 use_io_tiles: bool = False) -> tuple[GraphWithNamedArgs, list[str]]:  # fmt: skip
    """A graph reducing each tensor over all replicas: a reduce-scatter into its shard when it
    has at least ``threshold`` elements that divide evenly, else an all-reduce. ``op="local"``
    reduces nothing (each replica keeps its own shard)."""
    threshold = _check_threshold("reduce_replica_sharded_graph", threshold)
    return _rts.reduce_replica_sharded_graph(tensors, op, use_io_tiles, threshold=threshold)


def all_gather_replica_sharded_graph(tensors: NamedTensors,
                                     use_io_tiles: bool = False) -> tuple[GraphWithNamedArgs, list[str]]:  # fmt: skip
    """A graph all-gathering every sharded tensor back to its full shape (others pass through)."""
    return _rts.all_gather_replica_sharded_graph(tensors, use_io_tiles)
