"""``replicated_all_reduce``: every member of a group receives the reduction of all members'
values (popxl.md §5.1). Everything the project knows about the op is here; its C++ kernels are
``all_reduce_stacked`` and ``all_reduce_full`` (csrc/collectives.cpp).

Gradient: PopXL defines none, so backward raises (Note [collective gradients] in opdefs/_common.py).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..capture import call_torch
from ..dtypes import nbytes
from ..ir.graph import Op
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor as Handle
from . import reference as ref
from ._api import check_tensor, grouping_of, reduce_op
from ._common import (
    check_grouping,
    check_op,
    check_stacked,
    neutral,
    no_gradient,
    ops,
    partial_form,
    require_single_replica,
    stacked,
)
from .backends import InstanceTransport, add_collective_traffic, collectives
from .reduce_ops import combine_rows, finish
from .registry import Effect, OpDef, Traffic, register

__all__ = [
    "all_reduce_bytes",
    "opdef",
    "reduce_across_instances",
    "reference",
    "replicated_all_reduce",
    "replicated_all_reduce_",
]

NAME = "replicated_all_reduce"


# ---- traffic (Note [traffic formulas] in registry.py) --------------------------------------


def all_reduce_bytes(num_replicas: int, group_size: int, row_bytes: int) -> int:
    """Ring bytes summed over ``num_replicas``: ``R * 2 * (G - 1) * n / G``."""
    # R * ... // G rather than R // G * ...: under torch.distributed R may be one instance's
    # share of the replicas, which a group can exceed.
    return num_replicas * 2 * (group_size - 1) * row_bytes // group_size


def _traffic(op: Op, num_replicas: int) -> Traffic:
    group_size = op.attrs.argument("group_size")
    x = op.tensor_arg(0)
    return Traffic("all_reduce", all_reduce_bytes(num_replicas, group_size, nbytes(x.shape, x.dtype)),
                   group_size, 2 * (group_size - 1))  # fmt: skip


# ---- reference semantics --------------------------------------------------------------------


def reference(xs: list[Tensor], op: str, group_size: int, stride: int) -> list[Tensor]:
    """Every member of a group receives the reduction of all members' values."""
    out: list[Tensor | None] = [None] * len(xs)
    for members in ref.groups(len(xs), group_size, stride):
        reduced = ref.reduce([xs[m] for m in members], op)
        for m in members:
            out[m] = reduced.clone()
    return ref.filled(out)


# ---- the stacked kernels: fake and autograd --------------------------------------------------


@torch.library.register_fake("torch_popxl::all_reduce_stacked")
def _stacked_fake(x, op, group_size, stride):
    check_stacked("all_reduce", x)
    check_grouping("all_reduce", x.shape[0], group_size, stride)
    check_op("all_reduce", op, x.dtype)
    return x.new_empty(x.shape)


@torch.library.register_fake("torch_popxl::all_reduce_full")
def _full_fake(x, op):
    check_op("all_reduce_full", op, x.dtype)
    return x.new_empty(x.shape[1:])


def _backward(ctx, grad):
    raise no_gradient(NAME)


torch.library.register_autograd("torch_popxl::all_reduce_stacked", _backward)


# ---- the per-replica op ----------------------------------------------------------------------


@torch.library.custom_op("torch_popxl::replicated_all_reduce", mutates_args=())
def per_replica(x: Tensor, op: str, group_size: int, stride: int) -> Tensor:
    """One replica's all-reduce over its group (popxl.md §5.1); ``x`` keeps its shape."""
    require_single_replica(NAME, group_size)
    return ops.all_reduce_stacked(x.unsqueeze(0), op, group_size, stride).squeeze(0)


@per_replica.register_fake
def _(x, op, group_size, stride):
    check_op(NAME, op, x.dtype)
    return x.new_empty(x.shape)


