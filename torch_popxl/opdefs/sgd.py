"""The one-pass SGD update ``torch_popxl::sgd_update_`` (kernel: csrc/sgd.cpp).

Note [one-pass SGD update]
    torch's single-tensor SGD, the CPU default, runs ``grad.add(param, alpha=wd)``,
    ``buf.mul_(momentum).add_(grad, alpha=1 - dampening)`` (the buffer is the first step's
    gradient itself), ``grad.add(buf, alpha=momentum)`` (Nesterov) and ``param.add_(grad,
    alpha=-lr)``: each a pass over the parameter's memory. The compiled step adds its own: the
    gradient's rescaling by the loss count and the loss scale (Note [exact losses over
    micro-batches], Note [loss scaling]), the copy into ``p.grad`` (Note [p.grad after a step])
    and the first step's select. ``sgd_update_(param, momentum_buffer, grad_out, grad, hyper,
    step, factors, weight_decay, nesterov, maximize)`` does all of it in one pass: it reads
    ``grad``, multiplies it by each of ``factors`` in turn (one rounding each, as the separate
    multiplies round), writes the result to ``grad_out`` (``p.grad``; None: not kept), negates
    it for ``maximize`` and applies the update to ``param`` and ``momentum_buffer`` (None:
    momentum 0). lr, weight decay, momentum and dampening are read at run time from the
    group's float64 ``hyper`` vector (Note [hyperparameters at run time]), the first step
    (``step == 0``) from the step count. Every element rounds exactly as the ATen kernels of
    the eager chain round it (csrc/sgd.cpp lists the operations), so the update equals eager
    torch.optim.SGD's bit for bit (tests/test_sgd_kernel.py, every flag combination) and is
    the same whatever the thread count. On resnet18 it replaces about ten passes over the
    11.2M parameters with one that reads three arrays and writes three.

    The kernel takes float32 CPU tensors; the compiled step calls it for SGD groups whose
    parameters are all float32 on CPU, without dynamic loss scaling (its skipped step is
    written for the op chain) and keeps the op chain otherwise (``Trainer.fused_reasons``
    says why, ``compile_updates._sgd_kernel_reason``). It writes tensors of the same shape
    element by element, so on stacked ``[R, ...]`` values it runs as it is when every tensor
    it touches is stacked alike (an RTS shard update) or all are replica-invariant.
"""

from __future__ import annotations

import torch

from ..ir.graph import Op, Slot
from ._common import ops
from .registry import Effect, OpDef, register

__all__ = ["opdef", "sgd_update_"]

sgd_update_ = ops.sgd_update_.default

_WRITTEN = (0, 1, 2)  # param, momentum_buffer, grad_out
_SCALARS = (4, 5, 6)  # hyper, step, factors


@torch.library.register_fake("torch_popxl::sgd_update_")
def _(*args) -> None:
    return None


def _vmap_rule(info, in_dims, *args):
    """Replica-invariant scalars and tensors batched alike: one call over the stacked values
    (the batch dim moved to the front); otherwise one call per replica."""
    tensors = args[:4]
    dims = in_dims[:4]
    present = [(t, d) for t, d in zip(tensors, dims, strict=True) if t is not None]
    if any(in_dims[i] is not None for i in _SCALARS) or len({d is None for _, d in present}) > 1:
        for r in range(info.batch_size):
            row = [
                a if d is None or a is None else a.select(d, r)
                for a, d in zip(args, in_dims, strict=True)
            ]
            sgd_update_(*row)
    elif all(d is None for _, d in present):
        sgd_update_(*args)
    else:
        moved = [None if t is None else t.movedim(d, 0) for t, d in zip(tensors, dims, strict=True)]
        sgd_update_(*moved, *args[4:])
    return None, None


torch.library.register_vmap("torch_popxl::sgd_update_", _vmap_rule)


def _explicit(op: Op, batched, num_replicas: int):
    """Note [explicit batching]: the op as it is on stacked values when the scalars are
    replica-invariant and the tensors it touches are all stacked or all replica-invariant."""
    args = op.attrs.args
    flags = [batched[a.index] for a in args[:4] if isinstance(a, Slot)]
    if any(isinstance(args[i], Slot) and batched[args[i].index] for i in _SCALARS):
        return None
    if len(set(flags)) > 1:
        return None
    return op.attrs.target


opdef = register(OpDef("sgd_update", Effect.INPLACE, {"explicit": _explicit}), sgd_update_)
