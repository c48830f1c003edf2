"""``conditional`` / ``conditional_with_info``: run one of two subgraphs on a device bool.

Note [conditional by selection]
    Upstream's IfOp runs only the branch its condition picks, per replica. Here both branches
    are called (two ordinary call sites) and each output is ``where(cond, then_out, else_out)``:
    every replica gets the outputs of its own branch, and autodiff sends the gradient only into
    the branch that was picked (the ``where`` gives the other branch zeros). That is the same
    result as upstream as long as the branch not taken has no effect outside its outputs, so
    branches may not hold host or remote transfers, prints or collectives (checked, through
    nested calls), and by-reference inputs are refused as upstream refuses them. In-place ops
    on ordinary inputs change the branch's own copies only (calls pass by value), as upstream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import dtypes as _dtypes
from ..errors import given
from ..ir.context import gcg
from ..ir.graph import Graph, OpKind
from ..ir.opdef import Effect
from ..ir.tensor import Tensor
from ..ir.walk import effects
from ._common import call_op
from .call import CallSiteInfo, _connect, call_with_info

__all__ = ["ConditionalSiteInfo", "conditional", "conditional_with_info"]


class ConditionalSiteInfo:
    """The call site of a ``conditional``: its inputs are ``(cond, *then_inputs,
    *else_inputs)``, as upstream's IfOp numbers them."""

    def __init__(self, cond: Tensor, then_site: CallSiteInfo, else_site: CallSiteInfo,
                 outputs: tuple[Tensor, ...]):  # fmt: skip
        self._cond = cond
        self._sites = (then_site, else_site)
        self._outputs = outputs

    @property
    def called_graph(self) -> tuple[Graph, Graph]:
        """``(then_branch, else_branch)``."""
        return self._sites[0].called_graph, self._sites[1].called_graph

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return (self._cond, *self._sites[0].inputs, *self._sites[1].inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return self._outputs

    def _site(self, then_branch: bool) -> CallSiteInfo:
        return self._sites[0 if then_branch else 1]

    def _offset(self, then_branch: bool) -> int:
        return 1 if then_branch else 1 + len(self._sites[0].inputs)

    def graph_to_parent_input_index(self, idx: int, then_branch: bool = True) -> int:
        """The site's input index of a branch graph's input ``idx``."""
        if not 0 <= idx < len(self._site(then_branch).inputs):
            raise IndexError("Invalid graph input index")
        return idx + self._offset(then_branch)

    def parent_to_graph_input_index(self, idx: int) -> int:
        """The branch graph's input index of the site's input ``idx`` (not the condition)."""
        return idx - self._offset(self.is_parent_index_in_then_branch(idx))

    def is_parent_index_in_then_branch(self, idx: int) -> bool:
        n_then = len(self._sites[0].inputs)
        if 1 <= idx <= n_then:
            return True
        if n_then < idx < len(self.inputs):
            return False
        raise IndexError("Invalid parent graph input index")

    def graph_to_parent_output_index(self, idx: int, then_branch: bool = True) -> int:
        if not 0 <= idx < len(self._outputs):
            raise IndexError("Invalid graph output index")
        return idx

    def parent_to_graph_output_index(self, idx: int, then_branch: bool = True) -> int:
        if not 0 <= idx < len(self._outputs):
            raise IndexError("Invalid graph output index")
        return idx

    def graph_to_parent(self, graph_tensor: Tensor) -> Tensor:
        """The site's tensor for an input or output of either branch graph."""
        for then_branch in (True, False):
            g = self._site(then_branch).called_graph
            for i, t in enumerate(g._inputs):
                if t == graph_tensor:
                    return self.inputs[self.graph_to_parent_input_index(i, then_branch)]
            for i, t in enumerate(g._outputs):
                if t == graph_tensor:
                    return self._outputs[i]
        raise ValueError(
            f"Tensor {graph_tensor.name} is not an input or output of the called graph(s)."
        )

    def parent_to_graph(self, parent_tensor: Tensor) -> Tensor:
        """The branch input fed by ``parent_tensor`` (the then branch's first, if both)."""
        for idx, t in enumerate(self.inputs[1:], start=1):
            if t == parent_tensor:
                then_branch = self.is_parent_index_in_then_branch(idx)
                graph = self._site(then_branch).called_graph
                return graph._inputs[self.parent_to_graph_input_index(idx)]
        raise ValueError(
            f"Tensor {parent_tensor.name} is not a parent graph input of the call site."
        )

    def set_parent_input_modified(self, parent_tensor: Tensor, infer_modified_regions: bool = True):
        raise NotImplementedError(
            "Parent input modification is not yet implemented for the conditional op."
        )


def _check_branch(graph: Graph, role: str, seen: set[str]) -> None:
    """Refuse what selection cannot reproduce (Note [conditional by selection])."""
    if graph.id in seen:
        return
    seen.add(graph.id)
    for op in graph._ops:
        if op.kind in (OpKind.CALL, OpKind.REPEAT):
            _check_branch(op.attrs.graph, role, seen)
            continue
        if effects(op).flags & ~Effect.INPLACE:
            raise NotImplementedError(
                f"conditional: the {role} graph {graph.id!r} holds op {op.name!r}, which acts "
                "outside the graph (a host or remote transfer, print or collective). The "
                "simulator runs both branches and selects the outputs, so only branches "
                "without such effects are supported; move the op out of the branch and select "
                "its input or output with ops.where."
            )


def conditional_with_info(
    cond: Tensor,
    then_branch: Graph,
    else_branch: Graph,
    then_inputs: Iterable[Any] | None = None,
    else_inputs: Iterable[Any] | None = None,
    then_inputs_dict: Mapping | None = None,
    else_inputs_dict: Mapping | None = None,
    check_inputs: bool = True,
) -> ConditionalSiteInfo:
    """Run ``then_branch`` where the single-element bool ``cond`` is true, else
    ``else_branch`` (per replica); returns the site info. Inputs are given as for ``call``.
    Both branches must have outputs of the same number, dtypes and shapes.

    Raises:
        TypeError: ``cond`` is not a bool tensor; outputs differ in dtype.
        ValueError: ``cond`` has more than one element; outputs differ in number or shape;
            the inputs do not fit the branch graphs (as ``call``).
        NotImplementedError: a branch has a by-reference input (as upstream), or an op that
            acts outside the graph (Note [conditional by selection]).
    """
    parent = gcg()
    if not isinstance(cond, Tensor):
        raise TypeError(f"conditional: cond must be a popxl Tensor; got {given(cond)}.")
    if cond._graph is not parent:
        raise ValueError(
            f"conditional: cond {cond.id!r} is not in the current graph {parent.id!r}."
        )
    if cond.dtype != _dtypes.bool:
        raise TypeError(
            f"conditional: cond {cond.id!r} must be a popxl.bool tensor; got {cond.dtype.name}. "
            "Compare it first (for example ops.greater)."
        )
    if cond.nelms != 1:
        raise ValueError(
            f"conditional: cond {cond.id!r} must hold a single value; it has shape {cond.shape}."
        )
    for role, g in (("then_branch", then_branch), ("else_branch", else_branch)):
        if not isinstance(g, Graph):
            raise TypeError(f"conditional: {role} must be a popxl Graph; got {given(g)}.")
    n_then, n_else = len(then_branch._outputs), len(else_branch._outputs)
    if n_then != n_else:
        raise ValueError(
            "`then_branch` graph and `else_branch` graph must have the same number of outputs: "
            f"{n_then} != {n_else}"
        )
    for i, (a, b) in enumerate(zip(then_branch._outputs, else_branch._outputs, strict=True)):
        if a.dtype != b.dtype:
            raise TypeError(
                f"conditional: output {i} is {a.dtype.name} in then_branch ({a.id!r}) but "
                f"{b.dtype.name} in else_branch ({b.id!r}); both branches must return the same "
                "dtypes."
            )
        if a.shape != b.shape:
            raise ValueError(
                f"conditional: output {i} has shape {a.shape} in then_branch ({a.id!r}) but "
                f"{b.shape} in else_branch ({b.id!r}); both branches must return the same shapes."
            )
    for role, g in (("then_branch", then_branch), ("else_branch", else_branch)):
        for t in g._inputs:
            if t.id in g._by_ref:
                raise NotImplementedError(
                    "TensorByRef is not implemented for the conditional op. You cannot call "
                    f"this input to the {role} graph by ref: {t.id}"
                )
        _check_branch(g, role, set())
    then_call: tuple[list[Any], Mapping | None]
    else_call: tuple[list[Any], Mapping | None]
    if check_inputs:
        # Both input sets are checked before either call site is added, so a failure leaves
        # the graph unchanged; the checked tensors are then passed in input order.
        then_call = (_connect(then_branch, then_inputs or (), then_inputs_dict, True), None)
        else_call = (_connect(else_branch, else_inputs or (), else_inputs_dict, True), None)
    else:
        then_call = (list(then_inputs or ()), then_inputs_dict)
        else_call = (list(else_inputs or ()), else_inputs_dict)
    then_site = call_with_info(then_branch, *then_call[0], inputs_dict=then_call[1],
                               check_inputs=check_inputs)  # fmt: skip
    else_site = call_with_info(else_branch, *else_call[0], inputs_dict=else_call[1],
                               check_inputs=check_inputs)  # fmt: skip
    flag = call_op(torch.reshape, (cond, ()), {})
    outputs = []
    for a, b, ta, tb in zip(then_site.outputs, else_site.outputs, then_branch._outputs,
                            else_branch._outputs, strict=True):  # fmt: skip
        out = call_op(torch.where, (flag, a, b), {})
        out._meta_shape = a.meta_shape
        parent._rename_tensor(out, f"{ta.name}_or_{tb.name}")
        outputs.append(out)
    return ConditionalSiteInfo(cond, then_site, else_site, tuple(outputs))


def conditional(
    cond: Tensor,
    then_branch: Graph,
    else_branch: Graph,
    then_inputs: Iterable[Any] | None = None,
    else_inputs: Iterable[Any] | None = None,
    then_inputs_dict: Mapping | None = None,
    else_inputs_dict: Mapping | None = None,
) -> tuple[Tensor, ...]:
    """Run ``then_branch`` if ``cond`` else ``else_branch``; returns the outputs. See
    ``conditional_with_info``."""
    return conditional_with_info(cond, then_branch, else_branch, then_inputs, else_inputs,
                                 then_inputs_dict, else_inputs_dict).outputs  # fmt: skip
