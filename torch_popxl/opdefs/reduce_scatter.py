"""``replicated_reduce_scatter``: flatten, zero-pad, reduce over the group, and give member i
chunk i (popxl.md §5.2). ``op == "local"`` is PopXL's no-reduction variant
(``replica_sharded_slice``, §5.3): each replica takes chunk i of its own input and nothing
moves. Its C++ kernel is ``reduce_scatter_stacked``.

Gradient: for ``'local'`` the ``all_gather`` of the gradient shard; PopXL has none for any
other op, so backward raises (Note [collective gradients] in opdefs/_common.py).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..capture import call_torch
from ..dtypes import itemsize
from ..ir.graph import Op
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor as Handle
from . import reference as ref
from ._api import check_tensor, grouping_of, reduce_op
from ._common import (
    check_grouping,
    check_op,
    chunk,
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
    "opdef",
    "reduce_scatter_bytes",
    "reference",
    "replica_sharded_slice",
    "replicated_reduce_scatter",
]

NAME = "replicated_reduce_scatter"


def reduce_scatter_bytes(
    num_replicas: int, group_size: int, num_elements: int, itemsize: int, op: str
) -> int:
    """Ring bytes summed over ``num_replicas``: ``R * (G - 1) * ceil(n / G) * itemsize`` (the
    zero-padded chunk); ``'local'`` moves nothing."""
    if op == "local":
        return 0
    return num_replicas * (group_size - 1) * chunk(num_elements, group_size) * itemsize


def _traffic(op: Op, num_replicas: int) -> Traffic:
    x, reduce, group_size = (
        op.tensor_arg(0),
        op.attrs.argument("op"),
        op.attrs.argument("group_size"),
    )
    if reduce == "local":
        return Traffic("local_slice", 0, group_size)
    nbytes = reduce_scatter_bytes(
        num_replicas, group_size, math.prod(x.shape), itemsize(x.dtype), reduce
    )
    return Traffic("reduce_scatter", nbytes, group_size, group_size - 1)


def reference(xs: list[Tensor], op: str, group_size: int, stride: int) -> list[Tensor]:
    """Flatten, zero-pad, reduce over the group, and give member i chunk i (popxl.md §5.2).

    ``op == "local"`` does no reduction: each replica takes chunk i of its *own* padded input
    (popxl.md §5.3).
    """
    out: list[Tensor | None] = [None] * len(xs)
    for members in ref.groups(len(xs), group_size, stride):
        padded = []
        size = 0
        for m in members:
            p, size = ref.flat_padded(xs[m], group_size)
            padded.append(p)
        if op == "local":
            for i, m in enumerate(members):
                out[m] = padded[i][i * size : (i + 1) * size].clone()
        else:
            reduced = ref.reduce(padded, op)
            for i, m in enumerate(members):
                out[m] = reduced[i * size : (i + 1) * size].clone()
    return ref.filled(out)


# ---- the stacked kernel ----------------------------------------------------------------------


@torch.library.register_fake("torch_popxl::reduce_scatter_stacked")
def _stacked_fake(x, op, group_size, stride):
    if x.dim() != 2:
        raise ValueError(
            f"reduce_scatter: expected a stacked tensor [R, n], got shape {tuple(x.shape)}."
        )
    check_grouping("reduce_scatter", x.shape[0], group_size, stride)
    check_op("reduce_scatter", op, x.dtype, allow_local=True)
    return x.new_empty((x.shape[0], chunk(x.shape[1], group_size)))


def _save(ctx, inputs, output):
    x, ctx.op, ctx.group_size, ctx.stride = inputs
    ctx.input_shape = x.shape


def _stacked_backward(ctx, grad):
    if ctx.op != "local":
        raise no_gradient(NAME, ctx.op)
    replicas, numel = ctx.input_shape
    gathered = ops.all_gather_stacked(grad, ctx.group_size, ctx.stride)  # [R, G, chunk]
    padded = gathered.reshape(replicas, ctx.group_size * grad.shape[1])
    return padded[:, :numel], None, None, None


torch.library.register_autograd(
    "torch_popxl::reduce_scatter_stacked", _stacked_backward, setup_context=_save
)


# ---- the per-replica op ----------------------------------------------------------------------


@torch.library.custom_op("torch_popxl::replicated_reduce_scatter", mutates_args=())
def per_replica(x: Tensor, op: str, group_size: int, stride: int) -> Tensor:
    """One replica's reduce-scatter (§5.2): ``x`` of any shape -> ``[ceil(n / G)]``.

    ``op == "local"`` is PopXL's no-reduction variant (``replica_sharded_slice``, §5.3).
    """
    require_single_replica(NAME, group_size)
    return ops.reduce_scatter_stacked(x.reshape(1, x.numel()), op, group_size, stride).squeeze(0)


@per_replica.register_fake
def _(x, op, group_size, stride):
    check_op(NAME, op, x.dtype, allow_local=True)
    return x.new_empty((chunk(x.numel(), group_size),))


@per_replica.register_vmap
def _(info, in_dims, x, op, group_size, stride):
    backend = collectives()
    rows = stacked(x, in_dims[0], info.batch_size)
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))
    if backend.spans_instances(group_size, stride):
        return distributed(backend, flat, op, group_size, stride)
    return ops.reduce_scatter_stacked(flat, op, group_size, stride), 0


def _backward(ctx, grad):
    if ctx.op != "local":
        raise no_gradient(NAME, ctx.op)
    gathered = ops.replicated_all_gather(grad, ctx.group_size, ctx.stride)  # [G, chunk]
    numel = math.prod(ctx.input_shape)
    return gathered.reshape(-1)[:numel].reshape(ctx.input_shape), None, None, None


per_replica.register_autograd(_backward, setup_context=_save)


# ---- many processes --------------------------------------------------------------------------


def _native(backend: InstanceTransport, x: Tensor, op: str, group_size: int, stride: int):
    """Reduce-scatter across instances with one ``reduce_scatter_tensor`` over the instances
    the grouping links (Note [cross-instance collectives]).

    Each linked instance owns ``local`` output rows (its replicas' chunks), so the wire tensor
    is ``[members * local, size]``: row ``(p, l)`` is this instance's partial reduction, over
    its own replicas in the group of replica ``(p, l)``, of that replica's chunk (the neutral
    element when it holds no member of that group). Summing (or min/max-ing) the rows over
    the instances gives every replica its chunk of the group's reduction.
    """
    G, S, local = group_size, stride, backend.local
    size = chunk(x.shape[1], G)
    members = backend.component(G, S)
    v, reduction = partial_form(x, op)
    v = torch.nn.functional.pad(v, (0, G * size - x.shape[1])).reshape(local, G, size)
    targets = torch.tensor([p * local + q for p in members for q in range(local)])
    mine = backend.offset + torch.arange(local)

    member = ref.index_in_group(targets, G, S)
    mask = (ref.group_of(targets, G, S)[:, None] == ref.group_of(mine, G, S)[None, :]).to(
        x.device
    )  # [T, local]
    rows = v[:, member.to(x.device)].transpose(0, 1)  # [T, local, size]
    fill = torch.full((), neutral(v.dtype, reduction), dtype=v.dtype, device=x.device)
    rows = torch.where(mask[:, :, None], rows, fill)
    part = combine_rows(rows, reduction, 1)
    out = backend.reduce_scatter_component(part.contiguous(), G, S, reduction)  # [local, size]
    return finish(out, op, G, x.dtype)


def distributed(backend: InstanceTransport, x: Tensor, op: str, group_size: int, stride: int):
    """The vmap result ``(value, out_dim)`` of ``x`` (``[R_local, n]``) when a group crosses
    instances."""
    size = chunk(x.shape[1], group_size)
    total = reduce_scatter_bytes(backend.R, group_size, x.shape[1], x.element_size(), op)
    check_op(NAME, op, x.dtype, allow_local=True)
    backend.count(total, calls=1)
    if op != "local":
        return _native(backend, x, op, group_size, stride), 0
    # Member i keeps chunk i of its own row: nothing moves.
    padded = torch.nn.functional.pad(x, (0, group_size * size - x.shape[1]))
    chunks = padded.reshape(backend.local, group_size, size)
    own = chunks[
        torch.arange(backend.local, device=x.device),
        backend.member_index(group_size, stride).to(x.device),
    ]
    return own.contiguous(), 0


# ---- what the fast compiler asks -------------------------------------------------------------


def _output_batched(op: Op, num_replicas: int, input_batched: bool) -> bool:
    check_grouping(NAME, num_replicas, op.attrs.argument("group_size"), op.attrs.argument("stride"))
    return num_replicas > 1


def _chunks(x: Tensor, group_size: int) -> Tensor:
    """The zero-padded chunks of one value as a new ``[G, ceil(n / G)]`` tensor: member i of a
    full group keeps row i (popxl.md §5.2)."""
    n = x.numel()
    size = chunk(n, group_size)
    return torch.nn.functional.pad(x.reshape(n), (0, group_size * size - n)).view(group_size, size)


def _explicit(op: Op, batched, num_replicas: int):
    """Note [explicit batching] (runtime/explicit.py): one ``reduce_scatter_stacked`` call on
    the stacked rows ``[R, n]`` (an unbatched value is the same on every replica)."""
    in_dim = 0 if batched[0] else None

    def run(x, op_name, group_size, stride):
        if in_dim is None and op_name == "local" and group_size == num_replicas:
            # Every replica slices the same value: its chunks, one copy (no [R, n] broadcast)
            add_collective_traffic(0, 1)
            return _chunks(x, num_replicas)
        rows = stacked(x, in_dim, num_replicas)
        flat = rows.reshape(num_replicas, math.prod(rows.shape[1:]))
        return ops.reduce_scatter_stacked(flat, op_name, group_size, stride)

    return run


def _explicit_alias(op: Op, batched, num_replicas: int):
    """The ``'local'`` full-group slice of a replica-invariant value as a view of it when the
    chunks need no padding (replica i's chunk is row i of ``x.view(R, n / R)``), else the
    copy of ``_explicit``. The compiler uses the view only where the shard may write through
    to the value (Note [RTS updates in place] in runtime/lower.py)."""
    if batched[0] or op.attrs.argument("op") != "local":
        return None
    if op.attrs.argument("group_size") != num_replicas or num_replicas < 2:
        return None
    copy = _explicit(op, batched, num_replicas)

    def run(x, op_name, group_size, stride):
        n = x.numel()
        if n % num_replicas or not x.is_contiguous():
            return copy(x, op_name, group_size, stride)
        add_collective_traffic(0, 1)  # a local slice moves nothing (as the 'local' rule)
        return x.view(num_replicas, n // num_replicas)

    return run


def _finish_sum(
    op_name: str, num_replicas: int, value: Tensor, batch, stacked_layout=False, alias=False
) -> Tensor:
    if op_name == "mean":
        value = value / num_replicas
    elif not stacked_layout:  # (_chunks copies)
        value = value.clone()
    # The bytes of the real reduce-scatter; the call is counted by the 'local' one below.
    nbytes = reduce_scatter_bytes(
        num_replicas, num_replicas, value.numel(), value.element_size(), "add"
    )
    if stacked_layout:  # explicit batching: replica i's chunk is row i of the padded sum
        add_collective_traffic(nbytes, 1)
        if ((op_name == "mean" or alias) and value.numel() % num_replicas == 0
                and value.is_contiguous()):  # fmt: skip
            # the quotient is a fresh tensor (or the sum may be shared: Note [replica-sum
            # accumulators] in runtime/lower.py) and needs no padding: its rows are the chunks
            return value.view(num_replicas, value.numel() // num_replicas)
        return _chunks(value, num_replicas)
    add_collective_traffic(nbytes, 0)
    return ops.replicated_reduce_scatter(batch(value), "local", num_replicas, 1)


def _sum_read(op: Op, num_replicas: int):
    """Note [replica-sum accumulators] in runtime/lower.py: a full-group add/mean of an
    accumulator that already holds the sum over replicas is each replica's chunk of it."""
    op_name = op.attrs.argument("op")
    if op_name in ("add", "mean") and op.attrs.argument("group_size") == num_replicas:
        return functools.partial(_finish_sum, op_name, num_replicas)
    return None


# ---- the public wrappers ---------------------------------------------------------------------


def replicated_reduce_scatter(t: Handle, op: str = "add", group: ReplicaGrouping | None = None,
                              configure_output_for_replicated_tensor_sharding: bool = False) -> Handle:  # fmt: skip
    """Flatten, zero-pad, reduce over the group; member i keeps chunk i (1-D)."""
    check_tensor(t, NAME)
    g, s = grouping_of(t, group)
    out = call_torch(ops.replicated_reduce_scatter, (t, reduce_op(op), g, s), {})
    if configure_output_for_replicated_tensor_sharding:
        out._meta_shape = tuple(t.shape)
    return out


def replica_sharded_slice(t: Handle, group: ReplicaGrouping | None = None) -> Handle:
    """Each replica keeps its own chunk of ``t`` (no reduction); an RTS shard of ``t``."""
    check_tensor(t, "replica_sharded_slice", data_movement=True)
    g, s = grouping_of(t, group)
    out = call_torch(ops.replicated_reduce_scatter, (t, "local", g, s), {})
    out._meta_shape = tuple(t.shape)
    # Programs pair shards with their variables by sorted name (spec addons §16).
    out.graph._rename_tensor(out, f"{t.name}_sharded_slice")
    return out


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
            "sum_read": _sum_read,
            "matmul_fusion": lambda op, num_replicas: None,
            "wrapper": replicated_reduce_scatter,
        },
        popart_type="ReplicatedReduceScatter",
    ),
    ops.replicated_reduce_scatter.default,
)
