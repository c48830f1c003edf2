"""``call`` / ``repeat`` of subgraphs and ``CallSiteInfo`` (spec §7.3).

Calls are pass-by-value: the callee works on copies of inputs it modifies, unless the input
is by-reference or marked modified at the call site (then the change reaches the caller).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import PopXLError, given
from ..ir.attrs import CallSite
from ..ir.context import gcg
from ..ir.graph import Graph, Op, OpKind
from ..ir.tensor import Tensor, _fake_like, constant

__all__ = ["call", "call_with_info", "repeat", "repeat_with_info", "CallSiteInfo"]


class CallSiteInfo:
    """Information about one call (or repeat) of a subgraph."""

    def __init__(self, parent: Graph, op_index: int):
        self._parent = parent
        self._index = op_index

    @property
    def _op(self) -> Op:
        return self._parent._ops[self._index]

    @property
    def called_graph(self) -> Graph:
        return self._op.attrs.graph

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return self._op.inputs

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return self._op.outputs

    def graph_to_parent_input_index(self, idx: int) -> int:
        return idx

    def parent_to_graph_input_index(self, idx: int) -> int:
        return idx

    def graph_to_parent_output_index(self, idx: int) -> int:
        return idx

    def parent_to_graph_output_index(self, idx: int) -> int:
        return idx

    def parent_input(self, idx: int) -> Tensor:
        return self._op.inputs[idx]

    def parent_output(self, idx: int) -> Tensor:
        return self._op.outputs[idx]

    def graph_to_parent(self, graph_tensor: Tensor) -> Tensor:
        g = self.called_graph
        for i, t in enumerate(g._inputs):
            if t == graph_tensor:
                return self._op.inputs[i]
        for i, t in enumerate(g._outputs):
            if t == graph_tensor:
                return self._op.outputs[i]
        raise ValueError(
            f"Tensor {graph_tensor.id!r} is neither an input nor an output of the called graph "
            f"{g.id!r}."
        )

    def parent_to_graph(self, parent_tensor: Tensor) -> Tensor:
        for i, t in enumerate(self._op.inputs):
            if t == parent_tensor:
                return self.called_graph._inputs[i]
        raise ValueError(f"Tensor {parent_tensor.id!r} is not an input of this call site.")

    def set_parent_input_modified(
        self, parent_tensor: Tensor, infer_modified_regions: bool = False
    ) -> None:
        """Make the callee's in-place changes of this input visible in the caller."""
        graph_t = self.parent_to_graph(parent_tensor)
        i = self.called_graph._inputs.index(graph_t)
        op = self._op
        modified = frozenset(op.attrs.modified) | {i}
        attrs = replace(op.attrs, modified=modified)
        self._parent._replace_op(self._index, replace(op, attrs=attrs))


def _flatten(xs) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if isinstance(x, list | tuple):
            out.extend(_flatten(x))
        else:
            out.append(x)
    return out


def _coerce(gt: Tensor, x: Any, where: str) -> Tensor:
    """Host data ``x`` as a constant of graph input ``gt``'s dtype (upstream's coercion)."""
    try:
        return constant(np.asarray(x), gt.dtype)
    except Exception as e:
        raise TypeError(
            f"{where} could not be coerced into a tensor for the called graph: Type {type(x)}. "
            f"Value: {x}"
        ) from e


def _connect(
    graph: Graph, inputs: Iterable[Any], inputs_dict: Mapping | None, check_inputs: bool
) -> list[Tensor]:
    """The parent tensors for ``graph``'s inputs, in input order.

    Checks run in upstream's order (popxl ops/call.py ``_prep_and_validate_inputs``) and raise
    its message beginnings: too many positional inputs; a positional parent tensor from another
    graph; an ``inputs_dict`` key that is not an input of ``graph``, or whose parent tensor is
    in another graph, or that is also given positionally; host data that cannot be coerced to
    the input's dtype (TypeError); and, with ``check_inputs``, inputs left unconnected.
    """
    parent = gcg()
    if graph.ir is not parent.ir:
        raise ValueError(f"Graph {graph.id!r} belongs to another Ir than the current graph.")
    positional = _flatten(inputs)
    inputs_dict = dict(inputs_dict or {})
    n = len(graph._inputs)
    if len(positional) > n:
        raise ValueError(
            "Too many inputs have been provided to the called graph. The number of positional "
            f"inputs exceeds the number of inputs of the graph. {len(positional)} > {n}. For "
            f"graph: {graph.id}"
        )
    for x in positional:
        if isinstance(x, Tensor) and x._graph is not parent:
            raise ValueError(
                f'Parent input tensor "{x.id}" is not in parent graph "{parent.id}". Tensors '
                "of other graphs reach a subgraph as its graph inputs."
            )
    for gt, x in inputs_dict.items():
        if not isinstance(gt, Tensor) or gt not in graph._inputs:
            name = gt.id if isinstance(gt, Tensor) else repr(gt)
            raise ValueError(
                f'The graph input tensor "{name}" is not in the called graph ({graph.id}). '
                "inputs_dict maps the called graph's inputs to parent tensors."
            )
        if isinstance(x, Tensor) and x._graph is not parent:
            raise ValueError(
                f'The parent input tensor "{x.id}" is not in the parent graph ({parent.id}).'
            )
        if graph._inputs.index(gt) < len(positional):
            raise ValueError(
                "Graph input tensor is specified twice for the called graph, in `inputs_dict` "
                f"and positionally in `inputs`: {gt.id}"
            )
    connected: list[Tensor | None] = [None] * n
    for i, x in enumerate(positional):
        gt = graph._inputs[i]
        connected[i] = x if isinstance(x, Tensor) else _coerce(gt, x, f'Input at position "{i}"')
    for gt, x in inputs_dict.items():
        i = graph._inputs.index(gt)
        connected[i] = x if isinstance(x, Tensor) else _coerce(gt, x, f'Input "{gt.id}"')
    missing = [(i, graph._inputs[i].id) for i, x in enumerate(connected) if x is None]
    if missing and check_inputs:
        have = [(i, graph._inputs[i].id, x.id) for i, x in enumerate(connected) if x is not None]
        raise ValueError(
            f"Not enough inputs have been provided for the called graph ({graph.id}).\n\n"
            f"Missing inputs (index, graph tensor):\n{missing}\n\nConnected inputs (index, "
            f"graph tensor, parent graph tensor):\n{have}"
        )
    out: list[Tensor] = []
    for gt, x in zip(graph._inputs, connected, strict=True):
        if x is None:
            continue
        if (x.shape, x.dtype, x.meta_shape) != (gt.shape, gt.dtype, gt.meta_shape):
            raise PopXLError(
                f"CallOp input {x.id!r} {x.dtype.name}{list(x.shape)} meta{list(x.meta_shape)} does "
                f"not match callee input tensor {gt.id!r} {gt.dtype.name}{list(gt.shape)} "
                f"meta{list(gt.meta_shape)}."
            )
        out.append(x)
    return out