def vmap_rule(info, in_dims, x, op, group_size, stride):
    # A full-group result is the same on every replica: return it unbatched (stored once),
    # which lets the executor keep replica-invariant values unbatched (see runtime/lower.py).
    backend = collectives()
    R = backend.num_replicas(info.batch_size)
    check_grouping(NAME, R, group_size, stride)
    if backend.spans_instances(group_size, stride):
        return distributed(backend, stacked(x, in_dims[0], info.batch_size), op, group_size, stride)
    if group_size == R > 1:
        return ops.all_reduce_full(stacked(x, in_dims[0], info.batch_size), op), None
    if in_dims[0] is None and group_size == 1:
        return ops.all_reduce_stacked(x.unsqueeze(0), op, 1, 1).squeeze(0), None
    return ops.all_reduce_stacked(
        stacked(x, in_dims[0], info.batch_size), op, group_size, stride
    ), 0


per_replica.register_vmap(vmap_rule)  # named: the TP all-reduce (all_reduce_tp.py) reuses it
per_replica.register_autograd(_backward)


# ---- many processes (Note [cross-instance collectives] in runtime/distributed.py) ------------


def reduce_across_instances(backend: InstanceTransport, x: Tensor, op: str) -> Tensor:
    """``[R_local, *s] -> [*s]``: one group of all replicas. Each instance reduces its own rows
    and one partial per instance crosses the wire (counted by the caller)."""
    check_op(NAME, op, x.dtype)
    v, reduction = partial_form(x, op)
    total = backend.all_reduce_partial(combine_rows(v, reduction, 0).contiguous(), reduction)
    return finish(total, op, backend.R, x.dtype)


def distributed(backend: InstanceTransport, x: Tensor, op: str, group_size: int, stride: int):
    """The vmap result ``(value, out_dim)`` when a group crosses instances."""
    row = math.prod(x.shape[1:]) * x.element_size()  # one replica's input
    if group_size == backend.R:
        backend.count(all_reduce_bytes(backend.R, backend.R, row), calls=1)
        return reduce_across_instances(backend, x, op), None
    backend.count(all_reduce_bytes(backend.R, group_size, row), calls=1)
    return _grouped(backend, x, op, group_size, stride), 0


def _grouped(backend: InstanceTransport, x: Tensor, op: str, group_size: int, stride: int):
    """``[R_local, *s] -> [R_local, *s]``: groups that cross instances. One partial per group
    with a member on the linked instances (the neutral element where this instance holds
    none) goes through one all-reduce over those instances; each replica keeps its group's
    row. With one replica per instance that is one row: the ring of the group itself."""
    check_op(NAME, op, x.dtype)
    G, S, local = group_size, stride, backend.local
    linked = backend.component(G, S)
    groups = sorted({ref.group_of(p * local + q, G, S) for p in linked for q in range(local)})
    mine = [ref.group_of(backend.offset + q, G, S) for q in range(local)]
    v, reduction = partial_form(x, op)
    mask = torch.tensor([[g == m for m in mine] for g in groups], device=x.device)  # [m, local]
    rows = v.unsqueeze(0).expand(len(groups), *v.shape)  # [m, local, *s]
    shape = (len(groups), local) + (1,) * (v.dim() - 1)
    neutral_value = torch.full((), neutral(v.dtype, reduction), dtype=v.dtype, device=x.device)
    rows = torch.where(mask.reshape(shape), rows, neutral_value)
    part = combine_rows(rows, reduction, 1)
    total = backend.all_reduce_component(part.contiguous(), G, S, reduction)
    out = total[torch.tensor([groups.index(m) for m in mine], device=x.device)]
    return finish(out, op, G, x.dtype)


# ---- what the fast compiler asks (runtime/lower.py, runtime/explicit.py) ---------------------


