"""``Ir.verify()``: the invariants every graph of an ``Ir`` keeps.

* every op reads tensors of its own graph that are already defined (graph inputs, variables,
  constants, or outputs of earlier ops), and defines new tensors, except in-place ops, whose
  outputs may be their own inputs;
* a captured torch op, re-run on fake tensors, gives the shapes and dtypes recorded;
* a call or repeat connects one tensor per callee input, with the callee's shapes and dtypes,
  and returns tensors matching the callee's outputs;
* graph outputs are defined tensors of the graph.

``Session`` verifies its Ir before compiling it, and the tests verify what they build.

Verification is part of every program build, so it is kept cheap: a graph that passed is not
checked again until it changes (its ``_version``), and a fake re-run is shared by every op with
the same target, literal arguments and input shapes and dtypes (a stack of identical layers
re-runs each op once), since those alone decide the shapes and dtypes the op gives.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ..errors import IrVerificationError
from .fake import fake_mode
from .graph import Graph, Op, OpKind, Slot
from .tensor import Constant, Tensor, Variable

if TYPE_CHECKING:
    from .ir import Ir

__all__ = ["verify_graph", "verify_ir"]


# graph -> the _version that last passed verification.
_verified: weakref.WeakKeyDictionary[Graph, int] = weakref.WeakKeyDictionary()

# A fake re-run's signature -> the (shape, dtype) of each output it gave.
_Signature = tuple[Any, ...]


def verify_ir(ir: Ir) -> None:
    """Raise ``IrVerificationError`` naming the first broken invariant in any graph of ``ir``."""
    results: dict[_Signature, list[tuple[tuple[int, ...], torch.dtype]]] = {}
    for graph in ir.graphs:
        if _verified.get(graph) != graph._version:
            verify_graph(graph, results)


def verify_graph(
    graph: Graph, results: dict[_Signature, list[tuple[tuple[int, ...], torch.dtype]]] | None = None
) -> None:
    """Check one graph; ``results`` shares fake re-runs between calls (see the module notes)."""
    results = {} if results is None else results
    defined = {id(t) for t in graph._inputs}
    defined |= {id(t) for t in graph._tensors.values() if isinstance(t, Variable | Constant)}
    for index, op in enumerate(graph._ops):
        where = f"graph {graph.id!r}, op {index} ({op.name})"
        for t in op.inputs:
            _check_member(graph, t, where, "reads")
            if id(t) not in defined:
                raise IrVerificationError(f"{where} reads {t.id!r} before it is defined.")
        inputs = {id(t) for t in op.inputs}
        for t in op.outputs:
            _check_member(graph, t, where, "writes")
            if id(t) in defined and id(t) not in inputs:
                raise IrVerificationError(
                    f"{where} defines {t.id!r} again; only an in-place op may return a tensor it "
                    "already has, and only one of its own inputs."
                )
        if op.kind == OpKind.TORCH:
            _check_fake_propagation(op, where, results)
        elif op.kind in (OpKind.CALL, OpKind.REPEAT):
            _check_call(op, where)
        defined |= {id(t) for t in op.outputs}
    for t in graph._outputs:
        _check_member(graph, t, f"graph {graph.id!r}", "outputs")
        if id(t) not in defined:
            raise IrVerificationError(f"graph {graph.id!r} outputs {t.id!r}, which no op defines.")
    _verified[graph] = graph._version


def _check_member(graph: Graph, t: Any, where: str, verb: str) -> None:
    if not isinstance(t, Tensor):
        raise IrVerificationError(f"{where} {verb} {t!r}, which is not a popxl Tensor.")
    if t._graph is not graph:
        raise IrVerificationError(
            f"{where} {verb} {t.id!r} of graph {t._graph.id!r}: tensors cannot cross graphs; "
            "pass them as call inputs."
        )


def _signature(op: Op) -> _Signature | None:
    """What decides an op's output shapes and dtypes, hashable; None when an argument is not."""

    def meta(x: Any) -> Any:
        if isinstance(x, Slot):
            fake = op.inputs[x.index]._fake
            return ("slot", tuple(fake.shape), fake.dtype)
        return x

    is_slot = lambda x: isinstance(x, Slot)  # noqa: E731
    args = pytree.tree_leaves(pytree.tree_map(meta, list(op.attrs.args), is_leaf=is_slot))
    kwargs = sorted(op.attrs.kwargs.items())
    key = (op.attrs.target, tuple(args), repr(pytree.tree_structure(list(op.attrs.args))),
           repr(kwargs), op.attrs.out_paths)  # fmt: skip
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _fake_results(op: Op, where: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    def fill(x: Any) -> Any:
        return op.inputs[x.index]._fake if isinstance(x, Slot) else x

    is_slot = lambda x: isinstance(x, Slot)  # noqa: E731
    args = pytree.tree_map(fill, list(op.attrs.args), is_leaf=is_slot)
    kwargs = pytree.tree_map(fill, dict(op.attrs.kwargs), is_leaf=is_slot)
    # (no autograd: a handle's fake may require grad, and an in-place op on a leaf that does
    # is refused by autograd, not by the op; shapes and dtypes are the same without it)
    with fake_mode(), torch.no_grad():
        result = op.attrs.target(*args, **kwargs)
    found = []
    for path in op.attrs.out_paths:
        value = result
        for i in path:
            value = value[i]
        if not isinstance(value, torch.Tensor):
            raise IrVerificationError(f"{where}: output path {path} is not a tensor on re-run.")
        found.append((tuple(value.shape), value.dtype))
    return found


def _check_fake_propagation(
    op: Op, where: str, results: dict[_Signature, list[tuple[tuple[int, ...], torch.dtype]]]
) -> None:
    key = _signature(op)
    found = results.get(key) if key is not None else None
    if found is None:
        found = _fake_results(op, where)
        if key is not None:
            results[key] = found
    for t, got in zip(op.outputs, found, strict=True):
        want = (tuple(t._fake.shape), t._fake.dtype)
        if got != want:
            raise IrVerificationError(
                f"{where}: {t.id!r} was recorded as {want[1]}{list(want[0])} but the op gives "
                f"{got[1]}{list(got[0])} on fake tensors."
            )


def _check_call(op: Op, where: str) -> None:
    callee: Graph = op.attrs.graph
    pairs = (("input", op.inputs, callee._inputs), ("output", op.outputs, callee._outputs))
    for what, here, there in pairs:
        if len(here) != len(there):
            raise IrVerificationError(
                f"{where} passes {len(here)} {what}s but {callee.id!r} has {len(there)}."
            )
        for i, (a, b) in enumerate(zip(here, there, strict=True)):
            if (a.shape, a.dtype, a.meta_shape) != (b.shape, b.dtype, b.meta_shape):
                raise IrVerificationError(
                    f"{where}: {what} {i} is {a.dtype.name}{list(a.shape)} but {callee.id!r} "
                    f"has {b.dtype.name}{list(b.shape)}."
                )
