"""Remote variables and replicated tensor sharding (RTS), spec §4.4-§4.8.

A remote variable is a ``Variable`` whose value lives in a remote buffer slot, not on chip:
``v.info.remote == (buffer, offset)``. An RTS variable is a remote variable whose per-group value
is split into ``shard_over`` 1-D shards: ``v.info.shard`` is its ``RtsLayout``. The handle's
``shape`` is always the full per-group shape; only the host transfers below (called by the
``Session``) know the layout.

Note [RTS layout]
~~~~~~~~~~~~~~~~~
For a per-group value of ``n`` elements sharded over ``k`` replicas, the flattened value is
zero-padded at the end to ``k * ceil(n / k)`` elements and cut into ``k`` contiguous chunks.
Within each group of the *constant* grouping (``replica_grouping.const_rg``), the member with
index-in-group ``i`` holds chunk ``i % k``; so when ``k < group_size`` each block of ``k``
consecutive members holds a full copy. This is the natural layout the collectives use
(``replicated_reduce_scatter`` / ``replica_sharded_slice`` / ``replicated_all_gather``), so
every observable round trip is exact. Host reads gather the chunks from the first ``k``
members of the first constant group of each user group and drop the padding.
"""

from __future__ import annotations

import math

import numpy as np

from . import dtypes as _dtypes
from .ir.context import gcg
from .ir.remote_buffer import RemoteBuffer
from .ir.replica_grouping import ReplicaGrouping
from .ir.tensor import (
    HostTensor,
    RtsLayout,
    Tensor,
    Variable,
    VariableInfo,
    _check_retrieval_mode,
    _fake_like,
    _host_array,
    _per_replica_shape,
)
from .ops.remote import remote_load, remote_store

__all__ = [
    "RtsLayout",
    "remote_variable",
    "remote_replica_sharded_variable",
    "replica_sharded_buffer",
    "replica_sharded_variable",
]


# ---- construction -------------------------------------------------------------------------


def _main_graph_only(what: str):
    graph = gcg()
    if graph is not graph.ir.main_graph:
        raise ValueError(
            f"popxl.{what} must be created in the main graph; the current graph is "
            f"{graph.id!r}. Create it under `with ir.main_graph:` and pass it to subgraphs."
        )
    return graph


def _check_buffer(remote_buffer, what: str, ir) -> RemoteBuffer:
    if not isinstance(remote_buffer, RemoteBuffer):
        raise TypeError(
            f"popxl.{what} expects a RemoteBuffer (from popxl.remote_buffer); got "
            f"{type(remote_buffer).__name__}."
        )
    if remote_buffer._ir is not ir:
        raise ValueError(
            f"popxl.{what}: {remote_buffer!r} belongs to {remote_buffer._ir!r}, not the current "
            f"{ir!r}. Create the buffer in the same Ir as the variable."
        )
    return remote_buffer


def _check_offset(offset, what: str) -> int:
    if isinstance(offset, float | np.floating) and math.isnan(offset):
        raise ValueError(f"popxl.{what}: offset is NaN; expected a non-negative int.")
    if isinstance(offset, bool) or not isinstance(offset, int | np.integer) or offset < 0:
        raise ValueError(f"popxl.{what}: offset must be a non-negative int; got {offset!r}.")
    return int(offset)


def _require_replication(ir, what: str) -> None:
    if ir.replication_factor <= 1:
        raise ValueError(
            f"popxl.{what} needs replication: {ir!r} has replication_factor "
            f"{ir.replication_factor}. Create the Ir with popxl.Ir(replication=R), R > 1, or use "
            "popxl.remote_variable for an unsharded remote variable."
        )


def _host_data(data, dtype, downcast, log2_scale, nan_on_overflow):
    dt = _dtypes.dtype.as_dtype(dtype) if dtype is not None else None
    arr = _host_array(data, dt, downcast, log2_scale, nan_on_overflow)
    return arr, dt or _dtypes.dtype.as_dtype(arr.dtype)