def _new_outputs(parent: Graph, graph: Graph) -> list[Tensor]:
    outs = []
    for t in graph._outputs:
        outs.append(Tensor._create(parent, t.name, _fake_like(t.shape, t.dtype), t.meta_shape))
    return outs


def call_with_info(graph: Graph, *inputs: Any, inputs_dict: Mapping | None = None,
                   check_inputs: bool = True) -> CallSiteInfo:  # fmt: skip
    """Call ``graph`` and return the ``CallSiteInfo`` of the call site."""
    if not isinstance(graph, Graph):
        raise TypeError(f"call expects a popxl Graph; got {given(graph)}.")
    parent = gcg()
    connected = _connect(graph, inputs, inputs_dict, check_inputs)
    outputs = _new_outputs(parent, graph)
    by_ref = frozenset(i for i, t in enumerate(graph._inputs) if t.id in graph._by_ref)
    op = Op(OpKind.CALL, "Call", tuple(connected), tuple(outputs),
            CallSite(graph, by_ref))  # fmt: skip
    parent._append_op(op)
    return CallSiteInfo(parent, len(parent._ops) - 1)


def call(graph: Graph, *inputs: Any, inputs_dict: Mapping | None = None) -> tuple[Tensor, ...]:
    """Call ``graph`` with ``inputs``; returns its outputs as new tensors of the caller."""
    return call_with_info(graph, *inputs, inputs_dict=inputs_dict).outputs


def repeat_with_info(graph: Graph, repeat_count: int, *inputs: Any, inputs_dict: Mapping | None = None,
                     check_inputs: bool = True) -> CallSiteInfo:  # fmt: skip
    """Call ``graph`` ``repeat_count`` times; output i feeds input i of the next iteration."""
    if not isinstance(graph, Graph):
        raise TypeError(f"repeat expects a popxl Graph; got {given(graph)}.")
    if isinstance(repeat_count, bool) or not isinstance(repeat_count, int | np.integer):
        raise TypeError(
            f"repeat_count must be an int (the number of iterations); got {given(repeat_count)}."
        )
    repeat_count = int(repeat_count)
    if repeat_count < 0:
        raise ValueError(
            f"Repeat count must be >= 0. Repeat count: {repeat_count}. Graph: {graph.id}"
        )
    n_out, n_in = len(graph._outputs), len(graph._inputs)
    if n_out > n_in:
        raise ValueError(
            f"To repeat the subgraph ({graph.id}) the number of inputs must be greater than or "
            f"equal to the number of outputs. {n_in} < {n_out} (output i feeds input i of the "
            "next iteration)."
        )
    for i, (gi, go) in enumerate(zip(graph._inputs[:n_out], graph._outputs, strict=True)):
        if (gi.shape, gi.dtype) != (go.shape, go.dtype):
            raise PopXLError(
                f"repeat: output {i} of {graph.id!r} ({go.dtype.name}{list(go.shape)}) does not match "
                f"input {i} ({gi.dtype.name}{list(gi.shape)}); loop-carried values must keep their type."
            )
    parent = gcg()
    connected = _connect(graph, inputs, inputs_dict, check_inputs)
    outputs = _new_outputs(parent, graph)
    by_ref = frozenset(i for i, t in enumerate(graph._inputs) if t.id in graph._by_ref)
    op = Op(OpKind.REPEAT, "Repeat", tuple(connected), tuple(outputs),
            CallSite(graph, by_ref, repeat_count))  # fmt: skip
    parent._append_op(op)
    return CallSiteInfo(parent, len(parent._ops) - 1)


def repeat(
    graph: Graph, repeat_count: int, *inputs: Any, inputs_dict: Mapping | None = None
) -> tuple[Tensor, ...]:
    """Repeat ``graph``; returns the outputs of the last iteration."""
    return repeat_with_info(graph, repeat_count, *inputs, inputs_dict=inputs_dict).outputs
