"""Gradient graphs given for called graphs (``autodiff``'s ``called_graphs_grad_info``).

Note [given gradient graphs]
    ``autodiff`` differentiates a graph by replaying it on fake tensors and running
    ``torch.autograd``. A call of a graph listed in ``called_graphs_grad_info`` (popxl-addons
    registers the ``build_grad`` graphs of ``call_module`` children there) is replayed as one
    ``torch.autograd.Function``: its forward runs the callee, and its backward, which runs
    while the grad graph is being recorded, emits one call of the given gradient graph. That
    call's inputs follow the ``GradGraphInfo``: ``FwdGrad`` inputs take the gradients of the
    callee's outputs, ``Fwd`` inputs the caller's values of callee inputs or outputs (which
    become grad-graph inputs through autodiff's usual resolution); its outputs are the
    gradients of the callee inputs the info names.

    A called graph that does not have a given gradient graph but calls one (directly or
    deeper) is differentiated first, on its own and with the same map, and its gradient graph
    is then used as a given one (``with_intermediate_grads``): so a given gradient graph is
    used at any depth, as PopART's recursive autodiff does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from .. import ops
from ..errors import given
from ..ir.graph import Graph, Op, OpKind

__all__ = ["given_grad_graphs", "call_with_given_grad", "with_intermediate_grads"]


def given_grad_graphs(called_graphs_grad_info: Mapping | None) -> dict[Graph, Any]:
    """``{Graph: GradGraphInfo}`` from a mapping whose keys may be graph-likes (``.graph``)
    and values grad-graph-likes (``.grad_graph_info``)."""
    out: dict[Graph, Any] = {}
    for fwd, grad in (called_graphs_grad_info or {}).items():
        fwd = getattr(fwd, "graph", fwd)
        info = getattr(grad, "grad_graph_info", grad)
        if not isinstance(fwd, Graph) or not hasattr(info, "expected_inputs"):
            raise TypeError(
                "called_graphs_grad_info maps forward graphs to GradGraphInfo objects (or "
                f"graphs with a grad_graph_info); got {given(fwd)} -> "
                f"{type(grad).__name__}."
            )
        if info.forward_graph is not fwd:
            raise ValueError(
                f"called_graphs_grad_info: the gradient graph {info.graph.id!r} belongs to "
                f"{info.forward_graph.id!r}, not to {fwd.id!r}."
            )
        out[fwd] = info
    return out


class _GivenGradCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, replay, op: Op, info, *ins):
        ctx.replay, ctx.op, ctx.info = replay, op, info
        ctx.ins = ins
        # Inside the callee: its values are not the caller's (no forward-tensor notes).
        replay._depth += 1
        try:
            outs = replay.enter(op, replay.by_value(op, list(ins)))
        finally:
            replay._depth -= 1
        # Fresh tensors: a callee output may be one of its inputs (or shared), and the values
        # the caller sees must be its own call outputs.
        return tuple(o.clone() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        replay, op, info = ctx.replay, ctx.op, ctx.info
        callee: Graph = op.attrs.graph
        outs = replay.given_call_outputs[id(op)]
        handles = []
        for e in info.expected_inputs:
            t = e.fwd_tensor
            if e.connection_type.name == "FwdGrad":
                fake = grads[callee._outputs.index(t)]
                if fake is None:
                    fake = torch.zeros(tuple(t.shape), dtype=t.dtype.as_torch())
            elif t in callee._outputs:
                fake = outs[callee._outputs.index(t)]
            elif t in callee._inputs:
                fake = ctx.ins[callee._inputs.index(t)]
            else:
                raise ValueError(
                    f"The gradient graph {info.graph.id!r} reads {t.id!r}, which is neither an "
                    f"input nor an output of {callee.id!r}: make it an output of the forward graph."
                )
            handles.append(replay.grad_handle(fake))
        # The call is graph building, not a torch op: keep the recorder from seeing the fake
        # tensors it makes for the call's outputs.
        mode = _get_current_dispatch_mode()
        if mode is not None and type(mode).__name__ == "_Recorder":
            with _pop_mode_temporarily():
                results = ops.call(info.graph, *handles)
        else:
            results = ops.call(info.graph, *handles)
        in_grads: list[torch.Tensor | None] = [None] * len(ctx.ins)
        for e, r in zip(info.expected_outputs, results, strict=True):
            i = callee._inputs.index(e.fwd_tensor)
            if ctx.needs_input_grad[3 + i]:
                in_grads[i] = r._fake
        return (None, None, None, *in_grads)


def call_with_given_grad(replay, op: Op, info, ins: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs of ``op`` (a call) replayed so that its gradient is ``info``'s graph."""
    outs = list(_GivenGradCall.apply(replay, op, info, *ins))
    replay.given_call_outputs[id(op)] = outs
    return outs


def _reaches(graph: Graph, given: Mapping[Graph, Any], seen: set[int]) -> bool:
    if graph in given:
        return True
    if id(graph) in seen:
        return False
    seen.add(id(graph))
    return any(_reaches(c, given, seen) for c in graph.called_graphs)


def with_intermediate_grads(graph: Graph, given: dict[Graph, Any],
                            autodiff: Callable[..., Any]) -> dict[Graph, Any]:  # fmt: skip
    """``given`` plus a gradient graph (made with ``autodiff(callee, None, None, map)``) for
    every graph ``graph`` calls that reaches a given one without having one itself."""
    if not given:
        return given
    out = dict(given)
    for op in list(graph._ops):
        callee = op.attrs.graph if op.kind == OpKind.CALL else None
        if callee is not None and callee not in out and _reaches(callee, out, set()):
            out[callee] = autodiff(callee, None, None, out)
    return out