def _make_remote(graph, arr: np.ndarray, dt, rb: RemoteBuffer, offset: int, name, rg,
                 retrieval_mode, shard: RtsLayout | None) -> Variable:  # fmt: skip
    shape = _per_replica_shape(arr.shape, rg, name)
    v = Variable._create(
        graph,
        name or "remote_variable",
        _fake_like(shape, dt),
        _info=VariableInfo(
            replica_grouping=rg, retrieval_mode=retrieval_mode, remote=(rb, offset), shard=shard
        ),
    )
    graph.ir._add_variable(v, arr)
    return v


def remote_variable(
    data: HostTensor,
    remote_buffer: RemoteBuffer,
    offset: int = 0,
    dtype=None,
    name: str | None = None,
    downcast: bool = True,
    replica_grouping: ReplicaGrouping | None = None,
    retrieval_mode: str | None = "one_per_group",
    log2_scale: int | None = None,
    nan_on_overflow: bool | None = None,
) -> Variable:
    """A variable stored in slot ``offset`` of ``remote_buffer`` on every replica (§4.4).

    The returned handle is host-only: load the value on device with
    ``ops.remote_load(remote_buffer, offset)``. ``weights_from_host`` writes the group's
    value into the slot of every replica; host reads take the first member of each group
    (``one_per_group``) or every replica (``all_replicas``).
    """
    graph = _main_graph_only("remote_variable")
    rb = _check_buffer(remote_buffer, "remote_variable", graph.ir)
    offset = _check_offset(offset, "remote_variable")
    rg = graph.ir._check_grouping(replica_grouping)
    _check_retrieval_mode(retrieval_mode)
    arr, dt = _host_data(data, dtype, downcast, log2_scale, nan_on_overflow)
    return _make_remote(graph, arr, dt, rb, offset, name, rg, retrieval_mode, None)


