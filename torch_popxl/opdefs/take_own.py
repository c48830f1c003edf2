"""``replicated_take_own``: each replica keeps row ``i(r)`` of its own ``[G, *shape]`` value
(PopXL's ``replicated_slice``, and the gradient of all_gather). Moves no data. Its C++ kernel
is ``take_own_stacked``.

Gradient: ``all_gather`` (PopXL's grad of a 'local' reduce-scatter; Note [collective
gradients] in opdefs/_common.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..capture import call_torch
from ..ir.graph import Op
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor as Handle
from . import reference as ref
from ._api import check_tensor, grouping_of
from ._common import (
    check_grouping,
    check_stacked,
    ops,
    require_single_replica,
    save_grouping,
    stacked,
)
from .backends import InstanceTransport, collectives
from .registry import Effect, OpDef, Traffic, register

__all__ = ["opdef", "reference", "replicated_slice"]

NAME = "replicated_take_own"


def _traffic(op: Op, num_replicas: int) -> Traffic:
    return Traffic("local_slice", 0, op.attrs.argument("group_size"))


def reference(xs: list[Tensor], group_size: int, stride: int) -> list[Tensor]:
    """Each replica keeps row i(r) of its own ``[G, *shape]`` value (the grad of all_gather)."""
    ref.groups(len(xs), group_size, stride)  # validates the grouping
    out = []
    for r, x in enumerate(xs):
        if x.shape[0] != group_size:
            raise ValueError(f"replica {r}: expected {group_size} rows, got shape {tuple(x.shape)}")
        out.append(x[ref.index_in_group(r, group_size, stride)].clone())
    return out


# ---- the stacked kernel ----------------------------------------------------------------------


@torch.library.register_fake("torch_popxl::take_own_stacked")
def _stacked_fake(x, group_size, stride):
    check_stacked("take_own", x)
    check_grouping("take_own", x.shape[0], group_size, stride)
    if x.dim() < 2 or x.shape[1] != group_size:
        raise ValueError(
            f"take_own: expected a stacked tensor [R, group_size={group_size}, ...], "
            f"got shape {tuple(x.shape)}."
        )
    return x.new_empty((x.shape[0], *x.shape[2:]))


def _stacked_backward(ctx, grad):
    return ops.all_gather_stacked(grad, ctx.group_size, ctx.stride), None, None


torch.library.register_autograd(
    "torch_popxl::take_own_stacked", _stacked_backward, setup_context=save_grouping
)


# ---- the per-replica op ----------------------------------------------------------------------


@torch.library.custom_op("torch_popxl::replicated_take_own", mutates_args=())
def per_replica(x: Tensor, group_size: int, stride: int) -> Tensor:
    """One replica keeps its own row ``i(r)`` of a ``[G, *s]`` tensor: ``-> [*s]``."""
    require_single_replica(NAME, group_size)
    return ops.take_own_stacked(x.unsqueeze(0), group_size, stride).squeeze(0)


@per_replica.register_fake
def _(x, group_size, stride):
    if x.dim() < 1 or x.shape[0] != group_size:
        raise ValueError(
            f"replicated_take_own: expected one row per group member, [group_size={group_size}, "
            f"...], got shape {tuple(x.shape)}."
        )
    return x.new_empty(x.shape[1:])


@per_replica.register_vmap
def _(info, in_dims, x, group_size, stride):
    backend = collectives()
    x = stacked(x, in_dims[0], info.batch_size)
    if backend.spans_instances(group_size, stride):
        return distributed(backend, x, group_size, stride)
    return ops.take_own_stacked(x, group_size, stride), 0


def _backward(ctx, grad):
    return ops.replicated_all_gather(grad, ctx.group_size, ctx.stride), None, None


per_replica.register_autograd(_backward, setup_context=save_grouping)


# ---- many processes --------------------------------------------------------------------------


def distributed(backend: InstanceTransport, x: Tensor, group_size: int, stride: int):
    """Pick each local replica's row by its global member index: one call, no bytes."""
    backend.count(0, calls=1)
    index = backend.member_index(group_size, stride).to(x.device)
    return x[torch.arange(backend.local, device=x.device), index].contiguous(), 0


# ---- what the fast compiler asks -------------------------------------------------------------


def _explicit(op: Op, batched, num_replicas: int):
    """Note [explicit batching] (runtime/explicit.py): one ``take_own_stacked`` call on the
    stacked ``[R, ...]`` value (an unbatched one is the same on every replica)."""
    in_dim = 0 if batched[0] else None

    def run(x, group_size, stride):
        return ops.take_own_stacked(stacked(x, in_dim, num_replicas), group_size, stride)

    return run


def _output_batched(op: Op, num_replicas: int, input_batched: bool) -> bool:
    check_grouping(NAME, num_replicas, op.attrs.argument("group_size"), op.attrs.argument("stride"))
    return num_replicas > 1


# ---- the public wrapper ----------------------------------------------------------------------


def replicated_slice(t: Handle, axis: int = 0, group: ReplicaGrouping | None = None) -> Handle:
    """Replica with index i in its group takes block i of ``t`` along ``axis``."""
    check_tensor(t, "replicated_slice", data_movement=True)
    g, s = grouping_of(t, group)
    axis = axis % t.rank
    if t.shape[axis] % g:
        raise ValueError(
            f"replicated_slice: axis {axis} of {t.id!r} has size {t.shape[axis]}, not divisible by "
            f"the group size {g}."
        )
    block = t.shape[axis] // g
    x = call_torch(torch.movedim, (t, axis, 0), {})
    x = call_torch(torch.reshape, (x, (g, block, *x.shape[1:])), {})
    x = call_torch(ops.replicated_take_own, (x, g, s), {})
    if block == 1:
        # PopXL drops the sliced axis when each block has size 1 (spec §5.4); the other
        # axes are still in their original order after moving `axis` to the front.
        return call_torch(torch.squeeze, (x, 0), {})
    return call_torch(torch.movedim, (x, 0, axis), {})


opdef = register(
    OpDef(
        NAME,
        Effect.COLLECTIVE,
        {
            "traffic": _traffic,
            "reference": reference,
            "distributed": distributed,
            "explicit": _explicit,
            "output_batched": _output_batched,
            "passthrough": lambda op: False,
            "no_gradient": lambda op: False,
            "sum_read": lambda op, num_replicas: None,
            "matmul_fusion": lambda op, num_replicas: None,
            "wrapper": replicated_slice,
        },
    ),
    ops.replicated_take_own.default,
)
