"""Remote variables between host and streaming memory (``Session.weights_from_host`` /
``weights_to_host``): every replica's slot of each remote (and RTS) variable."""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import dtypes as _dtypes
from ..ir.remote_buffer import RemoteBuffer
from ..ir.tensor import RtsLayout, Variable, _torch_from_numpy
from .grouped_values import by_group, first_members, from_groups

__all__ = ["download_remote_variables", "upload_remote_variables"]


# ---- host transfers (called by Session.weights_from_host / weights_to_host) -----------------


def _remote_variables(ir) -> list[Variable]:
    return [v for v in ir._all_variables if v.info.remote is not None]


def _slot_of(v: Variable) -> tuple[RemoteBuffer, int]:
    """``(buffer, offset)`` of a remote variable (``_remote_variables`` lists only those)."""
    assert v.info.remote is not None, f"{v.id!r} is not a remote variable"
    return v.info.remote


def _layout_of(v: Variable) -> RtsLayout:
    """The RTS layout of a sharded remote variable."""
    assert v.info.shard is not None, f"{v.id!r} is not a sharded variable"
    return v.info.shard


def _slot_check(v: Variable, rb: RemoteBuffer, offset: int) -> None:
    if offset >= rb.entries:
        raise ValueError(
            f"Remote variable {v.id!r} is at offset {offset} of {rb!r}, which has only "
            f"{rb.entries} entries (valid offsets: 0 to {rb.entries - 1}). Create the buffer with "
            f"entries > {offset}, or use another offset."
        )
    if v.dtype != rb.tensor_dtype:
        raise ValueError(
            f"Remote variable {v.id!r} has dtype {v.dtype.name} but {rb!r} holds "
            f"{rb.tensor_dtype.name}. Create the variable with dtype={rb.tensor_dtype.name}."
        )
    slot = math.prod(rb.tensor_shape)
    want = v.info.shard.shard_elements if v.info.shard is not None else math.prod(v.shape)
    if want != slot:
        what = (
            f"its {v.info.shard.shard_over}-way shard has" if v.info.shard is not None else "it has"
        )
        raise ValueError(
            f"Remote variable {v.id!r} does not fit {rb!r}: {what} {want} elements, a slot holds "
            f"{slot}. Create the buffer with the per-replica shape (without the group dimension)."
        )


def _per_replica_values(session, v: Variable) -> torch.Tensor:
    """``[R, *slot_shape]``: what replica r's slot holds after the upload of ``v``."""
    rb, _ = _slot_of(v)
    groups = v.replica_grouping.assignment
    data = by_group(v, _torch_from_numpy(np.asarray(session._host[v.id]), v.dtype))
    per_group = data.reshape(data.shape[0], -1)  # [num_user_groups, n]
    if v.info.shard is not None:
        rows = _shards_of(per_group, v)
    else:
        rows = per_group[torch.tensor(groups)]
    return rows.reshape(len(groups), *rb.tensor_shape)


def _shards_of(per_group: torch.Tensor, v: Variable) -> torch.Tensor:
    """Replica r's shard (Note [RTS layout]) from the ``[num_user_groups, n]`` values."""
    layout = _layout_of(v)
    k, c = layout.shard_over, layout.shard_elements
    padded = torch.nn.functional.pad(per_group, (0, k * c - layout.num_elements))
    chunks = padded.reshape(per_group.shape[0], k, c)
    rg = v.replica_grouping
    const = rg.const_rg
    R = len(rg.assignment)
    user = [rg.assignment[r] for r in range(R)]
    shard = [const._index_in_group(r) % k for r in range(R)]
    return chunks[torch.tensor(user), torch.tensor(shard)]


def upload_remote_variables(session) -> None:
    """Write every remote variable's host copy into its slot on every replica (§6.4).

    Every slot is checked before any buffer is written, so a bad variable leaves the buffers
    unchanged.
    """
    variables = _remote_variables(session.ir)
    for v in variables:
        _slot_check(v, *_slot_of(v))
    for v in variables:
        rb, offset = _slot_of(v)
        buffer = session._state.buffers[rb.remote_buffer_id]
        buffer[:, offset] = session._local_rows(_per_replica_values(session, v)).to(buffer.device)


def download_remote_variables(session) -> None:
    """Read every remote variable back from its slots into the session's host copies."""
    for v in _remote_variables(session.ir):
        rb, offset = _slot_of(v)
        rows = (
            session._global_rows(session._state.buffers[rb.remote_buffer_id][:, offset])
            .detach()
            .cpu()
        )
        if v.info.shard is None:
            session._store_host(v, rows.reshape(rows.shape[0], *v.shape))
        else:
            _store_sharded(session, v, rows.reshape(rows.shape[0], -1))


def _store_sharded(session, v: Variable, rows: torch.Tensor) -> None:
    layout = _layout_of(v)
    rg = v.replica_grouping
    const = rg.const_rg
    full = []
    for first in first_members(v):
        members = const._members(const.assignment[first])[: layout.shard_over]
        flat = torch.cat([rows[m] for m in members])[: layout.num_elements]
        full.append(flat.reshape(v.shape))
    groups = torch.stack(full)  # [num_user_groups, *shape]
    host = _dtypes.torch_to_numpy(groups, v.dtype)
    session._set_host(v, from_groups(v, host))
    # all_replicas: the reconstructed group value is copied to every member (§4.5).
    session._host_all[v.id] = host[rg.assignment]
