"""The fast executor's compiler: graphs lowered to straight-line Python for all replicas.

Three phases, one direction:

1. **Flatten.** The main program's ops are walked with calls inlined (each call site gets its
   own names) and ``repeat`` kept as a loop whose body is flattened the same way. Pass-by-value
   becomes explicit clones (Note [pass by value]).
2. **Analyse.** Which values are *batched* over replicas (Note [replica-invariant values]),
   and rewrites that fold replicas into one op (Note [replica-sum accumulators], Note [fold
   replicas into the matmul]).
3. **Emit.** One Python function per fragment. When every op of the fragment has an explicit
   batching rule (``runtime/explicit.py``) it works on the stacked ``[R, ...]`` values
   directly; otherwise it runs under ``torch.func.vmap`` over the replica dimension. Either
   way R replicas cost one pass of Python.

Note [pass by value]
    A called graph must not change its caller's tensors unless the input is by-reference or
    marked modified. Ops run in place on the real values, so the call site clones exactly the
    inputs the callee may modify (``mutated_inputs``) and nothing else.

Note [replica-invariant values]
    Inside ``vmap`` a tensor is either batched (one value per replica) or unbatched (the same
    value on every replica, stored once). A variable with a single replica group that is only
    ever updated with replica-invariant values (for example all-reduced gradients) is passed
    unbatched: the forward matmul then runs as one large matmul over all replicas' rows and
    the optimizer update runs once instead of R times. A full-group all-reduce/all-gather
    returns an unbatched value. The analysis finds the largest such set of variables; an
    in-place write of a batched value into an unbatched one makes the target batched (a
    variable leaves the invariant set; an intermediate is materialised per replica).

Note [replica-sum accumulators]
    A gradient accumulator that is only ever added to, zeroed or scaled, and read only by a
    full-group add/mean all-reduce or reduce-scatter, never needs its per-replica values:
    every use depends on their sum. Such variables (marked ``_replica_sum`` by their builder,
    ``popxl.compile``) are stored as that sum, unbatched: ``acc += x_r`` becomes
    ``acc += sum_r x_r`` (one matmul for a weight gradient, Note [fold replicas into the
    matmul]) and the final reduction divides or slices it, counting the traffic the real
    collective would move. Any other use keeps the per-replica layout.

Note [fold replicas into the matmul]
    ``all_reduce(mm(a_r, b_r))`` over all replicas equals one matmul with the replicas folded
    into the contraction dimension. When a matmul's only use (through view ops) is a
    full-group add/mean all-reduce, the pair becomes ``torch_popxl::mm_all_reduce``: the same
    maths at single-program cost, without materialising R partial products.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .. import opdefs  # also registers torch.ops.torch_popxl
from ..ir.graph import Graph, Op, OpKind, Slot
from ..ir.tensor import Constant, Tensor
from ..opdefs.registry import Effect, OpDef
from . import explicit as _explicit

__all__ = ["Program", "mutated_inputs", "lower_fragment", "Fragment"]

_SIMPLE = (int, bool, str, type(None))
_aten = torch.ops.aten


# ---- pass-by-value analysis (per graph) ---------------------------------------------------


def _leaves(x):
    if isinstance(x, list | tuple):
        for y in x:
            yield from _leaves(y)
    else:
        yield x


def _schema_effects(op: Op):
    """(written input indices, {output index: aliased input index}) of a torch op."""
    schema = getattr(op.attrs.target, "_schema", None)
    written: set[int] = set()
    aliases: dict[int, int] = {}
    if schema is None:
        return written, aliases
    args, kwargs = op.attrs.args, op.attrs.kwargs
    sets: dict[str, int] = {}
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
    hidden = _HIDDEN_WRITES.get(op.attrs.target)
    if hidden is not None:
        for i in hidden(args):
            if i < len(args) and isinstance(args[i], Slot):
                written.add(args[i].index)
    for k, ret in enumerate(schema.returns):
        info = ret.alias_info
        if info is not None:
            for a in info.before_set:
                if a in sets:
                    aliases[k] = sets[a]
    return written, aliases


# Ops that update inputs in place without saying so in their schema: native_batch_norm
# writes the running statistics (arguments 3 and 4) when training.
_HIDDEN_WRITES = {
    _aten.native_batch_norm.default: lambda args: (3, 4) if len(args) > 5 and args[5] else (),
}

# Keyed by the graph object itself (weakly), so a freed graph's id can never hand its entry
# to a new graph; the version invalidates the entry when the graph changes.
_mutated_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mutated_inputs(graph: Graph) -> frozenset[int]:
    """Indices of the graph's inputs that its ops may modify in place."""
    cached = _mutated_cache.get(graph)
    if cached is not None and cached[0] == graph._version:
        return cached[1]
    root: dict[str, int] = {t.id: i for i, t in enumerate(graph._inputs)}
    mutated: set[int] = set()
    for op in graph._ops:
        if op.kind == OpKind.TORCH:
            written, aliases = _schema_effects(op)
            for i in written:
                if op.inputs[i].id in root:
                    mutated.add(root[op.inputs[i].id])
            for k, i in aliases.items():
                if op.inputs[i].id in root and k < len(op.outputs):
                    root.setdefault(op.outputs[k].id, root[op.inputs[i].id])
        elif op.kind == OpKind.REMOTE_LOAD_INPLACE:
            if op.inputs[0].id in root:
                mutated.add(root[op.inputs[0].id])
        elif op.kind in (OpKind.CALL, OpKind.REPEAT):
            for i in mutated_inputs(op.attrs.graph) & set(op.attrs.modified):
                if op.inputs[i].id in root:
                    mutated.add(root[op.inputs[i].id])
    result = frozenset(mutated)
    _mutated_cache[graph] = (graph._version, result)
    return result


