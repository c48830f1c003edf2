"""One interpreter of the IR's control structure, with the value domain as a parameter.

``Interpreter`` knows once how a program runs: graph inputs bound to values, ops in order, a
call entering its callee with its arguments bound, a repeat running its body ``repeat_count``
times with loop-carried values, and the callee's outputs handed back to the caller. What an
op *does* is the subclass's business (``Interpreter.op``), and so is what a value is: per-replica
tensors (the reference executor), fake tensors (autodiff's replay), value names (the fast
compiler's flattener), root-input indices (``mutated_inputs``), places in storage (which
views to copy, ``ir/views.py``), nothing at all (liveness, ``executed_ops``). A subclass that wants a summary of a callee instead of entering it (for
example the set of inputs it writes) overrides ``call`` / ``repeat``.

Note [pass by value]
    A called graph must not change its caller's tensors unless the call site marks the input
    modified (``CallSite.modified``). Ops run in place on the values they are given, so the
    walker copies (``Interpreter.copy``) exactly the arguments the callee may modify
    (``mutated_inputs``) and the caller did not allow, and nothing else. Likewise a callee
    output that is one of the callee's own inputs is copied, so the caller never receives an
    alias of a value it passed in.

Note [repeat carries]
    ``repeat(graph, n, *args)`` binds ``args`` to the body's inputs; after each iteration the
    body's k outputs replace the first k carried values (the remaining inputs keep their values)
    and the op's outputs are the first ``len(op.outputs)`` carried values after the last one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, MutableMapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import torch

from .attrs import CallSite
from .graph import Graph, Op, OpKind, Slot
from .opdef import Effect, Effects, OpDef, definition_of
from .tensor import Constant, Tensor

__all__ = ["Effects", "Interpreter", "effects", "executed_ops", "mutated_inputs"]

V = TypeVar("V")
Env = MutableMapping[str, Any]

_aten = torch.ops.aten


class Interpreter(Generic[V]):
    """Walks ops with their values in an environment ``{tensor id: value}`` per graph run.

    Subclasses implement ``op`` and, where the program can use constants, ``constant``; they
    may override ``copy`` (Note [pass by value]), ``unbound`` and ``call`` / ``repeat``.
    """

    # ---- the hooks ------------------------------------------------------------------------

    def op(self, op: Op, ins: list[V], env: Env) -> Sequence[V]:
        """Run one op that is not a call or repeat; returns one value per ``op.outputs``.

        ``env`` is the current graph's environment; an output whose tensor is already bound
        (an in-place op returns its input's handle) can be looked up in it."""
        raise NotImplementedError(f"{type(self).__name__} has no rule for {op.kind} ops.")

    def constant(self, t: Constant) -> V:
        """The value of a constant at its first use in a graph run (then kept in ``env``)."""
        raise NotImplementedError(f"{type(self).__name__} has no rule for constants ({t.id}).")

    def unbound(self, t: Tensor) -> V:
        """The value of a tensor the environment does not hold (a variable or a tensor of
        another fragment, when the subclass did not bind them)."""
        raise AssertionError(f"tensor {t.id} is used before it is defined")

    def copy(self, value: V) -> V:
        """A copy of ``value`` that ops may change without changing ``value`` (pass by value).
        The default is ``value`` itself, for value domains that stand for tensors without
        holding their data (names, indices, fake tensors)."""
        return value

    def call(self, op: Op, ins: list[V]) -> Sequence[V]:
        """A ``call`` op: by default its callee runs once with ``ins`` bound to its inputs."""
        return self.enter(op, self.by_value(op, ins))

    def repeat(self, op: Op, ins: list[V]) -> Sequence[V]:
        """A ``repeat`` op: by default its body runs ``iterations(op)`` times (Note [repeat
        carries])."""
        carry = self.by_value(op, ins)
        k = len(op.attrs.graph._outputs)
        for _ in range(self.iterations(op)):
            carry[:k] = self.enter(op, carry)
        return carry[: len(op.outputs)]

    def iterations(self, op: Op) -> int:
        """How many times ``repeat`` runs a repeat's body: its ``repeat_count``, or fewer for
        an analysis that learns all it needs from the first few."""
        return op.attrs.repeat_count

    # ---- the walk -------------------------------------------------------------------------

    def run(self, ops: Iterable[Op], env: Env) -> Env:
        """Run ``ops`` in order in ``env``, binding every op's outputs; returns ``env``."""
        for op in ops:
            ins = [self.read(t, env) for t in op.inputs]
            if op.kind == OpKind.CALL:
                outs = self.call(op, ins)
            elif op.kind == OpKind.REPEAT:
                outs = self.repeat(op, ins)
            else:
                outs = self.op(op, ins, env)
            for t, v in zip(op.outputs, outs, strict=True):
                env[t.id] = v
        return env

    def read(self, t: Tensor, env: Env) -> V:
        """``t``'s value in ``env`` (a constant is made on first use)."""
        if t.id in env:
            return env[t.id]
        if isinstance(t, Constant):
            v = env[t.id] = self.constant(t)
            return v
        return self.unbound(t)

    def bind(self, graph: Graph, args: Sequence[V]) -> Env:
        """A fresh environment for one run of ``graph`` with ``args`` bound to its inputs."""
        return {t.id: v for t, v in zip(graph._inputs, args, strict=True)}

    def by_value(self, op: Op, ins: Sequence[V]) -> list[V]:
        """The call's arguments, copied where the callee may modify what the caller did not
        allow (Note [pass by value])."""
        site: CallSite = op.attrs
        clone = mutated_inputs(site.graph) - site.modified
        return [self.copy(v) if i in clone else v for i, v in enumerate(ins)]

    def results(self, graph: Graph, env: Env) -> list[V]:
        """The values of ``graph``'s outputs after a run in ``env``; an output that is one of
        the graph's own inputs is copied (Note [pass by value])."""
        input_ids = {t.id for t in graph._inputs}
        return [
            self.copy(self.read(t, env)) if t.id in input_ids else self.read(t, env)
            for t in graph._outputs
        ]

    def enter(self, op: Op, args: Sequence[V]) -> list[V]:
        """One run of the callee of ``op`` with ``args`` bound; returns its outputs' values."""
        graph: Graph = op.attrs.graph
        return self.results(graph, self.run(graph._ops, self.bind(graph, args)))


# ---- executed_ops -------------------------------------------------------------------------


class _Executed(Interpreter[None]):
    """Records ``(op, count)`` for every op as it runs; a repeat's body is walked once with the
    count multiplied rather than unrolled."""

    def __init__(self, times: int):
        self.times = times
        self.found: list[tuple[Op, int]] = []

    def op(self, op: Op, ins: list[None], env: Env) -> list[None]:
        self.found.append((op, self.times))
        return [None] * len(op.outputs)

    def constant(self, t: Constant) -> None:
        return None

    def unbound(self, t: Tensor) -> None:
        return None

    def call(self, op: Op, ins: list[None]) -> list[None]:
        outer = self.times
        self.times = outer * op.attrs.repeat_count
        self.enter(op, ins)
        self.times = outer
        return [None] * len(op.outputs)

    repeat = call


def executed_ops(ops: Iterable[Op], times: int = 1) -> list[tuple[Op, int]]:
    """``(op, count)`` for every op that runs when ``ops`` run ``times`` times.

    A call or repeat is entered instead of listed: its callee's ops come with ``count``
    multiplied by the call's ``repeat_count`` (1 for a call), recursively.
    """
    walk = _Executed(times)
    walk.run(ops, {})
    return walk.found


# ---- effects ------------------------------------------------------------------------------

# Note [one effects query]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Every walker that must know which inputs an op writes, which outputs alias which inputs, or
# whether it talks to other replicas, streaming memory or the host asks ``effects(op)``: the
# mutation analysis below, the in-place ambiguity check, autodiff's refusal of modifying ops,
# the sum decomposition and the fast compiler's aliasing analyses. The answer comes from
#
# * a captured torch op's schema (``Tensor(a!)`` arguments are written; a return in alias set
#   ``a`` aliases that argument, each element of a ``Tensor(a)[]`` return too), plus the writes
#   torch makes without declaring them (``_UNDECLARED_WRITES``: batch norm's running
#   statistics when training), and the flags of its definition, if the project defines it
#   (the collectives); a view recorded for a PopXL non-in-place op (``TorchCall.new_tensors``)
#   lists its outputs as ``views``, not ``aliases`` (Note [views of new tensors] in
#   ir/views.py);
# * a call or repeat: the callee inputs it writes (``mutated_inputs``) that the call site lets
#   it write (``CallSite.modified``), in the callee's input numbering, which is the op's;
# * a runtime op: its definition (Note [op definitions] in ir/opdef.py).


def _leaves(x):
    if isinstance(x, list | tuple):
        for y in x:
            yield from _leaves(y)
    else:
        yield x


# Ops that update inputs in place without saying so in their schema: native_batch_norm
# writes the running statistics (arguments 3 and 4) when training.
_UNDECLARED_WRITES = {
    _aten.native_batch_norm.default: lambda args: (3, 4) if len(args) > 5 and args[5] else (),
}

_NONE = Effects()


def _torch_effects(op: Op) -> Effects:
    target = op.attrs.target
    opdef = definition_of(target)
    flags = opdef.effects if opdef is not None else Effect.NONE
    schema = getattr(target, "_schema", None)
    if schema is None:
        return Effects(flags=flags) if flags else _NONE
    args, kwargs = op.attrs.args, op.attrs.kwargs
    written: set[int] = set()
    sets: dict[str, int] = {}
    wildcard: int | None = None  # the input a list of views aliases (``Tensor(a -> *)``)
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for s in _leaves(value):
            if isinstance(s, Slot):
                if info.is_write:
                    written.add(s.index)
                for a in info.before_set:
                    sets.setdefault(a, s.index)
                if "*" in info.after_set and wildcard is None:
                    wildcard = s.index
    undeclared: set[int] = set()
    hidden = _UNDECLARED_WRITES.get(target)
    if hidden is not None:
        for i in hidden(args):
            if i < len(args) and isinstance(args[i], Slot) and args[i].index not in written:
                undeclared.add(args[i].index)
    aliased: dict[int, int] = {}  # schema return -> the input it aliases
    for k, ret in enumerate(schema.returns):
        info = ret.alias_info
        if info is None:
            continue
        for a in info.before_set:
            if a in sets:
                aliased[k] = sets[a]
        # ``Tensor(a)[]`` (split, unbind): torch's binding shows no alias set for a list's
        # elements; they are views of the argument annotated ``Tensor(a -> *)``.
        if not info.before_set and wildcard is not None:
            aliased[k] = wildcard
    aliases: dict[int, int] = {}
    if aliased:  # per output: a single return holds them all, else path[0] is the return
        single = len(schema.returns) == 1
        for j, path in enumerate(op.attrs.out_paths):
            k = 0 if single or not path else path[0]
            if k in aliased:
                aliases[j] = aliased[k]
    if not (written or undeclared or aliases or flags):
        return _NONE
    if op.attrs.new_tensors and not written:  # Note [views of new tensors] in ir/views.py
        return Effects(flags=flags, views=MappingProxyType(aliases))
    return Effects(frozenset(written | undeclared), MappingProxyType(aliases),
                   frozenset(undeclared), flags)  # fmt: skip


def effects(op: Op) -> Effects:
    """What ``op`` does besides computing its outputs (Note [one effects query])."""
    kind = op.kind
    if isinstance(kind, OpDef):
        return kind.effects_of(op)
    if kind == OpKind.TORCH:
        return _torch_effects(op)
    written = mutated_inputs(op.attrs.graph) & op.attrs.modified
    return Effects(written) if written else _NONE


# ---- mutation analysis --------------------------------------------------------------------


class _Mutations(Interpreter["int | None"]):
    """Values are the graph-input index a tensor is (a view of), or None; collects the input
    indices written in place. A callee is summarised by its own ``mutated_inputs``."""

    def __init__(self) -> None:
        self.mutated: set[int] = set()

    def op(self, op: Op, ins: list[int | None], env: Env) -> list[int | None]:
        # An output already bound (an in-place op returning its input) keeps its root.
        outs = [env.get(t.id) for t in op.outputs]
        e = effects(op)
        for i in e.writes:
            root = ins[i]
            if root is not None:
                self.mutated.add(root)
        for k, i in e.aliases.items():
            if k < len(outs) and outs[k] is None:
                outs[k] = ins[i]
        return outs

    def constant(self, t: Constant) -> None:
        return None

    def unbound(self, t: Tensor) -> None:
        return None

    def call(self, op: Op, ins: list[int | None]) -> list[int | None]:
        for i in effects(op).writes:
            root = ins[i]
            if root is not None:
                self.mutated.add(root)
        return [None] * len(op.outputs)

    repeat = call


# Keyed by the graph object itself (weakly), so a freed graph's id can never hand its entry
# to a new graph; the version invalidates the entry when the graph changes.
_mutated_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mutated_inputs(graph: Graph) -> frozenset[int]:
    """Indices of the graph's inputs that its ops (or its callees) may modify in place."""
    cached = _mutated_cache.get(graph)
    if cached is not None and cached[0] == graph._version:
        return cached[1]
    walk = _Mutations()
    walk.run(graph._ops, {t.id: i for i, t in enumerate(graph._inputs)})
    result = frozenset(walk.mutated)
    _mutated_cache[graph] = (graph._version, result)
    return result
