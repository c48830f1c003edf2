"""``popxl.transforms.decompose_sum``: n-ary sums as accumulation chains.

Note [decompose sum]
~~~~~~~~~~~~~~~~~~~~
Upstream's DecomposeSum rewrites a Sum op with more than two inputs (typically the sum of the
gradients of a tensor read in several places) into a tree of additions scheduled for
liveness: each addend is added to a running partial sum as soon as it exists, so it dies
there instead of staying alive until every addend is ready. A captured program writes such a
sum in one of two ways, and both are rewritten:

* ``torch.stack([t1, ..., tn], d).sum(d)`` (the stacked copy alone holds n addends);
* a tree of plain ``+`` over n > 2 same-shaped addends whose partial sums are read only by the
  next ``+`` (``t1 + t2 + t3 + t4`` written after all of them).

The replacement is a chain ``((a1 + a2) + a3) + ...`` over the addends in the order they are
produced; each ``+`` is placed right after its later operand is ready (produced, and past its
last in-place update before the original sum), and the last one defines the original sum's
output tensor, so every reader is unchanged. Addition is re-associated, so floating-point
results may differ in the last bits, as on hardware. Sums of fewer than three addends, adds
that broadcast, scale (``alpha``) or change the dtype are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import given
from ..ir.graph import Graph, Op, OpKind
from ..ir.tensor import Tensor
from ..ir.walk import effects
from ..ops import add as _add

__all__ = ["decompose_sum"]

aten = torch.ops.aten


@dataclass
class _Sum:
    """One n-ary sum found in a graph: its addends, the ops it replaces, its output."""

    addends: list[Tensor]
    removed: list[int]  # op indices
    output: Tensor


def decompose_sum(graph: Graph) -> Graph:
    """Rewrite every sum of more than two tensors in ``graph`` into a chain of additions placed
    for liveness (Note [decompose sum]); returns ``graph`` (changed in place, as upstream)."""
    if not isinstance(graph, Graph):
        raise TypeError(
            f"decompose_sum expects a popxl Graph; got {given(graph)}. Pass e.g. "
            "ir.main_graph or a graph from ir.create_graph."
        )
    graph.ir._check_mutable()
    sums = _find_sums(graph)
    if sums:
        _rewrite(graph, sums)
    return graph


# ---- finding the sums -----------------------------------------------------------------------


def _readers(graph: Graph) -> dict[str, list[int]]:
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(graph._ops):
        for t in op.inputs:
            readers.setdefault(t.id, []).append(i)
    return readers


def _is_plain_add(op: Op) -> bool:
    """``a + b`` of two tensors of the output's shape and dtype, no alpha."""
    if op.kind != OpKind.TORCH or op.attrs.target is not aten.add.Tensor:
        return False
    if len(op.inputs) != 2 or len(op.attrs.args) != 2 or op.attrs.kwargs:
        return False
    out = op.outputs[0]
    return all(t.shape == out.shape and t.dtype == out.dtype for t in op.inputs)