# ---- phase 1: flatten ---------------------------------------------------------------------


@dataclass(eq=False)
class FlatOp:
    """An op of the flattened program; ``ins``/``outs`` are value names."""

    kind: str  # torch | clone | host_load | host_store | remote_load | remote_load_ |
    # remote_store | print | loop | mm_all_reduce
    op: Op | None
    ins: list[str]
    outs: list[str]
    body: list[FlatOp] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> Op:
        """The IR op this flat op lowers; only the flattener's own copies and aliases and the
        fused kinds have none."""
        if self.op is None:
            raise AssertionError(f"A {self.kind!r} flat op has no source op.")
        return self.op


class _Flattener:
    def __init__(self, program: Program):
        self.program = program

    def flatten(self, ops, scope: dict[str, str]) -> list[FlatOp]:
        out: list[FlatOp] = []
        for op in ops:
            ins = [self.name_of(t, scope) for t in op.inputs]
            if op.kind == OpKind.CALL:
                self._inline_call(op, ins, scope, out)
            elif op.kind == OpKind.REPEAT:
                self._loop(op, ins, scope, out)
            elif op.kind == OpKind.PRINT:
                scope[op.outputs[0].id] = ins[0]
                out.append(FlatOp("print", op, ins, []))
            elif (
                op.kind == OpKind.TORCH
                and op.attrs.target in _IDENTITY_VIEWS
                and op.outputs[0].id not in scope
            ):
                # detach/alias only matter to autograd: at run time they are the same tensor
                # (a view of the same storage), so the name is simply shared.
                scope[op.outputs[0].id] = ins[0]
            else:
                outs = [self.define(t, scope) for t in op.outputs]
                out.append(FlatOp(op.kind, op, ins, outs))
        return out

    def name_of(self, t: Tensor, scope: dict[str, str]) -> str:
        if t.id in scope:
            return scope[t.id]
        if isinstance(t, Constant):
            return self.program.constant(t)
        raise AssertionError(f"tensor {t.id} is used before it is defined")

    def define(self, t: Tensor, scope: dict[str, str]) -> str:
        if t.id in scope:  # in-place ops return their (already named) input
            return scope[t.id]
        name = self.program.fresh()
        scope[t.id] = name
        return name

    def _by_value(self, graph: Graph, op: Op, ins: list[str], out: list[FlatOp]) -> list[str]:
        clone = mutated_inputs(graph) - set(op.attrs.modified)
        result = []
        for i, name in enumerate(ins):
            if i in clone:
                new = self.program.fresh()
                out.append(FlatOp("clone", None, [name], [new]))
                name = new
            result.append(name)
        return result

    def _inline_call(self, op: Op, ins: list[str], scope, out: list[FlatOp]) -> None:
        graph: Graph = op.attrs.graph
        args = self._by_value(graph, op, ins, out)
        inner = {t.id: n for t, n in zip(graph._inputs, args, strict=True)}
        out.extend(self.flatten(graph._ops, inner))
        input_ids = {t.id for t in graph._inputs}
        for parent_t, graph_t in zip(op.outputs, graph._outputs, strict=True):
            name = self.name_of(graph_t, inner)
            if graph_t.id in input_ids:  # never hand the caller an alias of its own input
                new = self.program.fresh()
                out.append(FlatOp("clone", None, [name], [new]))
                name = new
            scope[parent_t.id] = name

    def _loop(self, op: Op, ins: list[str], scope, out: list[FlatOp]) -> None:
        graph: Graph = op.attrs.graph
        args = self._by_value(graph, op, ins, out)
        carried = [self.program.fresh() for _ in args]
        inner = {t.id: n for t, n in zip(graph._inputs, carried, strict=True)}
        body = self.flatten(graph._ops, inner)
        results = [self.name_of(t, inner) for t in graph._outputs]
        out.append(FlatOp("loop", op, args, carried, body,
                          {"results": results, "count": op.attrs.repeat_count}))  # fmt: skip
        for i, parent_t in enumerate(op.outputs):
            scope[parent_t.id] = carried[i]


