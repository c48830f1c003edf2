"""``replicated_all_gather``: every member receives ``[G, *shape]``, row i being member i's
value (popxl.md §5.5). Its C++ kernels are ``all_gather_stacked`` and ``all_gather_full``.

Gradient: ``take_own`` — each replica keeps its own row, no summing (Note [collective
gradients] in opdefs/_common.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..capture import call_torch
from ..dtypes import nbytes
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
from .backends import InstanceTransport, add_collective_traffic, collectives
from .registry import Effect, OpDef, Traffic, register

__all__ = ["all_gather_bytes", "opdef", "reference", "replicated_all_gather"]

NAME = "replicated_all_gather"


def all_gather_bytes(num_replicas: int, group_size: int, row_bytes: int) -> int:
    """Ring bytes summed over ``num_replicas``: ``R * (G - 1) * n``."""
    return num_replicas * (group_size - 1) * row_bytes


def _traffic(op: Op, num_replicas: int) -> Traffic:
    group_size = op.attrs.argument("group_size")
    x = op.tensor_arg(0)
    return Traffic("all_gather", all_gather_bytes(num_replicas, group_size, nbytes(x.shape, x.dtype)),
                   group_size, group_size - 1)  # fmt: skip


def reference(xs: list[Tensor], group_size: int, stride: int) -> list[Tensor]:
    """Every member receives ``[G, *shape]``: row i is member i's value."""
    out: list[Tensor | None] = [None] * len(xs)
    for members in ref.groups(len(xs), group_size, stride):
        gathered = torch.stack([xs[m] for m in members])
        for m in members:
            out[m] = gathered.clone()
    return ref.filled(out)


# ---- the stacked kernels ---------------------------------------------------------------------


@torch.library.register_fake("torch_popxl::all_gather_stacked")
def _stacked_fake(x, group_size, stride):
    check_stacked("all_gather", x)
    check_grouping("all_gather", x.shape[0], group_size, stride)
    return x.new_empty((x.shape[0], group_size, *x.shape[1:]))


@torch.library.register_fake("torch_popxl::all_gather_full")
def _full_fake(x):
    return x.new_empty(x.shape)


def _stacked_backward(ctx, grad):
    return ops.take_own_stacked(grad, ctx.group_size, ctx.stride), None, None


torch.library.register_autograd(
    "torch_popxl::all_gather_stacked", _stacked_backward, setup_context=save_grouping
)


# ---- the per-replica op ----------------------------------------------------------------------


@torch.library.custom_op("torch_popxl::replicated_all_gather", mutates_args=())
def per_replica(x: Tensor, group_size: int, stride: int) -> Tensor:
    """One replica's all-gather: ``[*s] -> [G, *s]``, row i is member i's value (§5.5)."""
    require_single_replica(NAME, group_size)
    return ops.all_gather_stacked(x.unsqueeze(0), group_size, stride).squeeze(0)


@per_replica.register_fake
def _(x, group_size, stride):
    return x.new_empty((group_size, *x.shape))


@per_replica.register_vmap
def _(info, in_dims, x, group_size, stride):
    backend = collectives()
    R = backend.num_replicas(info.batch_size)
    check_grouping(NAME, R, group_size, stride)
    if backend.spans_instances(group_size, stride):
        return distributed(backend, stacked(x, in_dims[0], info.batch_size), group_size, stride)
    if group_size == R > 1:  # full group: the same [G, *s] on every replica
        return ops.all_gather_full(stacked(x, in_dims[0], info.batch_size)), None
    if in_dims[0] is None and group_size == 1:
        return ops.all_gather_stacked(x.unsqueeze(0), 1, 1).squeeze(0), None
    return ops.all_gather_stacked(stacked(x, in_dims[0], info.batch_size), group_size, stride), 0


def _backward(ctx, grad):
    return ops.replicated_take_own(grad, ctx.group_size, ctx.stride), None, None


per_replica.register_autograd(_backward, setup_context=save_grouping)


# ---- many processes --------------------------------------------------------------------------


def distributed(backend: InstanceTransport, x: Tensor, group_size: int, stride: int):
    """The vmap result ``(value, out_dim)`` when a group crosses instances."""
    row = math.prod(x.shape[1:]) * x.element_size()  # one replica's input
    if group_size == backend.R:
        backend.count(all_gather_bytes(backend.R, backend.R, row), calls=1)
        return backend.gather_all(x), None
    everyone = ops.all_gather_stacked(
        backend.gather_component(x, group_size, stride), group_size, stride
    )
    total = all_gather_bytes(backend.R, group_size, row)
    backend.count(total, counted=total)
    return backend.local_rows(everyone), 0


# ---- what the fast compiler asks -------------------------------------------------------------


def _explicit(op: Op, batched, num_replicas: int):
    """Note [explicit batching] (runtime/explicit.py): the op on stacked ``[R, ...]`` values,
    as the vmap rule runs it (a full group gives one unbatched ``[G, *s]``)."""
    in_dim = 0 if batched[0] else None

    def run(x, group_size, stride):
        if group_size == num_replicas > 1:
            return ops.all_gather_full(stacked(x, in_dim, num_replicas))
        if in_dim is None and group_size == 1:
            return ops.all_gather_stacked(x.unsqueeze(0), 1, 1).squeeze(0)
        return ops.all_gather_stacked(stacked(x, in_dim, num_replicas), group_size, stride)

    return run


