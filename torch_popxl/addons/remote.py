"""Remote buffers for named variables, and graphs that load / store them (spec addons §10).

Load and store graphs visit buffers in sorted key order and take the int32 entry index as
their first input: ``(ts,) = load.call(i)`` / ``store.bind(ts).call(i)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .. import dtypes as _dtypes
from .. import ops
from ..errors import given
from ..ir.context import gcg
from ..ir.remote_buffer import RemoteBuffer, remote_buffer
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor, TensorSpec, graph_input, graph_output
from ..remote import replica_sharded_buffer
from . import rts  # noqa: F401  (``addons.rts`` is reachable as an attribute, as upstream)
from .dot_tree import DotTree
from .graph import GraphWithNamedArgs
from .named_tensors import NamedTensors
from .rts import _tiles, replica_sharded_spec
from .variable_factory import NamedVariableFactories, VariableFactory

__all__ = [
    "NamedRemoteBuffers",
    "create_remote_buffer",
    "named_buffers",
    "named_variable_buffers",
    "load_remote_graph",
    "store_remote_graph",
    "load_remote",
    "store_remote",
]


class NamedRemoteBuffers(DotTree[RemoteBuffer]):
    """Remote buffers addressed by dotted keys."""


def create_remote_buffer(spec: TensorSpec | Tensor, entries: int = 1, replica_group: ReplicaGrouping | None = None,
                         shard_over: int | None = None) -> RemoteBuffer:  # fmt: skip
    """A buffer for tensors of ``spec``.

    * ``spec`` already sharded (``meta_shape``): a plain buffer of the shard shape, tagged
      with the meta_shape;
    * ``shard_over > 1`` (default: the group size): a replica-sharded buffer (``ValueError``
      unless the elements divide);
    * otherwise a plain buffer of ``spec.shape``.
    """
    rg = replica_group if replica_group is not None else gcg().ir.replica_grouping()
    shape, dtype, meta = tuple(spec.shape), spec.dtype, tuple(spec.meta_shape or ())
    if meta:
        buf = remote_buffer(shape, dtype, entries)
        buf.meta_shape = meta
        return buf
    shard_over = rg.group_size if shard_over is None else shard_over
    if shard_over > 1:
        n = math.prod(shape)
        if n % shard_over:
            raise ValueError(
                f"Cannot shard a tensor of shape {shape} ({n} elements) over {shard_over} replicas: "
                "the elements must divide evenly. Use shard_over=1 (or False) for this tensor."
            )
        host_shape = (rg.num_groups, *shape) if rg.num_groups > 1 else shape
        return replica_sharded_buffer(host_shape, dtype, rg, shard_over, entries)
    return remote_buffer(shape, dtype, entries)


def _factory_spec(f: VariableFactory) -> TensorSpec:
    return TensorSpec(f.shape, f.dtype, f.meta_shape or ())


def _resolve_shard_over(key: str, f: VariableFactory, shard_over_dict: Any) -> int:
    group_size = f.replica_grouping.group_size
    if isinstance(shard_over_dict, Mapping):
        value = shard_over_dict.get(key)
        return group_size if value is None else int(value)
    if isinstance(shard_over_dict, bool):
        return group_size if shard_over_dict else 1
    if isinstance(shard_over_dict, int):
        if not 1 <= shard_over_dict <= group_size:
            raise ValueError(
                f"shard_over_dict={shard_over_dict} for {key!r} must be in [1, {group_size}] (the "
                "replica group size of its factory)."
            )
        return shard_over_dict
    raise ValueError(
        f"shard_over_dict must be a bool, an int or a mapping key -> int; got {given(shard_over_dict)}."
    )


def named_variable_buffers(factories: NamedVariableFactories, entries: int = 1,
                           shard_over_dict: bool | int | Mapping[str, int] | None = None, *,
                           sharded_threshold: int | None = None,
                           shard_groups: Mapping | None = None) -> NamedRemoteBuffers:  # fmt: skip
    """One remote buffer (``entries`` slots) per factory, keyed like ``factories``.

    Shard-group API: ``shard_over_dict`` (default ``True``: shard every unsharded factory over
    its group). Threshold API (2.6/3.0): ``sharded_threshold=`` shards a factory over its group
    iff it has at least that many elements and divides evenly (``shard_over_dict`` /
    ``shard_groups`` may then give the shard count per key).
    """
    buffers = {}
    for key, f in factories.to_dict().items():
        spec = _factory_spec(f)
        if sharded_threshold is not None:
            given = shard_over_dict if isinstance(shard_over_dict, Mapping) else shard_groups
            shard_over = _threshold_shard_over(key, f, sharded_threshold, given)
        else:
            shard_over = _resolve_shard_over(
                key, f, True if shard_over_dict is None else shard_over_dict
            )
        buffers[key] = create_remote_buffer(spec, entries, f.replica_grouping, shard_over)
    return NamedRemoteBuffers.from_dict(buffers)


def _threshold_shard_over(
    key: str, f: VariableFactory, threshold: int, given: Mapping | None
) -> int:
    if f.meta_shape:
        return 1
    count = f.replica_grouping.group_size
    if given is not None and key in given:
        value = given[key]
        count = value.group_size if isinstance(value, ReplicaGrouping) else int(value)
    n = math.prod(f.shape)
    return count if count > 1 and n >= max(threshold, count) and n % count == 0 else 1


def named_buffers(tensors: NamedTensors, entries: int = 1, sharded_threshold: int | None = None,
                  shard_over: ReplicaGrouping | None = None) -> NamedRemoteBuffers:  # fmt: skip
    """One remote buffer per tensor, for tensors of its spec (or of its shard spec).

    With ``sharded_threshold`` (2.6/3.0) or ``shard_over`` the buffer holds the shard given by
    ``rts.replica_sharded_spec``; otherwise the tensor's own spec (shards stay shards).
    """
    buffers = {}
    for key, t in tensors.to_dict().items():
        if sharded_threshold is not None:
            spec = replica_sharded_spec(t, threshold=sharded_threshold)
        elif shard_over is not None:
            spec = replica_sharded_spec(t, shard_over)
        else:
            spec = t.spec
        buffers[key] = create_remote_buffer(spec, entries, shard_over=1)
    return NamedRemoteBuffers.from_dict(buffers)


# ---- load / store ---------------------------------------------------------------------------


def load_remote_graph(buffers: NamedRemoteBuffers, entries: int = 1,
                      use_io_tiles: bool = False) -> tuple[GraphWithNamedArgs, list[str]]:  # fmt: skip
    """A graph "load_remote": ``(index) -> one loaded tensor per buffer``, in sorted key order.

    Grows every buffer to at least ``entries`` slots. Returns the graph (no named args) and
    the output keys.
    """
    graph = gcg().ir.create_empty_graph("load_remote")
    names, bufs = buffers.unpack()
    with graph, _tiles(use_io_tiles):
        index = graph_input((), _dtypes.int32, "load_index")
        for name, buf in zip(names, bufs, strict=True):
            buf.entries = max(buf.entries, entries)
            t = ops.init(buf.tensor_shape, buf.tensor_dtype, name, meta_shape=buf.meta_shape)
            graph_output(ops.remote_load_(buf, index, t))
    return GraphWithNamedArgs(graph), list(names)


def store_remote_graph(buffers: NamedRemoteBuffers, entries: int = 1,
                       use_io_tiles: bool = False) -> GraphWithNamedArgs:  # fmt: skip
    """A graph "store_remote": ``(index, *tensors) -> ()`` storing each bound tensor.

    Its ``args`` are the tensor inputs keyed like ``buffers``: ``g.bind(tensors).call(i)``.
    """
    graph = gcg().ir.create_empty_graph("store_remote")
    names, bufs = buffers.unpack()
    args = {}
    with graph, _tiles(use_io_tiles):
        index = graph_input((), _dtypes.int32, "store_index")
        for name, buf in zip(names, bufs, strict=True):
            buf.entries = max(buf.entries, entries)
            t = graph_input(buf.tensor_shape, buf.tensor_dtype, name, meta_shape=buf.meta_shape)
            ops.remote_store(buf, index, t)
            args[name] = t
    return GraphWithNamedArgs(graph, NamedTensors.from_dict(args))


def load_remote(buffers: NamedRemoteBuffers, entry: int | Tensor = 0) -> NamedTensors:
    """Load every buffer's ``entry`` in the current graph."""
    return NamedTensors.from_dict(
        {k: ops.remote_load(b, entry, k) for k, b in buffers.to_dict().items()}
    )


def store_remote(
    buffers: NamedRemoteBuffers, tensors: NamedTensors, entry: int | Tensor = 0
) -> None:
    """Store every tensor whose key has a buffer at ``entry``."""
    bufs = buffers.to_dict()
    for k, t in tensors.to_dict().items():
        if k in bufs:
            ops.remote_store(bufs[k], entry, t)
