"""Custom ``torch.autograd.Function``s in captured code.

Note [custom autograd Functions]
    A program's own ``torch.autograd.Function`` (a straight-through estimator, a gradient
    reversal, a hand-written fused op) says what its gradient is: autograd calls its
    ``backward`` instead of differentiating the ops its ``forward`` ran. Capture records aten
    ops, and ``autodiff`` differentiates recorded ops, so the Function's rule would be lost
    (the straight-through estimator's ``round`` would pass no gradient). While torch code is
    captured, a Function that is not torch's or torch_popxl's own has its ``forward`` hooked
    (capture.py: ``apply`` is torch's C++ code, often held bound as ``ste = STE.apply``, and
    calls ``forward`` by name), and the call is recorded instead as

    * a called graph, ``forward``'s ops (``setup_context`` filling the ctx where the Function
      has one), whose inputs are the tensors given to ``apply`` (in order) and then any
      tensor the forward reads from outside (a closure's weight: an input that gets no
      gradient, as in eager torch, where the forward runs without grad);
    * a gradient graph, ``backward`` captured at the same time with the same ctx: its inputs
      are the gradients of the outputs and the forward values it reads (``ctx.saved_tensors``
      or any tensor kept on the ctx; one the forward computed becomes an extra output of the
      called graph); its outputs are the gradients ``backward`` returns for tensor arguments,
      summed to the argument's shape and cast to its dtype as autograd does;

    and the pair is registered on the Ir (``Ir._function_grads``), where ``autodiff`` finds
    it for every call of the graph (Note [given gradient graphs]). The forward is captured
    once, with the ctx it fills; ``backward`` sees that ctx, with ``needs_input_grad`` true
    for every floating-point tensor argument (autodiff drops the gradients nobody needs),
    and gradients of every output materialised (zeros where an output has none).

    The modes above the recorder (the loss splitter following batch data) see the forward's
    ops, and ``apply`` returns the forward's own result tensors (fresh ones where the forward
    returned an argument, as autograd does), so batch data stays batch data. Torch's own
    Functions (``torch.utils.checkpoint``'s reentrant variant) are differentiated through
    their ops. Unsupported: ``ctx.mark_dirty`` (a Function writing its argument in place).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..capture import handle_functions, modes_set_aside, recording_instead
from ..errors import PopXLError
from ..ir.graph import Graph
from ..ir.tensor import Constant, Tensor, _constant_from_torch, graph_input, graph_output
from .autodiff import ExpectedConnection, ExpectedConnectionType, GradGraphInfo

__all__: list[str] = []

aten = torch.ops.aten


class _Ctx(torch.autograd.function.FunctionCtx):
    """The ``ctx`` a captured Function's ``forward``/``setup_context`` and ``backward`` see."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple = ()
        self.non_differentiable: tuple = ()

    @property
    def saved_tensors(self) -> tuple:
        return tuple(self.to_save)

    saved_variables = saved_tensors

    def mark_dirty(self, *args: torch.Tensor) -> None:
        raise PopXLError(
            "A custom torch.autograd.Function called ctx.mark_dirty (it writes an argument in "
            "place); captured programs support Functions that return new tensors. Return the "
            "result instead of writing the argument."
        )


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.dtype.is_floating_point or x.dtype.is_complex)