# ---- phase 2: analysis --------------------------------------------------------------------

_IDENTITY_VIEWS = frozenset({_aten.detach.default, _aten.alias.default})
_VIEW_OPS = {_aten.t.default, _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}


# Which ops draw random numbers (defined next to the explicit-batching rules, which need it).
_is_random = _explicit.is_random


def _collective(op: Op | None) -> OpDef | None:
    """The definition of a captured collective; what the compiler needs to know about one
    (output batching, sum reads, pass-through, matmul fusion) is asked of it."""
    opdef = opdefs.lookup(op) if op is not None and op.kind == OpKind.TORCH else None
    return opdef if opdef is not None and Effect.COLLECTIVE in opdef.effects else None


class _Conflict(Exception):
    """An in-place write of a batched value into an unbatched one (analysis must restart)."""


class _Analysis:
    """Computes ``batched[name]`` for every value; collects names that must be batched."""

    def __init__(self, program: Program, R: int):
        self.program = program
        self.R = R
        self.batched: dict[str, bool] = {}
        self.root: dict[str, str] = {}

    def run(self, flat: list[FlatOp], params: dict[str, bool]) -> None:
        self.batched = dict(params)
        self.root = {n: n for n in params}
        self.sum_names = {
            n for n in params if self.program.var_names.get(n) in self.program.sum_vars
        }
        self.written: set[str] = set()  # roots of every value updated in place
        self._block(flat)

    def b(self, name: str) -> bool:
        return self.batched.get(name, False)  # constants are unbatched

    def _set(self, name: str, value: bool) -> None:
        self.batched[name] = value or name in self.program.force_batched

    def _write(self, target: str, batched_source: bool) -> None:
        self.written.add(self.root.get(target, target))
        if batched_source and not self.b(target):
            root = self.root.get(target, target)
            if root in self.program.var_names:
                self.program.uniform_vars.discard(self.program.var_names[root])
            elif root in self.program.force_batched or root not in self.batched:
                raise RuntimeError(
                    f"The fast executor cannot write a per-replica value into {root}, a value "
                    "shared by all replicas (a constant). Run with executor='reference' and "
                    "report this program."
                )
            else:
                self.program.force_batched.add(root)
            raise _Conflict(root)

    def _block(self, flat: list[FlatOp]) -> None:
        for f in flat:
            getattr(self, f"_{f.kind}")(f)

    def _sum_roots(self, f: FlatOp) -> list[int]:
        return [i for i, n in enumerate(f.ins) if self.root.get(n, n) in self.sum_names]

    def _disqualify(self, name: str) -> None:
        root = self.root.get(name, name)
        self.program.sum_vars.discard(self.program.var_names.get(root, root))
        raise _Conflict(root)

    def _sum_use(self, f: FlatOp, uses: list[int], written: set[int]) -> None:
        """Note [replica-sum accumulators]: accept the allowed uses, else fall back."""
        target = f.source.attrs.target
        args = f.source.attrs.args
        first = args[0].index if args and isinstance(args[0], Slot) else None
        if uses == [first] and written == {first}:
            if target is _aten.add_.Tensor and isinstance(args[1], Slot):
                f.extra["sum_add"] = args[1].index
                return
            if target in (_aten.zero_.default, _aten.mul_.Scalar):
                return
            if (
                target is _aten.mul_.Tensor
                and isinstance(args[1], Slot)
                and not self.b(f.ins[args[1].index])
            ):
                return
        opdef = _collective(f.source) if uses == [first] and not written else None
        finish = opdef.rule("sum_read")(f.source, self.R) if opdef is not None else None
        if finish is not None:
            f.extra["sum_read"] = finish
            return
        self._disqualify(f.ins[uses[0]])

    def _torch(self, f: FlatOp) -> None:
        target = f.source.attrs.target
        f.extra.pop("sum_add", None)
        f.extra.pop("sum_read", None)
        uses = self._sum_roots(f)
        if uses:
            self._sum_use(f, uses, _schema_effects(f.source)[0])
            if "sum_add" in f.extra:  # the write is of a sum: replica-invariant by design
                return
        ins = [self.b(n) for n in f.ins]
        any_b = any(ins)
        collective = _collective(f.source)
        if collective is not None:
            # The rule validates the grouping first: (G=R, stride=-1) is an error, not the
            # whole replica set.
            out_b = collective.rule("output_batched")(f.source, self.R, any_b)
        else:
            out_b = any_b or _is_random(target)
        written, aliases = _schema_effects(f.source)
        # An in-place random op (bernoulli_, uniform_, ...) draws per replica: its target
        # must be batched, like a write of a per-replica value.
        write_b = any_b or (self.R > 1 and _is_random(target))
        for i in written:
            self._write(f.ins[i], write_b)
        for k, out in enumerate(f.outs):
            if k in aliases:
                src = f.ins[aliases[k]]
                self.root.setdefault(out, self.root.get(src, src))
                self._set(out, self.b(src))
            elif out not in self.batched:
                self._set(out, out_b)

    def _mm_all_reduce(self, f: FlatOp) -> None:
        self._set(f.outs[0], False)

    def _alias(self, f: FlatOp) -> None:
        self._set(f.outs[0], self.b(f.ins[0]))

    def _clone(self, f: FlatOp) -> None:
        if self.root.get(f.ins[0], f.ins[0]) in self.sum_names:
            self._disqualify(f.ins[0])
        self._set(f.outs[0], self.b(f.ins[0]))

    def _host_load(self, f: FlatOp) -> None:
        self._set(f.outs[0], self.R > 1)

    def _remote_load(self, f: FlatOp) -> None:
        self._set(f.outs[0], self.R > 1)

    def _remote_store(self, f: FlatOp) -> None:
        self._host_store(f)

    def _remote_load_(self, f: FlatOp) -> None:
        self._write(f.ins[0], self.R > 1)

    def _host_store(self, f: FlatOp) -> None:
        for n in f.ins:
            if self.root.get(n, n) in self.sum_names:
                self._disqualify(n)

    _print = _host_store

    def _loop(self, f: FlatOp) -> None:
        for carried, arg in zip(f.outs, f.ins, strict=True):
            self._set(carried, self.b(arg))
            self.root[carried] = self.root.get(arg, arg)  # a by-ref carry aliases its source
        self._block(f.body)
        results = f.extra["results"]  # loop outputs past the carried ones are not fed back
        for carried, result in zip(f.outs[: len(results)], results, strict=True):
            if self.b(result) and not self.b(carried):
                self.program.force_batched.add(carried)
                raise _Conflict(carried)