def replica_sharded_buffer(
    shape,
    dtype,
    replica_grouping: ReplicaGrouping | None = None,
    shard_over: int | ReplicaGrouping | None = None,
    entries: int = 1,
    *,
    shard_grouping: ReplicaGrouping | None = None,
) -> RemoteBuffer:
    """A remote buffer for RTS variables of host shape ``shape`` sharded over ``shard_over``.

    ``shape`` includes the group dimension when the grouping has more than one group. The
    buffer's slot is 1-D, ``(ceil(n / shard_over),)``, and its ``meta_shape`` is the full
    per-group shape. ``shard_grouping`` (the SDK 3.3 form; also accepted in ``shard_over``'s
    place) names the shard groups as a grouping: its ``group_size`` is the shard count and its
    stride must be the variable grouping's (1 by default).
    """
    ir = gcg().ir
    user_rg = ir._check_grouping(replica_grouping)
    # Sharding happens inside the groups of the constant refinement (Note [RTS layout]).
    shard_over = _shard_count(ir, replica_grouping, shard_over, shard_grouping)
    shard_over = _check_shard_over(shard_over, user_rg.const_rg)
    shape = tuple(int(s) for s in shape)
    if user_rg.num_groups > 1:
        if not shape or shape[0] != user_rg.num_groups:
            raise ValueError(
                f"replica_sharded_buffer: shape {shape} has no group dimension; the grouping "
                f"{user_rg!r} has {user_rg.num_groups} groups, so pass ({user_rg.num_groups}, *shape)."
            )
        shape = shape[1:]
    n = math.prod(shape)
    rb = RemoteBuffer((-(-n // shard_over),), dtype, entries)
    rb.meta_shape = shape
    rb._rts_shard_over = shard_over
    return rb


def _shard_count(ir, replica_grouping, shard_over, shard_grouping) -> int | None:
    """``shard_over`` as an int (or None) from either spelling: an int ``shard_over`` (SDK 3.1)
    or a ``shard_grouping`` (SDK 3.3), whose group_size is the count and whose stride must be
    the variable grouping's, so each shard group is consecutive members of one replica group."""
    if isinstance(shard_over, ReplicaGrouping):
        if shard_grouping is not None:
            raise ValueError(
                "Pass the shard grouping once: as shard_grouping= or in shard_over's place, "
                "not both."
            )
        shard_over, shard_grouping = None, shard_over
    if shard_grouping is None:
        return shard_over
    if shard_over is not None:
        raise ValueError(
            f"Got both shard_over={shard_over!r} and shard_grouping={shard_grouping!r}; they "
            "say the same thing (shard_over is shard_grouping.group_size). Pass only one."
        )
    shard_grouping = ir._check_grouping(shard_grouping)
    base = ir._check_grouping(replica_grouping).const_rg
    if not shard_grouping.is_const or shard_grouping.stride != base.stride:
        reason = (
            "the replica_grouping's stride"
            if replica_grouping is not None
            else "as no replica_grouping was given (one group of all replicas)"
        )
        raise ValueError(
            f"shard_grouping {shard_grouping!r} must have stride {base.stride}, {reason}: "
            "replicated tensor sharding shards over consecutive members of a replica group. Use "
            f"ir.replica_grouping(stride={base.stride}, group_size=k) with k dividing the "
            f"replica group size {base.group_size}."
        )
    return shard_grouping.group_size


def _check_shard_over(shard_over, rg) -> int:
    group_size = rg.group_size
    if shard_over is None:
        return group_size
    if (
        isinstance(shard_over, bool)
        or not isinstance(shard_over, int | np.integer)
        or shard_over < 1
    ):
        raise ValueError(f"shard_over must be a positive int or None; got {shard_over!r}.")
    if shard_over > group_size:
        raise ValueError(
            f"shard_over={shard_over} is larger than the replica group size {group_size} of "
            f"{rg!r}. A tensor can only be sharded over replicas of one group: pick "
            f"shard_over <= {group_size}."
        )
    if group_size % shard_over != 0:
        raise ValueError(
            f"shard_over={shard_over} does not divide the replica group size {group_size} of "
            f"{rg!r}. Pick a divisor of {group_size} so every block of shard_over replicas "
            "holds a full copy."
        )
    return int(shard_over)


def _infer_shard_over(rb: RemoteBuffer, n: int, rg, name) -> int:
    """The shard count of a user-made buffer: the divisor k of the group size whose shard size
    ``ceil(n / k)`` is the buffer's slot size (the largest such k when several fit)."""
    slot = math.prod(rb.tensor_shape)
    group_size = rg.const_rg.group_size
    fits = [k for k in range(1, group_size + 1) if group_size % k == 0 and -(-n // k) == slot]
    if not fits:
        sizes = sorted({-(-n // k) for k in range(1, group_size + 1) if group_size % k == 0})
        raise ValueError(
            f"remote_replica_sharded_variable {name or 'variable'!r}: {rb!r} has slots of {slot} "
            f"elements, but a {n}-element tensor sharded over a divisor of the group size "
            f"{group_size} needs one of {sizes} elements per shard. Create the buffer with "
            f"tensor_shape=(ceil({n} / shard_over),), or use popxl.replica_sharded_buffer."
        )
    return max(fits)


def remote_replica_sharded_variable(
    data: HostTensor,
    remote_buffer: RemoteBuffer,
    offset: int = 0,
    dtype=None,
    name: str | None = None,
    downcast: bool = True,
    replica_grouping: ReplicaGrouping | None = None,
    retrieval_mode: str | None = "one_per_group",
    log2_scale: int | None = None,
    nan_on_overflow: bool | None = None,
    *,
    shard_grouping: ReplicaGrouping | None = None,
) -> Variable:
    """A variable sharded across the replicas of each group and stored remotely (§4.7).

    Returns the full handle (``shape`` is the unsharded per-group shape). On device,
    ``ops.remote_load(remote_buffer, offset)`` gives this replica's 1-D shard, with
    ``meta_shape`` equal to the full shape. Sets ``remote_buffer.meta_shape`` if unset.
    The shard count is the buffer's; ``shard_grouping``, if given, must agree with it.
    """
    graph = _main_graph_only("remote_replica_sharded_variable")
    ir = graph.ir
    _require_replication(ir, "remote_replica_sharded_variable")
    rb = _check_buffer(remote_buffer, "remote_replica_sharded_variable", ir)
    offset = _check_offset(offset, "remote_replica_sharded_variable")
    rg = ir._check_grouping(replica_grouping)
    _check_retrieval_mode(retrieval_mode)
    wanted = _shard_count(ir, replica_grouping, None, shard_grouping)
    if wanted is not None:
        _check_shard_over(wanted, rg.const_rg)
    arr, dt = _host_data(data, dtype, downcast, log2_scale, nan_on_overflow)
    shape = _per_replica_shape(arr.shape, rg, name)
    n = math.prod(shape)
    shard_over = rb._rts_shard_over or _infer_shard_over(rb, n, rg, name)
    if wanted is not None and wanted != shard_over:
        if rb._rts_shard_over is None and -(-n // wanted) == math.prod(rb.tensor_shape):
            shard_over = wanted  # a user-made buffer whose slot size fits several counts
        else:
            raise ValueError(
                f"shard_grouping {shard_grouping!r} shards over {wanted} replicas, but "
                f"{rb!r} holds shards of a {n}-element tensor split over {shard_over}. Create "
                "the buffer with popxl.replica_sharded_buffer(..., shard_grouping=...) using "
                "the same grouping."
            )
    if not rb.meta_shape:
        rb.meta_shape = shape
    elif tuple(rb.meta_shape) != shape:
        raise ValueError(
            f"Cannot use RemoteBuffer[id={rb.remote_buffer_id}] for replica sharded variable of "
            f"shape {shape}: the buffer's meta_shape is {tuple(rb.meta_shape)}. Every RTS variable "
            "in one buffer must have the same full shape; create another buffer."
        )
    return _make_remote(
        graph, arr, dt, rb, offset, name, rg, retrieval_mode, RtsLayout(shard_over, n)
    )


def replica_sharded_variable(
    data: HostTensor,
    dtype=None,
    name: str | None = None,
    downcast: bool = True,
    replica_grouping: ReplicaGrouping | None = None,
    shard_over: int | ReplicaGrouping | None = None,
    retrieval_mode: str | None = "one_per_group",
    log2_scale: int | None = None,
    nan_on_overflow: bool | None = None,
    *,
    shard_grouping: ReplicaGrouping | None = None,
) -> tuple[Variable, Tensor]:
    """An RTS variable whose shard stays on device for the whole session (§4.8).

    Returns ``(full_handle, shard)``. The shard is loaded from its one-entry buffer in the
    WeightsFromHost program and stored back in the WeightsToHost program, so it can be
    updated in place during ``run`` with no explicit load or store. ``shard_over`` or
    ``shard_grouping`` set the shard groups as for ``replica_sharded_buffer``.
    """
    graph = _main_graph_only("replica_sharded_variable")
    # Checked before the buffer is made, so a failing call leaves the Ir unchanged.
    _require_replication(graph.ir, "replica_sharded_variable")
    _check_retrieval_mode(retrieval_mode)
    arr, dt = _host_data(data, dtype, downcast, log2_scale, nan_on_overflow)
    rb = replica_sharded_buffer(
        arr.shape, dt, replica_grouping, shard_over, entries=1, shard_grouping=shard_grouping
    )
    var = remote_replica_sharded_variable(arr, rb, 0, dt, name, False, replica_grouping,
                                          retrieval_mode)  # fmt: skip

    previous = graph._op_context
    try:
        graph._op_context = "weights_from_host"
        shard = remote_load(rb, 0, var.name + "_rts")
        graph._op_context = "weights_to_host"
        remote_store(rb, 0, shard)
    finally:
        graph._op_context = previous
    return var, shard