def _explicit_alias(op: Op, batched, num_replicas: int):
    """The full-group gather of stacked rows, as a result that may share memory with its
    input: ``[R, *s]`` stacked rows already are the gathered ``[G, *s]``. The compiler uses
    it only where nothing can observe the sharing (Note [aliasing collectives] in
    runtime/lower.py); None where the form does not apply."""
    if not batched[0] or op.attrs.argument("group_size") != num_replicas or num_replicas < 2:
        return None

    def run(x, group_size, stride):
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        add_collective_traffic(all_gather_bytes(num_replicas, num_replicas, row_bytes), 1)
        return x if x.is_contiguous() else x.contiguous()

    return run


def _output_batched(op: Op, num_replicas: int, input_batched: bool) -> bool:
    group_size = op.attrs.argument("group_size")
    check_grouping(NAME, num_replicas, group_size, op.attrs.argument("stride"))
    if group_size == 1:
        return input_batched
    return group_size != num_replicas and num_replicas > 1


# ---- the public wrapper ----------------------------------------------------------------------


# Note [the all-gather before axis]
#     Older PopXL releases had ``replicated_all_gather(t, group=None)``: no ``axis`` or
#     ``output_shape``, and an output of shape ``(G, *t.shape)`` (a new leading axis), reshaped
#     to ``t.meta_shape`` for an RTS shard. Upstream's own tests and programs of that time call
#     it as ``replicated_all_gather(x, group)``; SDK 3.4 would read the grouping as ``axis`` and
#     refuse it. A ReplicaGrouping is never an axis, so that call gets the older meaning here:
#     the grouping is the group and ``'auto'`` means ``'meta_shape'`` or ``'new_axis'``.


def replicated_all_gather(t: Handle, axis: int = 0, group: ReplicaGrouping | None = None,
                          output_shape: str = "auto") -> Handle:  # fmt: skip
    """Gather ``t`` from every member of the group (modes: concat, new_axis, meta_shape, auto);
    ``replicated_all_gather(t, group)`` is the older signature (Note [the all-gather before
    axis])."""
    check_tensor(t, NAME, data_movement=True)
    if isinstance(axis, ReplicaGrouping):
        if group is not None:
            raise ValueError(
                f"replicated_all_gather: got a grouping both as axis ({axis!r}) and as group "
                f"({group!r}); pass an int axis and group=."
            )
        axis, group = 0, axis
        if output_shape == "auto":
            output_shape = "meta_shape" if t.meta_shape else "new_axis"
    if not isinstance(axis, int):
        raise ValueError(f"replicated_all_gather: axis must be an int; got {axis!r}.")
    if output_shape not in ("new_axis", "concat", "meta_shape", "auto"):
        raise ValueError(
            f"replicated_all_gather: output_shape must be 'new_axis', 'concat', 'meta_shape' or "
            f"'auto'; got {output_shape!r}."
        )
    if output_shape == "auto":
        output_shape = "meta_shape" if t.meta_shape else "concat"
    g, s = grouping_of(t, group)
    axis = axis % t.rank if t.rank else 0
    y = call_torch(ops.replicated_all_gather, (t, g, s), {})  # [G, *t.shape]
    if output_shape == "new_axis":
        if axis == 0:
            return y
        # PopXL's quirk for axis > 0: flatten each member with `axis` moved first, concat,
        # reshape to (G, *t.shape) and move the new axis to `axis` (spec §5.5).
        y = call_torch(torch.movedim, (y, axis + 1, 1), {})
        y = call_torch(torch.reshape, (y, (g, *t.shape)), {})
        return call_torch(torch.movedim, (y, 0, axis), {})
    if output_shape == "concat":
        y = call_torch(torch.movedim, (y, 0, axis), {})
        shape = list(t.shape)
        shape[axis] *= g
        return call_torch(torch.reshape, (y, tuple(shape)), {})
    flat = call_torch(torch.reshape, (y, (-1,)), {})
    if not t.meta_shape:
        return flat
    n = math.prod(t.meta_shape)
    # (torch's slice, not the PopXL method: ``flat`` is this op's own intermediate)
    head = call_torch(torch.Tensor.__getitem__, (flat, slice(None, n)), {})
    return call_torch(torch.reshape, (head, tuple(t.meta_shape)), {})


opdef = register(
    OpDef(
        NAME,
        Effect.COLLECTIVE,
        {
            "traffic": _traffic,
            "reference": reference,
            "distributed": distributed,
            "explicit": _explicit,
            "explicit_alias": _explicit_alias,
            "output_batched": _output_batched,
            "passthrough": lambda op: False,
            "no_gradient": lambda op: False,
            "sum_read": lambda op, num_replicas: None,
            "matmul_fusion": lambda op, num_replicas: None,
            "wrapper": replicated_all_gather,
        },
        popart_type="ReplicatedAllGather",
    ),
    ops.replicated_all_gather.default,
)