def _fold_matmuls(flat: list[FlatOp], analysis: _Analysis, R: int) -> list[FlatOp]:
    """Note [fold replicas into the matmul]."""
    uses: dict[str, int] = {}

    def count(ops):
        for f in ops:
            for n in f.ins:
                uses[n] = uses.get(n, 0) + 1
            if f.kind == "loop":
                count(f.body)
                for n in f.extra["results"]:
                    uses[n] = uses.get(n, 0) + 1

    count(flat)
    return _fold_block(flat, analysis, R, uses)


def _matmul_behind(
    src: str, producer: dict[str, FlatOp], uses: dict[str, int], analysis: _Analysis
):
    """(mm op, view ops from src back to it) when ``src`` is only-used views of a batched mm."""
    views: list[FlatOp] = []
    p = producer.get(src)
    while (
        p is not None
        and p.kind == OpKind.TORCH
        and p.source.attrs.target in _VIEW_OPS
        and uses.get(src) == 1
    ):
        views.append(p)
        src = p.ins[0]
        p = producer.get(src)
    if (p is not None and p.kind == OpKind.TORCH and p.source.attrs.target is _aten.mm.default
            and uses.get(src) == 1 and all(analysis.b(n) for n in p.ins)):  # fmt: skip
        return p, views
    return None, views


