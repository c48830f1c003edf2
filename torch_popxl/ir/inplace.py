"""The in-place ambiguity check PopXL runs when a Session is built
(``enableInplaceAmbiguityChecking``, on in every popxl Ir).

Note [in-place ambiguity]
~~~~~~~~~~~~~~~~~~~~~~~~~
PopART schedules ops in any order its constraints allow, so an op that modifies a tensor in
place makes the program ambiguous when another op reads or modifies an alias of that tensor
and nothing orders the two: no data dependency, no ``in_sequence`` constraint, not different
execution contexts (weights-from-host, normal, weights-to-host run one after another). The
Session then raises an error beginning "Inplacing ambiguity detected." (upstream's
tests/popxl/inplacing_ambiguity_test.py). The simulator runs ops in creation order, so it
would silently pick one of the schedules; raising keeps programs portable.

The ordering is per graph (a called graph is checked on its own) and per execution context:

* data: an op runs after the op that produced each tensor it reads, and after the last op
  created before it that modified (an alias of) that tensor;
* ``in_sequence``: the constraints recorded on each op (Note [in_sequence constraints] in
  ir/context.py), transitively.

In-place ops return their input's handle here (upstream returns a new alias object), so the
simulator cannot tell a later reader of the returned alias from a later reader of the stale
Python variable; it takes every op created after a modification to read the modified value.
The check therefore finds an op created *before* a modifier that reads or modifies an alias of
the modified tensor and is not ordered before it, which covers reads of the old value
(``y = x * 2; x += 1``) and the diamond of upstream's tests, but not two successive in-place
ops on one stale handle (``m = ops.relu_(w0); w0 += w1``, which upstream also rejects).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PopXLError
from .graph import Graph, Op
from .walk import effects

if TYPE_CHECKING:
    from .ir import Ir

__all__ = ["InplaceAmbiguityError", "check_inplace_ambiguity"]


class InplaceAmbiguityError(PopXLError):
    """An op modifies a tensor in place that an unordered op also uses (PopART's
    "Inplacing ambiguity detected." ``popart_exception``)."""


def check_inplace_ambiguity(ir: Ir) -> None:
    """Raise ``InplaceAmbiguityError`` for the first ambiguous pair of ops in any graph."""
    for graph in ir.graphs:
        _check_graph(graph)


def _check_graph(graph: Graph) -> None:
    ops = graph._ops
    root: dict[str, str] = {}  # tensor id -> id of the tensor whose storage it aliases
    last_out: dict[str, int] = {}  # tensor id -> last op that output it
    last_write: dict[str, int] = {}  # root id -> last op that modified it
    users: dict[tuple[str, str], list[tuple[int, bool]]] = {}  # (context, root) -> (op, wrote)
    ancestors: list[int] = []  # bit r of ancestors[j]: op r is ordered before op j
    chains: dict[int, list[int]] = {}  # chain -> [unit, ops of earlier units, ops of this unit]

    def root_of(t) -> str:
        return root.get(t.id, t.id)

    for j, op in enumerate(ops):
        e = effects(op)
        written, aliases = sorted(e.writes), e.aliases
        ins = [root_of(t) for t in op.inputs]
        preds = 0
        for t, t_root in zip(op.inputs, ins, strict=True):
            for i in (last_out.get(t.id), last_write.get(t_root)):
                if i is not None and ops[i].context == op.context:
                    preds |= ancestors[i] | (1 << i)
        if op.sequence is not None:
            chain, unit = op.sequence
            state = chains.setdefault(chain, [unit, 0, 0])
            if unit > state[0]:
                state[0], state[1], state[2] = unit, state[1] | state[2], 0
            preds |= state[1]
        ancestors.append(preds)
        if op.sequence is not None:
            chains[op.sequence[0]][2] |= preds | (1 << j)

        for pos in written:
            x = ins[pos]
            for r, wrote in users.get((op.context, x), ()):
                if r != j and not (preds >> r) & 1:
                    _raise(graph, op, j, ops[r], r, wrote, op.inputs[pos])
        for pos, x in enumerate(ins):
            entry = (j, pos in written)
            lst = users.setdefault((op.context, x), [])
            if not lst or lst[-1][0] != j:
                lst.append(entry)
            elif entry[1]:
                lst[-1] = entry
        for pos in written:
            last_write[ins[pos]] = j
        for k, t in enumerate(op.outputs):
            if t.id not in root:
                root[t.id] = ins[aliases[k]] if k in aliases else t.id
            last_out[t.id] = j


def _raise(graph: Graph, op: Op, j: int, other: Op, r: int, wrote: bool, t) -> None:
    verb = "also modifies" if wrote else "reads"
    raise InplaceAmbiguityError(
        f"Inplacing ambiguity detected. In graph {graph.id!r}, op {j} ({op.name}) modifies "
        f"{t.id!r} in place, and op {r} ({other.name}), created before it, {verb} {t.id!r} or "
        "an alias of it; nothing orders the two (no data dependency, in_sequence constraint or "
        "execution context), so the value it sees depends on the schedule. Create both inside "
        "`with popxl.in_sequence():`, or make the later op consume the earlier one's output."
    )
