"""In-place pointwise ops whose scalar is a tensor read at run time (optimizer updates).

torch's single-tensor optimizers call ``addcmul_(t1, t2, value=v)``, ``addcdiv_(t1, t2,
value=v)`` and ``add_(other, alpha=a)`` with Python numbers; their CPU kernels may contract the
multiply and the add into one fused multiply-add, so no chain of separate ops rounds as they
do. A compiled optimizer step reads its learning rate and betas from a tensor each step (an LR
scheduler changes them without a rebuild), so it calls these ops instead: each runs torch's own
kernel with the tensor's value as the number, and the update equals eager torch's bit for bit
(Note [optimizer arithmetic as torch rounds it] in compile.py).

* ``addcmul_value_(self, t1, t2, value)``: ``self.addcmul_(t1, t2, value=value.item())``
* ``addcdiv_value_(self, t1, t2, value)``: ``self.addcdiv_(t1, t2, value=value.item())``
* ``add_alpha_(self, other, alpha)``: ``self.add_(other, alpha=alpha.item())``

* ``adam_chain(p, g, exp_avg, exp_avg_sq, 1 - beta1, beta2, 1 - beta2, step_size,
  bias_correction2_sqrt, eps)``: torch's single-tensor Adam step after the weight decay
  (``exp_avg.lerp_``, ``exp_avg_sq.mul_().addcmul_()``, the denominator, ``p.addcdiv_``) in
  three passes instead of seven, bit for bit (Note [Adam chain in three passes] in
  csrc/adam.cpp); its op, ``torch_popxl::adam_chain_``, takes lists and updates each element
  on its own; on stacked values it runs once over the rows, or once per replica row where a
  scalar differs per replica. Its optional ``grad_outs`` and ``factors`` let the compiled
  step hand it the unscaled gradient: the multipliers apply in turn, the product goes to
  ``grad_outs`` (``p.grad``) and is the gradient the chain uses.

``value`` / ``alpha`` is a one-element tensor. The ops move nothing between replicas; on
stacked ``[R, ...]`` values (Note [explicit batching] in runtime/explicit.py) they run as they
are when the scalar is the same on every replica (the tensors broadcast as per replica).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import dtypes as _dtypes
from ..ir.graph import Op, Slot
from .registry import Effect, OpDef, register

__all__ = [
    "adam_chain",
    "adam_chain_pieces",
    "add_alpha_",
    "addcdiv_value_",
    "addcmul_value_",
    "opdef",
]


def _number(t: Tensor) -> float | int | bool:
    if t.numel() != 1:
        raise ValueError(
            f"expected a one-element scalar tensor, got shape {tuple(t.shape)} (the value every "
            "element of the update uses)."
        )
    return t.item()


# On a GPU, ``.item()`` would wait for the device three times per parameter per step; there
# the ops compute with the scalar as a tensor (rounding may differ from torch's kernels by an
# ulp; untested here: no GPU).


@torch.library.custom_op("torch_popxl::addcmul_value_", mutates_args=("self",))
def addcmul_value_(self: Tensor, tensor1: Tensor, tensor2: Tensor, value: Tensor) -> None:
    """``self.addcmul_(tensor1, tensor2, value=value.item())``."""
    if self.device.type != "cpu":
        self.add_(tensor1 * tensor2 * value.reshape(()))
        return
    self.addcmul_(tensor1, tensor2, value=_number(value))


@torch.library.custom_op("torch_popxl::addcdiv_value_", mutates_args=("self",))
def addcdiv_value_(self: Tensor, tensor1: Tensor, tensor2: Tensor, value: Tensor) -> None:
    """``self.addcdiv_(tensor1, tensor2, value=value.item())``."""
    if self.device.type != "cpu":
        self.add_(tensor1 / tensor2 * value.reshape(()))
        return
    self.addcdiv_(tensor1, tensor2, value=_number(value))


@torch.library.custom_op("torch_popxl::add_alpha_", mutates_args=("self",))
def add_alpha_(self: Tensor, other: Tensor, alpha: Tensor) -> None:
    """``self.add_(other, alpha=alpha.item())``."""
    if self.device.type != "cpu":
        self.add_(other * alpha.reshape(()))
        return
    self.add_(other, alpha=_number(alpha))


def _fake(*args) -> None:
    return None


torch.library.register_fake("torch_popxl::adam_chain_")(_fake)
_ADAM = torch.ops.torch_popxl.adam_chain_.default


def adam_chain(p: Tensor, g: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, one_minus_b1: Tensor,
               b2: Tensor, one_minus_b2: Tensor, step_size: Tensor, bc2_sqrt: Tensor,
               eps: Tensor, grad_out: Tensor | None = None,
               factors: Tensor | None = None) -> None:  # fmt: skip
    """One parameter's Adam step (after weight decay), in place on ``p``, ``exp_avg`` and
    ``exp_avg_sq``: ``torch_popxl::adam_chain_`` on one-element lists. The gradient is ``g``
    times each of ``factors`` (a 1-D float32 tensor) in turn, written to ``grad_out`` unless
    None."""
    _ADAM([p], [g], [exp_avg], [exp_avg_sq], one_minus_b1, b2, one_minus_b2, step_size,
          bc2_sqrt, eps, None if grad_out is None else [grad_out], factors)  # fmt: skip


def _adam_args(args) -> tuple[list, list]:
    """``adam_chain_``'s arguments as its five tensor lists (params, grads, exp_avgs,
    exp_avg_sqs, grad_outs: empty when p.grad is not kept) and seven scalars (the six of the
    step, then ``factors`` or None)."""
    args = list(args)
    return [*args[:4], (args[10] if len(args) > 10 else None) or []], [
        *args[4:10],
        args[11] if len(args) > 11 else None,
    ]


def _adam_call(lists, scalars) -> None:
    _ADAM(*lists[:4], *scalars[:6], lists[4] or None, scalars[6])


for _op in (addcmul_value_, addcdiv_value_, add_alpha_):
    _op.register_fake(_fake)


def _batched(x: Tensor, dim: int | None, rank: int) -> Tensor:
    """``x`` to broadcast against a batched ``rank``-dim (per replica) target: its vmap dim in
    front, then unit dims up to ``rank`` (as per replica); an unbatched one as it is."""
    if dim is None:
        return x
    x = x.movedim(dim, 0)
    return x.reshape(x.shape[0], *[1] * (rank - x.dim() + 1), *x.shape[1:])


def _vmap_rule(op):
    def rule(info, in_dims, self, *rest):
        *tensors, scalar = rest
        *tensor_dims, scalar_dim = in_dims[1:]
        if in_dims[0] is None:
            if any(d is not None for d in (*tensor_dims, scalar_dim)):
                raise ValueError(
                    f"{op._name}: the updated tensor is the same on every replica but the update "
                    "differs per replica; write a per-replica tensor instead."
                )
            op(self, *tensors, scalar)
            return None, None
        target = self.movedim(in_dims[0], 0)
        rank = target.dim() - 1
        tensors = [_batched(t, d, rank) for t, d in zip(tensors, tensor_dims, strict=True)]
        if scalar_dim is None:
            op(target, *tensors, scalar)
        else:  # a scalar per replica: one call per row
            scalars = scalar.movedim(scalar_dim, 0)
            for r in range(info.batch_size):
                op(target[r], *[t[r] if d is not None else t for t, d in
                                zip(tensors, tensor_dims, strict=True)], scalars[r])  # fmt: skip
        return None, None

    return rule


for _op in (addcmul_value_, addcdiv_value_, add_alpha_):
    _op.register_vmap(_vmap_rule(_op))


def _adam_stacked(lists_batched: list[list[bool]], scalars_batched: list[bool]):
    """``adam_chain_`` on stacked values (``_adam_args``'s lists and scalars): the op on the
    physical tensors when every list element is all stacked ``[R, ...]`` or all
    replica-invariant (elementwise either way) and the scalars are shared; else one call per
    replica row (a per-replica step count or learning rate, a shared gradient for a
    per-replica state). Non-contiguous operands go through contiguous copies, written back (the
    kernel's passes want flat memory)."""
    present = [fs for fs in lists_batched if fs]  # grad_outs may be empty
    uniform = not any(scalars_batched) and all(
        len(set(flags)) <= 1 for flags in zip(*present, strict=True)
    )

    def run(*args):
        lists, scalars = _adam_args(args)
        if uniform:
            copies = [[t if t.is_contiguous() else t.contiguous() for t in ts] for ts in lists]
            _adam_call(copies, scalars)
            for ts, cs in zip(lists, copies, strict=True):
                for t, c in zip(ts, cs, strict=True):
                    if c is not t and not any(
                        st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True)
                    ):
                        t.copy_(c)
            return
        rows = next(t.shape[0] for ts, fs in zip(lists, lists_batched, strict=True)
                    for t, b in zip(ts, fs, strict=True) if b)  # fmt: skip
        for r in range(rows):
            pick = [[t[r] if b else t for t, b in zip(ts, fs, strict=True)]
                    for ts, fs in zip(lists, lists_batched, strict=True)]  # fmt: skip
            _adam_call(pick, [s[r] if b else s for s, b in zip(scalars, scalars_batched,
                                                               strict=True)])  # fmt: skip

    return run


@torch.library.register_vmap("torch_popxl::adam_chain_")
def _adam_vmap(info, in_dims, *args):
    """Under vmap (a fragment on the per-replica path): the stacked form on the unwrapped rows."""
    lists, scalars = _adam_args(args)
    list_dims, scalar_dims = _adam_args(in_dims)
    list_dims = [ds or [None] * len(ts) for ts, ds in zip(lists, list_dims, strict=True)]
    lists = [[t.movedim(d, 0) if d is not None else t for t, d in zip(ts, ds, strict=True)]
             for ts, ds in zip(lists, list_dims, strict=True)]  # fmt: skip
    scalars = [s.movedim(d, 0) if d is not None else s
               for s, d in zip(scalars, scalar_dims, strict=True)]  # fmt: skip
    if not any(d is not None for ds in list_dims for d in ds):
        if any(d is not None for d in scalar_dims):
            raise ValueError(
                "adam_chain_: the parameters are the same on every replica but the step's "
                "scalars differ per replica; write per-replica parameters instead."
            )
    _adam_stacked([[d is not None for d in ds] for ds in list_dims],
                  [d is not None for d in scalar_dims])(*lists[:4], *scalars[:6], lists[4],
                                                        scalars[6])  # fmt: skip
    return None, None


def adam_chain_pieces(op: Op) -> list[int]:
    """The elementwise pieces of work (bytes each reads and writes) of the op-by-op chain one
    ``adam_chain_`` stands for, per parameter: what an IPU program runs for torch's Adam step
    (the cost model prices these, as it priced the captured chain; the published table it was
    fitted to ran the chain op by op). Per parameter of ``S`` bytes and scalars of ``s``: the
    gradient's multiply by each factor and its copy into ``p.grad`` (when the op does them);
    ``sqrt``; ``mul``, ``div``, ``add`` and addcmul's scalar term with a scalar; two copies back
    into the state; ``lerp`` and ``addcdiv`` with a scalar; the negated step size."""
    lists, scalars = _adam_args(op.attrs.args)
    s = _nbytes(op.inputs[scalars[0].index])
    num_factors = 0 if scalars[6] is None else op.inputs[scalars[6].index].shape[0]
    out: list[int] = []
    for p in lists[0]:
        S = _nbytes(op.inputs[p.index])
        out += [2 * S + s] * num_factors + [2 * S] * bool(lists[4])
        out += [2 * S, *[2 * S + s] * 4, 3 * S, 3 * S, 3 * S + s, 3 * S + s, 2 * s]
    return out


def _nbytes(t) -> int:
    return _dtypes.nbytes(t.shape, t.dtype)


# ---- what the fast compiler asks -------------------------------------------------------------


def _explicit(op: Op, batched, num_replicas: int):
    """Note [explicit batching]: the op as it is on stacked values, when the scalar is the same
    on every replica, the written tensor is per replica wherever the update is (the analysis
    makes it so) and every tensor has the same per-replica rank (a replica-invariant one then
    broadcasts over the replica dim as it would per replica)."""
    *tensors, scalar = op.attrs.args
    if not all(isinstance(t, Slot) for t in (*tensors, scalar)) or batched[scalar.index]:
        return None
    flags = [batched[t.index] for t in tensors]
    if any(flags) and not flags[0]:
        return None
    if len({op.inputs[t.index].rank for t in tensors}) != 1:
        return None
    return op.attrs.target


def _adam_explicit(op: Op, batched, num_replicas: int):
    """Note [explicit batching]: ``adam_chain_``'s stacked form for these batched inputs (the
    analysis makes what it writes per replica wherever any of its inputs is)."""
    lists, scalars = _adam_args(op.attrs.args)
    if not all(isinstance(t, Slot) for ts in lists for t in ts):
        return None
    if not all(isinstance(s, Slot) for s in scalars[:6]) or not isinstance(scalars[6], Slot | None):
        return None
    return _adam_stacked([[batched[t.index] for t in ts] for ts in lists],
                         [s is not None and batched[s.index] for s in scalars])  # fmt: skip


register(
    OpDef("adam_chain", Effect.INPLACE, {"explicit": _adam_explicit}),
    torch.ops.torch_popxl.adam_chain_.default,
)

opdef = register(
    OpDef("scalar_tensor_update", Effect.INPLACE, {"explicit": _explicit}),
    torch.ops.torch_popxl.addcmul_value_.default,
    torch.ops.torch_popxl.addcdiv_value_.default,
    torch.ops.torch_popxl.add_alpha_.default,
)
