"""Which views of PopXL's non-in-place ops the executors must copy.

Note [views of new tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Upstream, every non-in-place PopXL op makes a new tensor: ``x.T`` is PopART's TransposeOp,
``reshape`` its ReshapeOp, ``x[1:3]`` its SliceOp, and so are ``squeeze``, ``split``,
``subsample``, ``detach`` and the rest; only the in-place variants (``transpose_``,
``reshape_``, ``slice_``, ``detach_``, ...) alias their input. So after ``y = x.T``, an
in-place update of ``y`` (``var_updates.accumulate_(y, d)``) leaves ``x`` alone, and one of
``x`` leaves ``y`` with the values ``x`` had when ``y`` was made.

Torch's kernels for these ops return views. Copying every such result would cost a copy per
transpose where almost no program can tell the difference, so the op is recorded as what
torch runs, marked ``TorchCall.new_tensors`` (``capture.call_torch(..., new_tensors=True)``,
which every ``popxl.ops`` op and PopXL ``Tensor`` method uses; a view of a handle the op was
given is marked, as is a handle the op returns unchanged, which becomes an ``aten.alias``).
Its effects (Note [one effects query] in ir/walk.py) list such outputs as ``views``, not
``aliases``: to the in-place ambiguity check and the mutation analysis ``y`` is a tensor of
its own, as upstream; to the fast compiler's analyses of storage (``Effects.shared``) it
shares ``x``'s memory, as it does at run time. A runtime op whose executors hand on its
input's storage declares the same in its definition (``OpDef.views``: ``print_tensor``).
Torch code run on handles (``torch.permute(x, ...)``, ``x.view(...)``) keeps torch's aliases.

Sharing is only wrong where the program can see it: one side is written in place while the
other is still used afterwards. The whole program is known before it runs, so one walk over
it (``ir.walk.Interpreter``, calls entered, repeat bodies twice, the three fragments in order)
follows each value's storage: a view's value is a node under its source's, marked with the
op when the op makes a new tensor. A write at time t to a node conflicts with every other
node under the same storage that existed before t and is used at or after t, and whose path
to the written node crosses a marked op: that op's result must be a copy. ``copied_views``
picks the marked op nearest the leaves on each conflicting path (the smaller copy), walks
again with those ops copying, and stops when a walk finds no conflict. Variables, constants
and the tensors the WeightsFromHost fragment makes are used after the program ends (the next
run, the host). Both executors copy the results of exactly these ops where they run them
(``.clone()`` of the view), so their values are upstream's; every other view stays a view.
popxl.compile's programs record torch's own code, whose views are torch's aliases: they have
no marked op, and the walk is skipped.

Note [call outputs are new tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A call's outputs are new tensors upstream too, but a callee may return torch's alias of one
of its inputs without any marked op: a gradient graph records torch's backward code, and
the backward of ``reshape`` is a view of the incoming gradient. The walk therefore treats a
callee output that shares storage with an argument of its call, through no marked op, as
made new by the op of the callee that produced it: when a write can see the sharing, that
op's results are copied (every call of the callee then copies; no other walk changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .graph import Graph, Op, OpKind
from .tensor import Constant, Tensor
from .walk import Env, Interpreter, effects

if TYPE_CHECKING:
    from .ir import Ir

__all__ = ["copied_views"]

_FOREVER = 1 << 62  # the use time of values the program's end does not release

_CONTEXTS = ("weights_from_host", "normal", "weights_to_host")


class _Node:
    """One value's place in storage: ``base`` is the value whose memory it views (None: its
    own memory), ``edge`` the op that made it as a new tensor (None: a true alias)."""

    __slots__ = ("base", "edge", "born", "last", "depth", "root")
    depth: int
    root: _Node

    def __init__(self, born: int, base: _Node | None = None, edge: Op | None = None):
        self.base = base
        self.edge = edge
        self.born = born
        self.last = born
        self.depth = 0 if base is None else base.depth + 1
        self.root = self if base is None else base.root


class _Storage(Interpreter[_Node]):
    """One walk of the program over storage nodes (Note [views of new tensors]); ``copied``
    are the ops whose results are copies in this walk."""

    def __init__(self, copied: frozenset[Op]):
        self.copied = copied
        self.time = 0
        self.writes: list[tuple[int, _Node]] = []
        self.members: dict[_Node, list[_Node]] = {}  # root -> every node of its storage
        self.kept: dict[str, _Node] = {}  # variables and other tensors bound by no op

    def node(self, base: _Node | None = None, edge: Op | None = None) -> _Node:
        n = _Node(self.time, base, edge)
        self.members.setdefault(n.root, []).append(n)
        return n

    def op(self, op: Op, ins: list[_Node], env: Env) -> list[_Node]:
        self.time += 1
        for n in ins:
            n.last = self.time
        e = effects(op)
        for i in e.writes:
            self.writes.append((self.time, ins[i]))
        outs = []
        for k, t in enumerate(op.outputs):
            if t.id in env:  # an in-place op returns its input
                outs.append(env[t.id])
            elif k in e.aliases and op not in self.copied:
                outs.append(self.node(ins[e.aliases[k]]))
            elif k in e.views and op not in self.copied:
                outs.append(self.node(ins[e.views[k]], op))
            else:
                outs.append(self.node())
        return outs

    def constant(self, t: Constant) -> _Node:
        return self.unbound(t)

    def unbound(self, t: Tensor) -> _Node:
        n = self.kept.get(t.id)
        if n is None:
            n = self.kept[t.id] = self.node()
            n.last = _FOREVER
        return n

    def copy(self, value: _Node) -> _Node:
        value.last = self.time
        return self.node()

    def iterations(self, op: Op) -> int:
        # Each iteration is the same program: a conflict between iterations shows in the
        # first two.
        return min(op.attrs.repeat_count, 2)

    def enter(self, op: Op, args: Sequence[_Node]) -> list[_Node]:
        # Note [call outputs are new tensors]
        graph: Graph = op.attrs.graph
        outs = super().enter(op, args)
        shared = {a.root for a in args}
        for k, (t, n) in enumerate(zip(graph._outputs, outs, strict=True)):
            if n.root not in shared or _has_edge(n):
                continue
            producer = graph._producer(t)
            if (
                producer is not None
                and producer.kind == OpKind.TORCH
                and not effects(producer).writes
            ):
                outs[k] = self.node(n, producer)
        return outs

    def conflicts(self) -> set[Op]:
        """The op to copy on each conflicting path (the one nearest the leaves)."""
        found: set[Op] = set()
        for t, w in self.writes:
            for u in self.members[w.root]:
                if u is w or not u.born < t <= u.last:
                    continue
                edge = _deepest_edge(w, u)
                if edge is not None:
                    found.add(edge)
        return found


def _has_edge(n: _Node) -> bool:
    """Whether a new-tensor op lies between ``n`` and the root of its storage."""
    while n.base is not None:
        if n.edge is not None:
            return True
        n = n.base
    return False


def _deepest_edge(a: _Node, b: _Node) -> Op | None:
    """The new-tensor op on the storage path between ``a`` and ``b`` made deepest in it, or
    None when the path has none (``a`` and ``b`` are aliases)."""
    best: _Node | None = None
    while a is not b:
        if a.depth < b.depth:
            a, b = b, a
        if a.edge is not None and (best is None or a.depth > best.depth):
            best = a
        assert a.base is not None, "two nodes of one storage have a common ancestor"
        a = a.base
    return None if best is None else best.edge


def _walk(ir: Ir, copied: frozenset[Op]) -> set[Op]:
    walk = _Storage(copied)
    env: Env = {}
    main = ir.main_graph
    for context in _CONTEXTS:
        ops = main._ops_in_context(context)
        walk.run(ops, env)
        if context == "weights_from_host":  # read by every later run (RTS shards)
            for op in ops:
                for t in op.outputs:
                    env[t.id].last = _FOREVER
    return walk.conflicts()


def _marked(ir: Ir) -> bool:
    return any(op.kind == OpKind.TORCH and op.attrs.new_tensors for g in ir.graphs for op in g._ops)


def copied_views(ir: Ir) -> frozenset[Op]:
    """The ops whose results the executors must copy: views made by PopXL's non-in-place ops
    where sharing storage could be seen (Note [views of new tensors])."""
    copied: frozenset[Op] = frozenset()
    if not _marked(ir):
        return copied
    while True:
        found = _walk(ir, copied)
        if not found:
            return copied
        assert not found <= copied, f"copying {sorted(map(str, found))} resolved no conflict"
        copied = copied | found