def _find_sums(graph: Graph) -> list[_Sum]:
    ops = graph._ops
    readers = _readers(graph)
    outputs = {t.id for t in graph._outputs}
    producer = {t.id: i for i, op in enumerate(ops) for t in op.outputs}
    sums: list[_Sum] = []

    # torch.stack(ts, d).sum(d)
    for i, op in enumerate(ops):
        if op.kind != OpKind.TORCH or op.attrs.target is not aten.sum.dim_IntList:
            continue
        src = op.inputs[0]
        j = producer.get(src.id)
        if j is None or readers.get(src.id) != [i] or src.id in outputs:
            continue
        stack = ops[j]
        if stack.kind != OpKind.TORCH or stack.attrs.target is not aten.stack.default:
            continue
        dim = stack.attrs.args[1] if len(stack.attrs.args) > 1 else stack.attrs.kwargs.get("dim", 0)
        dim = dim % len(src.shape)
        dims = op.attrs.args[1] if len(op.attrs.args) > 1 else None
        keepdim = (
            op.attrs.args[2] if len(op.attrs.args) > 2 else op.attrs.kwargs.get("keepdim", False)
        )
        if dims is None or [d % len(src.shape) for d in dims] != [dim] or keepdim:
            continue
        if op.attrs.kwargs.get("dtype") is not None:
            continue
        addends = [stack.inputs[s.index] for s in stack.attrs.args[0]]
        if len(addends) > 2 and all(a.dtype == op.outputs[0].dtype for a in addends):
            sums.append(_Sum(addends, [j, i], op.outputs[0]))

    # trees of plain adds whose partial sums are read once, by the next add
    adds = {i for i, op in enumerate(ops) if _is_plain_add(op)}

    def internal(t: Tensor) -> bool:
        j = producer.get(t.id)
        return j in adds and len(readers.get(t.id, [])) == 1 and t.id not in outputs

    inner = {producer[t.id] for i in adds for t in ops[i].inputs if internal(t)}
    taken = {k for s in sums for k in s.removed}
    for root in sorted(adds - inner):
        members, addends, todo = [], [], [root]
        while todo:
            k = todo.pop()
            members.append(k)
            for t in reversed(ops[k].inputs):
                if internal(t):
                    todo.append(producer[t.id])
                else:
                    addends.append(t)
        if len(addends) > 2 and not taken.intersection(members):
            sums.append(_Sum(addends, sorted(members), ops[root].outputs[0]))
    return sums


# ---- rewriting ------------------------------------------------------------------------------


def _writes(op: Op, t: Tensor) -> bool:
    """Whether ``op`` may update ``t`` in place (Note [one effects query])."""
    return any(op.inputs[i] is t for i in effects(op).writes)


def _rewrite(graph: Graph, sums: list[_Sum]) -> None:
    ops = list(graph._ops)
    producer = {t.id: i for i, op in enumerate(ops) for t in op.outputs}
    removed = {k for s in sums for k in s.removed}
    after: dict[int, list[Op]] = {}  # original index -> new ops placed right after it
    for s in sums:
        end = max(s.removed)

        def ready(t: Tensor, end: int = end) -> int:
            # produced, and past its last in-place update before the original sum
            at = producer.get(t.id, -1)
            for k in range(at + 1, end):
                if k not in removed and _writes(ops[k], t):
                    at = k
            return at

        order = sorted(s.addends, key=ready)
        acc, at = order[0], ready(order[0])
        for n, t in enumerate(order[1:], start=2):
            at = max(at, ready(t))
            new = _capture_add(graph, acc, t, s.output if n == len(order) else None)
            # the chain belongs where the sum was: its fragment and name scope
            new = replace(new, context=ops[end].context, scope=ops[end].scope)
            after.setdefault(at, []).append(new)
            acc = new.outputs[0]
    for s in sums:  # the replaced ops' own results no longer exist
        for k in s.removed:
            for t in ops[k].outputs:
                if t is not s.output:
                    graph._tensors.pop(t.id, None)
                    graph._by_fake.pop(id(t._fake), None)
    rebuilt = list(after.get(-1, []))
    for i, op in enumerate(ops):
        if i not in removed:
            rebuilt.append(op)
        rebuilt.extend(after.get(i, []))
    graph._ops[:] = rebuilt
    graph._version += 1


def _capture_add(graph: Graph, a: Tensor, b: Tensor, output: Tensor | None) -> Op:
    """``a + b`` recorded in ``graph`` and taken back off its op list (the caller places it);
    with ``output`` the op defines that tensor instead of a new one."""
    with graph:
        result = _add(a, b)
    op = graph._ops.pop()
    assert op.outputs == (result,), "ops.add records one op"
    if output is not None:
        # The last add defines the original sum's output, so its readers stay as they are;
        # the handle it was recorded with is dropped.
        graph._tensors.pop(result.id, None)
        graph._by_fake.pop(id(result._fake), None)
        op = op.with_outputs((output,))
    return op