class _CapturedFunction:
    """One ``cls.apply(*args)`` in captured code: its forward graph, its gradient graph and the
    call of the forward graph in the graph being recorded (``recorder.graph``)."""

    def __init__(self, recorder, cls, forward, setup_context):
        self.recorder = recorder
        self.cls = cls
        self.forward, self.setup_context = forward, setup_context
        self.parent: Graph = recorder.graph
        ir = self.parent.ir
        name = cls.__name__
        self.fwd = ir.create_empty_graph(name)
        self.bwd = ir.create_empty_graph(f"{name}_backward")
        self.call_args: list[Tensor] = []  # the caller's tensors, one per forward-graph input
        self.fwd_inputs: dict[str, Tensor] = {}  # forward tensor id -> gradient-graph input
        self.expected_in: list[ExpectedConnection] = []

    # ---- tensors from outside each graph --------------------------------------------------

    def _forward_input(self, fake: torch.Tensor) -> Tensor | None:
        """The caller's ``fake`` as a new input of the forward graph."""
        try:
            outer = self.recorder._handle_for(fake)
        except RuntimeError:
            return None
        with self.fwd:
            t = graph_input(outer.shape, outer.dtype, outer.name, meta_shape=outer.meta_shape)
        self.fwd._rebind_fake(t, fake)
        self.call_args.append(outer)
        return t

    def _backward_input(self, fake: torch.Tensor) -> Tensor | None:
        """A forward value the backward reads, as a gradient-graph input (Fwd connection)."""
        ft = self.fwd._tensor_for_fake(fake)
        if ft is None:
            ft = self._forward_input(fake)
        if ft is None:
            return None
        if isinstance(ft, Constant):
            c = _constant_from_torch(self.bwd, ft._data, ft.name)
            self.bwd._rebind_fake(c, fake)
            return c
        if ft.id not in self.fwd_inputs:
            if ft not in self.fwd._inputs and ft not in self.fwd._outputs:
                with self.fwd:
                    graph_output(ft)
            with self.bwd:
                self.fwd_inputs[ft.id] = graph_input(
                    ft.shape, ft.dtype, ft.name, meta_shape=ft.meta_shape
                )
            self.expected_in.append(ExpectedConnection(ft, ExpectedConnectionType.Fwd))
        handle = self.fwd_inputs[ft.id]
        self.bwd._rebind_fake(handle, fake)
        return handle

    # ---- the three parts ------------------------------------------------------------------

    def record(self, args: tuple, kwargs: dict) -> Any:
        arg_inputs = [self._forward_input(a) if isinstance(a, torch.Tensor) else None
                      for a in args]  # fmt: skip
        ctx = _Ctx(tuple(_differentiable(a) for a in args))
        with recording_instead(self.recorder, self.fwd, self._forward_input, keep_above=True):
            with torch.no_grad():
                if self.setup_context is not None:
                    result = self.forward(*args, **kwargs)
                    self.setup_context(ctx, args, result)
                else:
                    result = self.forward(ctx, *args, **kwargs)
                single = not isinstance(result, tuple)
                results = (result,) if single else tuple(result)
                # autograd returns a new tensor where the forward returns one it was given
                results = tuple(
                    aten.alias.default(r)
                    if isinstance(r, torch.Tensor)
                    and (
                        self.fwd._tensor_for_fake(r) in self.fwd._inputs
                        or self.fwd._tensor_for_fake(r) is None
                    )  # fmt: skip
                    else r
                    for r in results
                )
        outs = [r for r in results if isinstance(r, torch.Tensor)]
        with self.fwd:
            for r in outs:
                graph_output(self.fwd._tensor_for_fake(r))
        self._backward(ctx, args, arg_inputs, results)
        with modes_set_aside(), self.parent:
            call_outs = ops.call(self.fwd, *self.call_args)
        for r, t in zip(outs, call_outs, strict=False):
            self.parent._rebind_fake(t, r)
        return results[0] if single else results

    def _backward(self, ctx: _Ctx, args: tuple, arg_inputs: list, results: tuple) -> None:
        cls = self.cls
        non_diff = {id(t) for t in ctx.non_differentiable}
        grads: list[torch.Tensor | None] = []
        with self.bwd:
            for i, r in enumerate(results):
                if isinstance(r, torch.Tensor) and _differentiable(r) and id(r) not in non_diff:
                    seed = graph_input(r.shape, r.dtype, f"Gradient___{cls.__name__}_{i}")
                    self.expected_in.append(ExpectedConnection(
                        self.fwd._tensor_for_fake(r), ExpectedConnectionType.FwdGrad))  # fmt: skip
                    grads.append(seed._fake)
                else:
                    grads.append(None)
        expected_out: list[ExpectedConnection] = []
        with recording_instead(self.recorder, self.bwd, self._backward_input, keep_above=False):
            with torch.no_grad():
                for i, r in enumerate(results):  # materialised: zeros for the rest
                    if grads[i] is None and isinstance(r, torch.Tensor):
                        grads[i] = torch.zeros_like(r)
                returned = cls.backward(ctx, *grads)
                returned = returned if isinstance(returned, tuple) else (returned,)
                if len(returned) < len(args) or any(g is not None for g in returned[len(args) :]):
                    raise PopXLError(
                        f"function {cls.__name__}Backward returned an incorrect number of "
                        f"gradients (expected {len(args)}, got {len(returned)})."
                    )
                total: dict[str, torch.Tensor] = {}
                for a, t, g in zip(args, arg_inputs, returned, strict=False):
                    if t is None or g is None or not _differentiable(a):
                        continue
                    if not isinstance(g, torch.Tensor):
                        raise PopXLError(
                            f"function {cls.__name__}Backward returned {type(g).__name__} as "
                            "a gradient; expected a tensor or None."
                        )
                    if g.shape != a.shape:
                        g = g.sum_to_size(a.shape)
                    g = g.to(a.dtype)
                    total[t.id] = total[t.id] + g if t.id in total else g
        with self.bwd:
            for t in self.fwd._inputs:
                if t.id in total:
                    handle = self.bwd._tensor_for_fake(total[t.id])
                    if handle is None:
                        handle = self._backward_input(total[t.id])
                    graph_output(handle)
                    expected_out.append(ExpectedConnection(t, ExpectedConnectionType.FwdGrad))
        info = GradGraphInfo._create(self.bwd, self.fwd, self.expected_in, expected_out)
        self.parent.ir._function_grads[self.fwd] = info


def _apply_captured(recorder, cls, forward, setup_context, args: tuple, kwargs: dict) -> Any:
    return _CapturedFunction(recorder, cls, forward, setup_context).record(args, kwargs)


handle_functions(_apply_captured)