def _fold_block(
    flat: list[FlatOp], analysis: _Analysis, R: int, uses: dict[str, int]
) -> list[FlatOp]:
    producer: dict[str, FlatOp] = {}
    for f in flat:
        for n in f.outs:
            producer[n] = f
    removed: set[int] = set()
    result: list[FlatOp] = []

    def fuse(kind: str, mm: FlatOp, views: list[FlatOp], name: str, extra: dict) -> None:
        """Replace ``mm`` (and the views after it) by ``kind``; the views are re-applied."""
        removed.add(id(mm))
        removed.update(id(v) for v in views)
        prev = analysis.program.fresh()
        result.append(FlatOp(kind, None, list(mm.ins), [prev], extra=extra))
        for v in reversed(views):  # forward order
            out = analysis.program.fresh()
            result.append(FlatOp("torch", v.op, [prev], [out]))
            prev = out
        result.append(FlatOp("alias", None, [prev], [name]))

    for f in flat:
        if f.kind == "loop":
            f.body = _fold_block(f.body, analysis, R, uses)
        if f.kind == "torch" and "sum_add" in f.extra:
            # Note [replica-sum accumulators]: acc += sum_r (a_r @ b_r) as one matmul.
            src = f.ins[f.extra["sum_add"]]
            mm, views = _matmul_behind(src, producer, uses, analysis)
            if mm is not None:
                fuse("mm_replica_sum", mm, views, src, {})
                f.extra["presummed"] = True
        collective = _collective(f.source) if f.kind == "torch" else None
        if collective is not None:
            # Note [fold replicas into the matmul].
            fusion = collective.rule("matmul_fusion")(f.source, R)
            if fusion is not None:
                mm, views = _matmul_behind(f.ins[0], producer, uses, analysis)
                if mm is not None:
                    fuse("mm_all_reduce", mm, views, f.outs[0], fusion)
                    continue
        result.append(f)
    return [f for f in result if id(f) not in removed]


# ---- phase 3: emit ------------------------------------------------------------------------


def _batched_view(x: torch.Tensor, shape) -> torch.Tensor:
    """``aten.view`` that tolerates vmap's physical layout.

    Under vmap a per-replica view can fail where the single-replica program's view succeeds,
    because the batched tensor's memory layout differs (for example after a batching
    fallback). A copy is then the only option; when the view works it is used, so aliasing
    is preserved wherever the program could observe it.
    """
    try:
        return _aten.view.default(x, shape)
    except RuntimeError:
        return _aten.reshape.default(x, shape)


def _stacked_view(x: torch.Tensor, shape, R: int) -> torch.Tensor:
    """A per-replica view on stacked ``[R, ...]`` storage (a copy only if a view is impossible)."""
    try:
        return x.view((R, *shape))
    except RuntimeError:
        return x.reshape((R, *shape))