def _output_batched(op: Op, num_replicas: int, input_batched: bool) -> bool:
    """Whether the output differs between replicas. Validates the grouping first: the
    full-group test looks at group_size only, and (G=R, stride=-1) must be an error."""
    group_size = op.attrs.argument("group_size")
    check_grouping(NAME, num_replicas, group_size, op.attrs.argument("stride"))
    if group_size == 1:
        return input_batched
    return group_size != num_replicas and num_replicas > 1


def _passthrough(op: Op) -> bool:
    """Groups of one replica: add/mean/min/max return the input unchanged."""
    return op.attrs.argument("group_size") == 1 and op.attrs.argument("op") in (
        "add",
        "mean",
        "min",
        "max",
    )


def _finish_sum(
    op_name: str, num_replicas: int, value: Tensor, batch, stacked_layout=False, alias=False
) -> Tensor:
    if op_name == "add":  # the sum itself, or a copy (Note [replica-sum accumulators])
        result = value if alias else value.clone()
    else:
        result = value / num_replicas
    add_collective_traffic(
        all_reduce_bytes(num_replicas, num_replicas, value.numel() * value.element_size()), 1
    )
    return result


def _sum_read(op: Op, num_replicas: int):
    """Note [replica-sum accumulators] in runtime/lower.py: a full-group add/mean of an
    accumulator that already holds the sum over replicas, as ``fn(sum, batch) -> result``."""
    op_name = op.attrs.argument("op")
    if op_name in ("add", "mean") and op.attrs.argument("group_size") == num_replicas:
        return functools.partial(_finish_sum, op_name, num_replicas)
    return None


def _matmul_fusion(op: Op, num_replicas: int) -> str | None:
    """Note [fold replicas into the matmul]: the fused kernel's reduction ('add' or 'mean')
    when an all-reduce of a matmul can run as ``mm_all_reduce``, else None."""
    op_name = op.attrs.argument("op")
    if op.attrs.argument("group_size") == num_replicas > 1 and op_name in ("add", "mean"):
        return op_name
    return None


def _explicit(op: Op, batched, num_replicas: int):
    """Note [explicit batching]: the op on stacked ``[R, ...]`` values, as the vmap rule runs
    it: a full group is one ``all_reduce_full`` (an unbatched result), groups of one on an
    unbatched value stay unbatched, any other grouping is one ``all_reduce_stacked``."""
    x_batched = batched[0]

    def run(x, op_name, group_size, stride):
        if group_size == num_replicas > 1:
            return ops.all_reduce_full(stacked(x, 0 if x_batched else None, num_replicas), op_name)
        if not x_batched and group_size == 1:
            return ops.all_reduce_stacked(x.unsqueeze(0), op_name, 1, 1).squeeze(0)
        rows = stacked(x, 0 if x_batched else None, num_replicas)
        return ops.all_reduce_stacked(rows, op_name, group_size, stride)

    return run


# ---- the public wrappers (popxl.ops.collectives) --------------------------------------------


def replicated_all_reduce(
    t: Handle, op: str = "add", group: ReplicaGrouping | None = None
) -> Handle:
    """Reduce ``t`` over the replicas of each group; every member gets the result."""
    check_tensor(t, NAME)
    g, s = grouping_of(t, group)
    out = call_torch(ops.replicated_all_reduce, (t, reduce_op(op), g, s), {})
    out._meta_shape = t.meta_shape
    return out


def replicated_all_reduce_(
    t: Handle, op: str = "add", group: ReplicaGrouping | None = None
) -> Handle:
    """In-place ``replicated_all_reduce``; returns ``t`` (modified)."""
    out = replicated_all_reduce(t, op, group)
    return call_torch(torch.Tensor.copy_, (t, out), {})


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
            "passthrough": _passthrough,
            # PopXL defines no gradient (spec §5.1): autodiff yields none through it.
            "no_gradient": lambda op: True,
            "sum_read": _sum_read,
            "matmul_fusion": _matmul_fusion,
            "wrapper": replicated_all_reduce,
        },
        popart_type="ReplicatedAllReduce",
    ),
    ops.replicated_all_reduce.default,
)
