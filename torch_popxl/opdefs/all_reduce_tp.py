"""``replicated_all_reduce_TP``: the differentiable all-reduce of popxl-addons' tensor-parallel
layers (``addons.ops.replicated_all_reduce_TP``), one op in three modes:

* ``"identical_inputs"``: every member of the group already holds the same value, so the
  forward is an identity and the gradient is an all-reduce of the members' gradients (the
  entry of a column-parallel block: ``x`` is replicated, each member's ``dx`` is partial);
* ``"identical_grad_inputs"``: the forward is an all-reduce and the gradient, identical on
  every member, passes through unchanged (the exit of a row-parallel block);
* ``"plain"``: an all-reduce whose gradient is an all-reduce.

Upstream lowers the identity-like direction to an identity with ``OpToIdentityPattern``; here
the mode decides at once. The reduction itself is ``replicated_all_reduce``'s (its stanza's
custom op, kernels, traffic and distributed rules): this stanza only adds the gradient rule
(each mode's gradient is the op in the mirrored mode) and the identity direction.
Only ``op='add'`` is supported, as upstream.

Known difference: the identity direction is still one op of this definition, so reports count it
as an all-reduce call moving 0 bytes (upstream's pattern leaves a plain identity); byte counts
are exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..capture import call_torch
from ..ir.graph import Op
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor as Handle
from . import all_reduce
from ._api import check_tensor, grouping_of
from ._common import check_grouping, ops
from .registry import Effect, OpDef, Traffic, register

__all__ = ["MODES", "opdef", "reference", "replicated_all_reduce_TP"]

NAME = "replicated_all_reduce_TP"
MODES = ("identical_inputs", "identical_grad_inputs", "plain")
_MIRROR = {"identical_inputs": "identical_grad_inputs", "identical_grad_inputs": "identical_inputs",
           "plain": "plain"}  # fmt: skip


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"{NAME}: mode must be one of {MODES}, got {mode!r}")


# ---- reference semantics --------------------------------------------------------------------


def reference(xs: list[Tensor], op: str, group_size: int, stride: int, mode: str) -> list[Tensor]:
    """Identity for ``identical_inputs``, else ``replicated_all_reduce``'s semantics."""
    if mode == "identical_inputs":
        return [x.clone() for x in xs]
    return all_reduce.reference(xs, op, group_size, stride)


# ---- the per-replica op ---------------------------------------------------------------------


@torch.library.custom_op("torch_popxl::replicated_all_reduce_tp", mutates_args=())
def per_replica(x: Tensor, op: str, group_size: int, stride: int, mode: str) -> Tensor:
    """One replica's TP all-reduce: identity for ``identical_inputs``, else an all-reduce."""
    if mode == "identical_inputs":
        return x.clone()
    return ops.replicated_all_reduce(x, op, group_size, stride)


@per_replica.register_fake
def _(x, op, group_size, stride, mode):
    _check_mode(mode)
    if op != "add":
        raise ValueError(f"{NAME}: only op='add' is supported (as upstream), got {op!r}")
    return x.new_empty(x.shape)


@per_replica.register_vmap
def _(info, in_dims, x, op, group_size, stride, mode):
    if mode == "identical_inputs":
        return x.clone(), in_dims[0]
    # The reduction is replicated_all_reduce's own vmap rule (full groups, strided groups,
    # groups spanning processes).
    return all_reduce.vmap_rule(info, in_dims, x, op, group_size, stride)


def _setup(ctx, inputs, output):
    ctx.op, ctx.group_size, ctx.stride, ctx.mode = inputs[1:]


def _backward(ctx, grad):
    # Each mode's gradient is the op in the mirrored mode, so autodiff records it in the
    # gradient graph (an all-reduce where the forward was an identity, and the reverse).
    g = ops.replicated_all_reduce_tp(grad, ctx.op, ctx.group_size, ctx.stride, _MIRROR[ctx.mode])
    return g, None, None, None, None


per_replica.register_autograd(_backward, setup_context=_setup)


# ---- many processes --------------------------------------------------------------------------


def distributed(backend, x: Tensor, op: str, group_size: int, stride: int, mode: str):
    """The vmap result ``(value, out_dim)`` when a group crosses instances (the vmap rule gets
    there through replicated_all_reduce's own rule; this is the same answer for callers that
    ask the definition)."""
    if mode == "identical_inputs":
        return x.clone(), 0
    return all_reduce.distributed(backend, x, op, group_size, stride)


# ---- what the fast compiler asks (runtime/lower.py, runtime/explicit.py) ---------------------


def _mode(op: Op) -> str:
    return op.attrs.argument("mode")


def _traffic(op: Op, num_replicas: int) -> Traffic:
    if _mode(op) == "identical_inputs":
        return Traffic("all_reduce", 0, op.attrs.argument("group_size"), 0)  # an identity
    return all_reduce.opdef.traffic(op, num_replicas)


def _output_batched(op: Op, num_replicas: int, input_batched: bool) -> bool:
    if _mode(op) == "identical_inputs":
        check_grouping(
            NAME, num_replicas, op.attrs.argument("group_size"), op.attrs.argument("stride")
        )
        return input_batched
    return all_reduce.opdef.rule("output_batched")(op, num_replicas, input_batched)


def _passthrough(op: Op) -> bool:
    return _mode(op) == "identical_inputs" or all_reduce.opdef.rule("passthrough")(op)


def _explicit(op: Op, batched, num_replicas: int):
    if _mode(op) == "identical_inputs":
        return lambda x, *_: x.clone()
    inner = all_reduce.opdef.rule("explicit")(op, batched, num_replicas)
    if inner is None:
        return None
    return lambda x, op_name, group_size, stride, mode: inner(x, op_name, group_size, stride)


# ---- the public wrapper (addons.ops.replicated_all_reduce_TP) --------------------------------


def replicated_all_reduce_TP(t: Handle, op: str = "add", group: ReplicaGrouping | None = None,
                             mode: str = "plain") -> Handle:  # fmt: skip
    """A differentiable all-reduce over ``group`` (all replicas when None); ``mode`` as in the
    module docstring."""
    check_tensor(t, NAME)
    _check_mode(mode)
    if op != "add":
        raise ValueError(f"{NAME}: only op='add' is supported (as upstream), got {op!r}")
    g, s = grouping_of(t, group)
    out = call_torch(ops.replicated_all_reduce_tp, (t, op, g, s, mode), {})
    out._meta_shape = t.meta_shape
    return out


opdef = register(
    OpDef(
        NAME,
        Effect.COLLECTIVE,
        {
            "traffic": _traffic,
            "reference": reference,
            "distributed": distributed,
            "output_batched": _output_batched,
            "passthrough": _passthrough,
            "no_gradient": lambda op: False,
            "sum_read": lambda op, num_replicas: None,
            "matmul_fusion": lambda op, num_replicas: None,
            "explicit": _explicit,
            "wrapper": replicated_all_reduce_TP,
        },
        popart_type="ReplicatedAllReduceTP",
    ),
    ops.replicated_all_reduce_tp.default,
)