def _mm_fold(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_r a[r] @ b[r]`` as one matmul with the replicas folded into the contraction."""
    R, M, K = a.shape
    return a.permute(1, 0, 2).reshape(M, R * K) @ b.reshape(R * K, b.shape[2])


class Program:
    """Generated code for one Ir on one device: globals, constants and fragment functions."""

    def __init__(self, device: torch.device, num_replicas: int):
        self.device = device
        self.R = num_replicas
        self.globals: dict[str, Any] = {
            "DEVICE": device,
            "REMOTE_LOAD": torch.ops.torch_popxl.remote_load,
            "REMOTE_STORE": torch.ops.torch_popxl.remote_store_,
            "MM_ALL_REDUCE": torch.ops.torch_popxl.mm_all_reduce,
            "VIEW": _batched_view,
            "REPLICA_SUM": torch.ops.torch_popxl.replica_sum,
            "MM_REPLICA_SUM": torch.ops.torch_popxl.mm_replica_sum,
            "MM_ALL_REDUCE_STACKED": torch.ops.torch_popxl.mm_all_reduce_stacked,
            "MM_FOLD": _mm_fold,
            "STACKED_VIEW": _stacked_view,
            "torch": torch,
        }
        self._counter = itertools.count()
        self._literals: dict[int, str] = {}
        self._keepalive: list[Any] = []
        self._constants: dict[int, str] = {}
        self.sources: dict[str, str] = {}
        self.uniform_vars: set[str] = set()
        self.sum_vars: set[str] = set()
        self.explicit_ok = False  # set by the executor (single process, R > 1)
        self.var_names: dict[str, str] = {}
        self.force_batched: set[str] = set()

    def fresh(self) -> str:
        return f"v{next(self._counter)}"

    def literal(self, x: Any) -> str:
        key = id(x)
        if key not in self._literals:
            name = f"k{len(self._literals)}"
            self._literals[key] = name
            self._keepalive.append(x)
            self.globals[name] = x
        return self._literals[key]

    def constant(self, t: Constant) -> str:
        key = id(t)
        if key not in self._constants:
            name = f"c{len(self._constants)}"
            self._constants[key] = name
            self._keepalive.append(t)
            self.globals[name] = t._data.to(self.device)
        return self._constants[key]


class _Emitter:
    def __init__(
        self, program: Program, analysis: _Analysis, params: list[str], explicit: bool = False
    ):
        self.p = program
        self.a = analysis
        self.explicit = explicit  # Note [explicit batching]: stacked tensors, no vmap
        self.lines: list[str] = []
        self.defined: set[str] = set(params)

    def literal(self, x: Any, f: FlatOp) -> str:
        if isinstance(x, Slot):
            return f.ins[x.index]
        if isinstance(x, list):
            return "[" + ", ".join(self.literal(y, f) for y in x) + "]"
        if isinstance(x, tuple):
            return "(" + "".join(self.literal(y, f) + ", " for y in x) + ")"
        if isinstance(x, torch.device):
            return "DEVICE"
        if isinstance(x, float) and math.isfinite(x):
            return repr(x)
        if isinstance(x, _SIMPLE):
            return repr(x)
        return self.p.literal(x)

    def block(self, flat: list[FlatOp], indent: str) -> None:
        for f in flat:
            getattr(self, f"_{f.kind}")(f, indent)
            for n in f.outs:
                # Materialise a forced value once, where it is defined (not after in-place
                # ops that return it again, which would break aliasing).
                if n in self.p.force_batched and f.kind != "loop" and n not in self.defined:
                    self.lines.append(f"{indent}{n} = rt.batch({n})")
                self.defined.add(n)

    def _torch(self, f: FlatOp, ind: str) -> None:
        if self.explicit:
            _explicit.emit_torch(self, f, ind)
        else:
            self._torch_plain(f, ind)

    def _torch_plain(self, f: FlatOp, ind: str) -> None:
        target = f.source.attrs.target
        is_aten = isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
        if target is _aten.view.default and self.p.R > 1:
            fn = "VIEW"
        else:
            fn = self.p.literal(target._op if is_aten else target)
        if "sum_read" in f.extra:
            self._sum_read(f, ind)
            return
        if self._passthrough(f, ind):
            return
        args = [self.literal(x, f) for x in f.source.attrs.args]
        if "sum_add" in f.extra:
            x = f.ins[f.extra["sum_add"]]
            if f.extra.get("presummed"):
                summed = x
            else:
                summed = f"REPLICA_SUM({x})" if self.a.b(x) else f"({x} * {self.p.R})"
            args = [summed if a == x else a for a in args]
        if (not is_aten and getattr(target, "namespace", "") == "torch_popxl" and self.p.R > 1
                and f.source.attrs.argument("group_size") > 1 and not self.a.b(f.ins[0])):  # fmt: skip
            # A collective needs its input batched to reach its vmap rule (it is the same
            # value on every replica, so this is a broadcast, not a copy per replica of work).
            args[0] = f"rt.batch({args[0]})"
        args += [f"{k}={self.literal(v, f)}" for k, v in f.source.attrs.kwargs.items()]
        call = f"{fn}({', '.join(args)})"
        paths = f.source.attrs.out_paths
        if not f.outs:
            self.lines.append(f"{ind}{call}")
        elif len(paths) == 1 and paths[0] == ():
            self.lines.append(f"{ind}{f.outs[0]} = {call}")
        else:
            self.lines.append(f"{ind}_r = {call}")
            for out, path in zip(f.outs, paths, strict=True):
                self.lines.append(f"{ind}{out} = _r{''.join(f'[{i}]' for i in path)}")

    def _mm_replica_sum(self, f: FlatOp, ind: str) -> None:
        fn = "MM_FOLD" if self.explicit else "MM_REPLICA_SUM"
        self.lines.append(f"{ind}{f.outs[0]} = {fn}({f.ins[0]}, {f.ins[1]})")

    def _passthrough(self, f: FlatOp, ind: str) -> bool:
        """A collective whose definition says it returns its input unchanged (``passthrough``:
        an add/mean/min/max all-reduce over groups of one replica): pass the value through (no
        copy) when neither side is updated in place later."""
        collective = _collective(f.source)
        if collective is None or not collective.rule("passthrough")(f.source):
            return False
        src, out = f.ins[0], f.outs[0]
        if (
            self.a.root.get(src, src) in self.a.written
            or self.a.root.get(out, out) in self.a.written
        ):
            return False
        self.lines.append(f"{ind}{out} = {src}")
        self.lines.append(
            f"{ind}rt.count_collective_call()"
        )  # the runtime still sees one collective
        return True

    def _sum_read(self, f: FlatOp, ind: str) -> None:
        """The full-group reduction of a replica-sum accumulator (its value is the sum)."""
        finish = self.p.literal(f.extra["sum_read"])
        self.lines.append(f"{ind}{f.outs[0]} = rt.sum_read({finish}, {f.ins[0]})")

    def _mm_all_reduce(self, f: FlatOp, ind: str) -> None:
        a, b = f.ins
        fn = "MM_ALL_REDUCE_STACKED" if self.explicit else "MM_ALL_REDUCE"
        self.lines.append(f"{ind}{f.outs[0]} = {fn}({a}, {b}, {f.extra['op']!r})")

    def _clone(self, f: FlatOp, ind: str) -> None:
        self.lines.append(f"{ind}{f.outs[0]} = {f.ins[0]}.clone()")

    def _alias(self, f: FlatOp, ind: str) -> None:
        self.lines.append(f"{ind}{f.outs[0]} = {f.ins[0]}")

    def _host_load(self, f: FlatOp, ind: str) -> None:
        self.lines.append(f"{ind}{f.outs[0]} = rt.host_load({f.source.attrs.stream._index})")

    def _host_store(self, f: FlatOp, ind: str) -> None:
        # A stored value needs a snapshot only if something may update it in place later.
        name = f.ins[0]
        snapshot = self.a.root.get(name, name) in self.a.written
        if self.explicit and not self.a.b(name):  # one row per replica on the host side
            name, snapshot = f"{name}.expand({self.p.R}, *{name}.shape)", True
        self.lines.append(f"{ind}rt.host_store({f.source.attrs.stream._index}, {name}, {snapshot})")

    def _remote_load(self, f: FlatOp, ind: str) -> None:
        bid = f.source.attrs.buffer.remote_buffer_id
        self.lines.append(f"{ind}{f.outs[0]} = REMOTE_LOAD(rt.buffers[{bid}], {f.ins[0]}, {bid})")

    def _remote_load_(self, f: FlatOp, ind: str) -> None:
        bid = f.source.attrs.buffer.remote_buffer_id
        self.lines.append(
            f"{ind}{f.ins[0]}.copy_(REMOTE_LOAD(rt.buffers[{bid}], {f.ins[1]}, {bid}))"
        )

    def _remote_store(self, f: FlatOp, ind: str) -> None:
        bid = f.source.attrs.buffer.remote_buffer_id
        self.lines.append(f"{ind}REMOTE_STORE(rt.buffers[{bid}], {f.ins[1]}, {f.ins[0]}, {bid})")

    def _print(self, f: FlatOp, ind: str) -> None:
        self.lines.append(f"{ind}rt.print({self.p.literal(f.source.attrs)}, {f.ins[0]})")

    def _loop(self, f: FlatOp, ind: str) -> None:
        for carried, arg in zip(f.outs, f.ins, strict=True):
            self.defined.add(carried)
            self.lines.append(f"{ind}{carried} = {arg}")
            if carried in self.p.force_batched:
                self.lines.append(f"{ind}{carried} = rt.batch({carried})")
        self.lines.append(f"{ind}for _ in range({f.extra['count']}):")
        self.block(f.body, ind + "    ")
        results = f.extra["results"]
        if results:
            lhs = "".join(c + ", " for c in f.outs[: len(results)])
            # A carried value forced batched must stay batched when the body's result is a
            # replica-invariant (unbatched) value, e.g. a full-group all-reduce.
            rhs = "".join(
                (f"rt.batch({r})" if self.a.b(c) and not self.a.b(r) else r) + ", "
                for c, r in zip(f.outs[: len(results)], results, strict=True)
            )
            self.lines.append(f"{ind}    {lhs}= {rhs}")


class Fragment(Protocol):
    """A compiled fragment, ``fn(rt, *params) -> outputs``, and what the executor needs to know
    about it (set as attributes on the generated function)."""

    out_batched: list[bool]  # per output: does it differ between replicas?
    explicit: bool  # Note [explicit batching]: runs on stacked tensors, not under vmap

    def __call__(self, rt: Any, *params: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


def lower_fragment(program: Program, graph: Graph, params: Sequence[Tensor], ops: list[Op],
                   outputs: Sequence[Tensor], name: str, batched_params: list[bool]) -> Fragment:  # fmt: skip
    """Compile ``ops`` of the main graph into ``fn(rt, *params) -> outputs``."""
    scope = {}
    param_names = []
    for t in params:
        n = program.fresh()
        scope[t.id] = n
        param_names.append(n)
    program.var_names.update({n: t.id for t, n in zip(params, param_names, strict=True)})
    flat = _Flattener(program).flatten(ops, scope)
    out_names = [scope[t.id] for t in outputs]
    analysis = _Analysis(program, program.R)
    while True:
        batched = {}
        for t, n, default in zip(params, param_names, batched_params, strict=True):
            batched[n] = default if t.id not in program.uniform_vars else False
        try:
            analysis.run(flat, batched)
            break
        except _Conflict:
            continue
    if program.R > 1:
        flat = _fold_matmuls(flat, analysis, program.R)
    explicit = (
        program.explicit_ok and program.R > 1 and _explicit.batchable(flat, analysis, program.R)
    )
    em = _Emitter(program, analysis, param_names, explicit)
    em.lines.append(f"def fn(rt{''.join(', ' + n for n in param_names)}):")
    em.block(flat, "    ")
    em.lines.append(f"    return ({''.join(n + ', ' for n in out_names)})")
    src = "\n".join(em.lines)
    program.sources[name] = src
    scope_: dict[str, Any] = {}
    exec(compile(src, f"<torch_popxl {graph.id} {name}>", "exec"), program.globals, scope_)
    fn = scope_["fn"]
    fn.out_batched = [analysis.b(n) for n in out_names]
    fn.explicit = explicit
    return fn
