"""``print_tensor`` as an op definition: a host print at run time, an identity for values and
gradients (the public wrapper, with its checks, is ``ops.print_tensor``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..ir.attrs import PrintOptions
from ..ir.graph import Op
from ..ir.tensor import Tensor, _fake_like
from .host import analyse_store
from .lowering import LowerEmission
from .registry import Effect, OpDef, register

__all__ = ["print_opdef", "record_print"]


def record_print(graph, source: Tensor, attrs: PrintOptions, meta_shape=()) -> Tensor:
    """Record a print of ``source`` in ``graph``; returns the printed value's new handle."""
    out = Tensor._create(graph, source.name + "_print", _fake_like(source.shape, source.dtype),
                         meta_shape)  # fmt: skip
    graph._append_op(Op(print_opdef, "PrintTensor", (source,), (out,), attrs))
    return out


class _PrintGradient(torch.autograd.Function):
    """Identity whose backward records a print of the gradient into the grad graph (the
    current graph while ``torch.autograd.grad`` records); ``replay`` is autodiff's replay,
    which names the gradient's handle (``grad_handle``)."""

    @staticmethod
    def forward(ctx, x, replay, attrs):
        ctx.replay, ctx.attrs = replay, attrs
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        source = ctx.replay.grad_handle(g)
        attrs = replace(ctx.attrs, title=f"{ctx.attrs.title}_gradient", print_gradient=False)
        out = record_print(source.graph, source, attrs)
        return out._fake, None, None


def _replay(op: Op, ins, replay):
    # print_tensor is an identity for gradients (upstream's grad op passes the gradient on,
    # printing it as "{title}_gradient" when print_gradient is set).
    if op.attrs.print_gradient and ins[0].requires_grad:
        return [_PrintGradient.apply(ins[0], replay, op.attrs)]
    return [torch.ops.aten.alias.default(ins[0])]


def _run(rt, op: Op, ins):
    rt.print(op.attrs, ins[0])
    return [ins[0]]


# The fast compiler (Note [lowering rules] in opdefs/lowering.py): the printed value is read
# whole, like a host store's; a print has no stacked form (``lower_stacked``), so a fragment
# that prints runs under vmap.
def _emit(op: Op, f, e: LowerEmission) -> None:
    e.line(f"rt.print({e.global_name(op.attrs)}, {f.ins[0]})")


# The printed value goes on unchanged (``passthrough``), yet its output is a new tensor, not an
# alias (upstream's PrintTensorOp is out of place), so an in-place write of the input after
# the print does not make the print's readers ambiguous. Both executors hand on the input's
# storage, so the output is a view of a new tensor (Note [views of new tensors] in
# ir/views.py): copied where an in-place write of either side could be seen by the other.
print_opdef = register(
    OpDef(
        "print",
        Effect.HOST_IO,
        {
            "passthrough": lambda op: True,
            "run": _run,
            "replay": _replay,
            "lower_analyse": analyse_store,
            "lower_emit": _emit,
        },
        "PrintTensor",
        attrs=PrintOptions,
        views={0: 0},
    )  # fmt: skip
)
