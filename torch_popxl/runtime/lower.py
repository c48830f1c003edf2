"""The fast executor's compiler: graphs lowered to straight-line Python for all replicas.

Three phases, one direction:

1. **Flatten** (``_Flattener``, an ``ir.walk.Interpreter`` whose values are names). The
   fragment's ops are walked with calls inlined (each call site binds its own names) and a
   ``repeat`` kept as one ``loop`` flat op whose body is flattened once. Pass-by-value
   becomes explicit ``clone`` flat ops (Note [pass by value] in ``ir/walk.py``).
2. **Analyse** (``analyse`` -> a frozen ``Plan``). Which values are *batched* over replicas
   (Note [replica-invariant values]), which replica-sum accumulators keep their sum form and
   where (Note [replica-sum accumulators]). A fixed point over ``Assumptions`` that only
   narrow; the fragments of one program share variables, so ``FastExecutor`` repeats the
   three fragments until their assumptions agree. Then ``_fold_matmuls`` rewrites the flat
   ops (Note [fold replicas into the matmul]).
3. **Emit** (``_Emitter``, reading the plan). One Python function per fragment. When every
   op of the fragment has an explicit batching rule (``runtime/explicit.py``) it works on the
   stacked ``[R, ...]`` values directly; otherwise it runs under ``torch.func.vmap`` over the
   replica dimension (``fn.vmap_reason`` names the first op without a rule). Either way R
   replicas cost one pass of Python. On stacked values a gradient-accumulation loop whose
   iterations are independent runs as one pass (Note [fold the accumulation loop] in
   ``explicit.py``), and elementwise update chains run in place (Note [update in place]).
   Off-chip state round trips and RTS weight updates move no bytes the program cannot
   observe (Note [remote slot views], Note [aliasing collectives], Note [RTS updates in
   place]); unsharded off-chip state stays replica-invariant (Note [replica-invariant remote
   buffers]).

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
    every use depends on their sum. Such variables (``VariableInfo.replica_sum``, set by their
    builder, ``popxl.compile``) are stored as that sum, unbatched: ``acc += x_r`` becomes
    ``acc += sum_r x_r`` (one matmul for a weight gradient, Note [fold replicas into the
    matmul]) and the final reduction divides or slices it, counting the traffic the real
    collective would move. Any other use keeps the per-replica layout. An ``add`` reduction's
    result is the accumulator itself (a reduce-scatter's: its rows, when they divide it) where
    nothing can see the sharing (``_alias_sum_reads``): the result is no fragment output, goes
    to no host store or print, and neither it nor the accumulator is written until the
    result's last use (the optimizer update reads it, then the accumulator is zeroed). Else
    the reduction copies it.

Note [fold replicas into the matmul]
    ``all_reduce(mm(a_r, b_r))`` over all replicas equals one matmul with the replicas folded
    into the contraction dimension. When a matmul's only use (through view ops) is a
    full-group add/mean all-reduce, the pair becomes ``torch_popxl::mm_all_reduce``: the same
    maths at single-program cost, without materialising R partial products.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

import torch

from .. import opdefs  # also registers torch.ops.torch_popxl
from ..capture import view_or_copy
from ..ir.graph import Graph, Op, OpKind, Slot
from ..ir.tensor import Constant, Tensor
from ..ir.walk import Effects, Interpreter, effects
from ..opdefs.registry import Effect, OpDef, registered
from . import explicit as _explicit
from .gemm import ATEN_FORMS, gemm, gemm_out_
from .random import RANDOM_FORMS

__all__ = ["Assumptions", "Fragment", "Plan", "Program", "analyse", "lower_fragment"]

_SIMPLE = (int, bool, str, type(None))
_aten = torch.ops.aten


# ---- phase 1: flatten ---------------------------------------------------------------------


@dataclass(eq=False)
class FlatOp:
    """An op of the flattened program; ``ins``/``outs`` are value names. Hashed by identity:
    the analysis plan keys its per-op decisions by the flat op itself."""

    # torch | runtime (remote and host transfers, print: lowered by their definitions' rules,
    # Note [lowering rules] in opdefs/lowering.py) | clone | loop | alias | mm_all_reduce |
    # mm_replica_sum
    kind: str
    op: Op | None
    ins: list[str]
    outs: list[str]
    body: list[FlatOp] = field(default_factory=list)
    # ``loop``: the body's result names fed back into ``outs[:len(results)]``, and its count.
    results: list[str] = field(default_factory=list)
    count: int = 0
    # ``mm_all_reduce``: the all-reduce's operation ("add" or "mean").
    reduce_op: str = ""
    # A replica-sum ``add_`` whose addend is already the sum over replicas (a folded matmul,
    # Note [replica-sum accumulators]); set by ``_fold_matmuls``.
    presummed: bool = False
    # A stacked ``convolution_backward`` whose weight and bias gradients are returned summed
    # over the replicas (Note [convolution weight gradients summed over replicas]).
    rows_summed: bool = False

    @property
    def source(self) -> Op:
        """The IR op this flat op lowers; only the flattener's own copies and aliases and the
        fused kinds have none."""
        if self.op is None:
            raise AssertionError(f"A {self.kind!r} flat op has no source op.")
        return self.op


def _definition(f: FlatOp) -> OpDef:
    """A ``runtime`` flat op's definition (its IR op's kind)."""
    kind = f.source.kind
    assert isinstance(kind, OpDef), f"a runtime flat op of kind {kind!r} has no definition"
    return kind


def _reads(f: FlatOp) -> list[str]:
    """Every value name ``f`` reads, its body's reads and a loop's fed-back results included."""
    names = [*f.ins, *f.results]
    for g in f.body:
        names += _reads(g)
    return names


class _Flattener(Interpreter[str]):
    """The program's ops as flat ops over value names (``ir.walk.Interpreter`` over names).

    Calls are inlined by the walker (each call site binds its own names); a repeat becomes one
    ``loop`` flat op whose body is the callee flattened once over fresh carried names."""

    def __init__(self, program: Program):
        self.program = program
        self.out: list[FlatOp] = []  # the block being written (a loop body while in one)

    def flatten(self, ops, scope: dict[str, str]) -> list[FlatOp]:
        self.run(ops, scope)
        return self.out

    def op(self, op: Op, ins: list[str], env) -> list[str]:
        kind = op.kind
        copied = op in self.program.copied  # Note [views of new tensors] in ir/views.py
        if isinstance(kind, OpDef) and kind.has("passthrough") and kind.rule("passthrough")(op):
            # print: the value goes on unchanged; the flat op only reads it
            self.out.append(FlatOp("runtime", op, ins, []))
            return [self.copy(ins[0]) if copied else ins[0]]
        if copied:
            views = [self.program.fresh() for _ in op.outputs]
            self.out.append(FlatOp(str(kind), op, ins, views))
            return [self.copy(v) for v in views]
        if op.kind == OpKind.TORCH and _identity_view(op) and op.outputs[0].id not in env:
            # detach/alias only matter to autograd, and a view or slice that keeps its input's
            # shape is its input: at run time they are the same tensor (a view of the same
            # storage, same layout), so the name is simply shared.
            return [ins[0]]
        # In-place ops return their (already named) input.
        outs = [env[t.id] if t.id in env else self.program.fresh() for t in op.outputs]
        flat_kind = "runtime" if isinstance(kind, OpDef) else str(kind)
        self.out.append(FlatOp(flat_kind, op, ins, outs))
        return outs

    def constant(self, t: Constant) -> str:
        return self.program.constant(t)

    def copy(self, value: str) -> str:
        new = self.program.fresh()
        self.out.append(FlatOp("clone", None, [value], [new]))
        return new

    def repeat(self, op: Op, ins: list[str]) -> list[str]:
        graph: Graph = op.attrs.graph
        args = self.by_value(op, ins)
        carried = [self.program.fresh() for _ in args]
        outer, self.out = self.out, []
        env = self.run(graph._ops, self.bind(graph, carried))
        # Loop-carried results are not copied: the loop's assignment rebinds the carried
        # names, it never writes into a caller's value.
        results = [self.read(t, env) for t in graph._outputs]
        body, self.out = self.out, outer
        self.out.append(FlatOp("loop", op, args, carried, body, results=results,
                               count=op.attrs.repeat_count))  # fmt: skip
        return carried[: len(op.outputs)]


# ---- phase 2: analysis --------------------------------------------------------------------

_IDENTITY_VIEWS = frozenset({_aten.detach.default, _aten.alias.default})
_VIEW_OPS = {_aten.t.default, _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}


def _identity_view(op: Op) -> bool:
    """An op that returns its input itself: ``detach``/``alias``, or a reshaping view or a
    slice whose result has its input's shape (a full slice, a view to the same shape)."""
    target = op.attrs.target
    if len(op.outputs) != 1 or not op.inputs:
        return False
    if target in _IDENTITY_VIEWS:
        return True
    if target not in _SHAPE_KEEPING:
        return False
    x, out = op.inputs[0], op.outputs[0]
    return tuple(out.shape) == tuple(x.shape) and out.dtype == x.dtype


# views that, given the same shape back, are their input (not ``t``: it swaps the 2-d dims)
_SHAPE_KEEPING = frozenset({_aten.view.default, _aten.reshape.default,
                            _aten._unsafe_view.default, _aten.slice.Tensor})  # fmt: skip


# Which ops draw random numbers (defined next to the explicit-batching rules, which need it).
_draws_random = _explicit.draws_random


def _collective(op: Op | None) -> OpDef | None:
    """The definition of a captured collective; what the compiler needs to know about one
    (output batching, sum reads, pass-through, matmul fusion) is asked of it."""
    opdef = opdefs.lookup(op) if op is not None else None
    return opdef if opdef is not None and Effect.COLLECTIVE in opdef.effects else None


@dataclass(frozen=True)
class Assumptions:
    """What the analyses of a program's fragments must agree on (they share variables): the
    replica-invariant variables and the replica-sum variables (variable ids, Note
    [replica-invariant values], Note [replica-sum accumulators]), and the value names that must
    be batched although their sources are not. The analysis only ever narrows them."""

    uniform_vars: frozenset[str] = frozenset()
    sum_vars: frozenset[str] = frozenset()
    force_batched: frozenset[str] = frozenset()
    # Note [replica-invariant remote buffers]: remote buffer ids whose slots hold the same
    # value on every replica.
    uniform_buffers: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Plan:
    """The analysis of one fragment: frozen, read by the rewrites and the emitter.

    ``batched[name]``: whether the value differs between replicas (absent: a constant, never);
    ``root[name]``: the value a view or in-place result aliases; ``written``: roots updated in
    place; ``sum_adds[f]``: the input index of the per-replica addend of a replica-sum
    ``add_``; ``sum_reads[f]``: the collective stanza's ``sum_read`` finisher that completes a replica-sum reduction."""

    assumptions: Assumptions
    batched: Mapping[str, bool]
    root: Mapping[str, str]
    written: frozenset[str]
    sum_adds: Mapping[FlatOp, int]
    sum_reads: Mapping[FlatOp, Callable[..., Any]]

    @property
    def force_batched(self) -> frozenset[str]:
        return self.assumptions.force_batched

    def b(self, name: str) -> bool:
        return self.batched.get(name, False)  # constants are unbatched

    def root_of(self, name: str) -> str:
        return self.root.get(name, name)


def analyse(flat: list[FlatOp], params: Sequence[tuple[str, str, bool]],
            var_names: Mapping[str, str], R: int, assume: Assumptions,
            stacked: bool = False) -> Plan:  # fmt: skip
    """The plan of ``flat`` under the widest assumptions, narrowed from ``assume``, that hold.

    ``params`` are (value name, variable id, batched unless replica-invariant). Each pass
    either accepts every op under the current assumptions or returns them narrowed by the
    first conflict it meets (a batched value written into an unbatched one, a replica-sum
    variable used otherwise than allowed); the passes repeat until one accepts. Assumptions
    only narrow, so this ends."""
    while True:
        batched = {n: d and tid not in assume.uniform_vars for n, tid, d in params}
        walk = _Pass(R, var_names, assume, batched, stacked)
        narrowed = walk.block(flat)
        if narrowed is None:
            return Plan(assume, MappingProxyType(walk.batched), MappingProxyType(walk.root),
                        frozenset(walk.written), MappingProxyType(walk.sum_adds),
                        MappingProxyType(walk.sum_reads))  # fmt: skip
        assert narrowed != assume, "an analysis conflict must narrow the assumptions"
        assume = narrowed


# Note [one replica, stacked]
#     At R = 1 a gradient-accumulation loop run iteration by iteration does GA small matmuls per
#     layer where R = 4 does one (Note [fold the accumulation loop] in explicit.py): R = 1 was
#     twice as slow per sample. So a single-replica program is lowered first as the stacked
#     program of R replicas with R = 1: loaded data gets its one leading row, every full-group
#     variable is replica-invariant (stored once) and gradient accumulators hold the sum over the
#     one replica, which is the value itself, so any read of one is a read of the sum. The
#     executor keeps that lowering only when a loop folds (``Program.folded_loops``); otherwise
#     the program runs as the plain per-replica function, whose arithmetic is eager's, op for
#     op (the bit-exact R = 1 contract of popxl.compile). A folded loop sums the micro-batches'
#     gradients in one matmul, as eager does on the whole batch.


# A pass's answer for one flat op: None (accepted) or the narrowed assumptions to restart with.
_Verdict = Assumptions | None


class _Pass:
    """One pass of the analysis under fixed assumptions (see ``analyse``)."""

    def __init__(self, R: int, var_names: Mapping[str, str], assume: Assumptions,
                 params: dict[str, bool], stacked: bool = False):  # fmt: skip
        self.R = R
        # Note [one replica, stacked]: loaded data has one row per replica, even at R = 1
        self.rows = R > 1 or stacked
        self.var_names = var_names
        self.assume = assume
        self.batched: dict[str, bool] = dict(params)
        self.root: dict[str, str] = {n: n for n in params}
        self.sum_names = {n for n in params if var_names.get(n) in assume.sum_vars}
        self.written: set[str] = set()  # roots of every value updated in place
        self.sum_adds: dict[FlatOp, int] = {}
        self.sum_reads: dict[FlatOp, Callable[..., Any]] = {}

    def block(self, flat: list[FlatOp]) -> _Verdict:
        for f in flat:
            verdict = getattr(self, f"_{f.kind}")(f)
            if verdict is not None:
                return verdict
        return None

    def b(self, name: str) -> bool:
        return self.batched.get(name, False)  # constants are unbatched

    def _set(self, name: str, value: bool) -> None:
        self.batched[name] = value or name in self.assume.force_batched

    def _write(self, target: str, batched_source: bool) -> _Verdict:
        root = self.root.get(target, target)
        self.written.add(root)
        if not batched_source or self.b(target):
            return None
        if root in self.var_names:
            return replace(
                self.assume, uniform_vars=self.assume.uniform_vars - {self.var_names[root]}
            )
        if root in self.assume.force_batched or root not in self.batched:
            raise RuntimeError(
                f"The fast executor cannot write a per-replica value into {root}, a value "
                "shared by all replicas (a constant). Run with executor='reference' and "
                "report this program."
            )
        return replace(self.assume, force_batched=self.assume.force_batched | {root})

    def _sum_roots(self, f: FlatOp) -> list[int]:
        return [i for i, n in enumerate(f.ins) if self.root.get(n, n) in self.sum_names]

    def _disqualify(self, name: str) -> _Verdict:
        root = self.root.get(name, name)
        var = self.var_names.get(root, root)
        return replace(self.assume, sum_vars=self.assume.sum_vars - {var})

    def _sum_use(self, f: FlatOp, uses: list[int], written: AbstractSet[int]) -> _Verdict:
        """Note [replica-sum accumulators]: accept the allowed uses, else fall back."""
        target = f.source.attrs.target
        args = f.source.attrs.args
        first = args[0].index if args and isinstance(args[0], Slot) else None
        if uses == [first] and written == {first}:
            if target is _aten.add_.Tensor and isinstance(args[1], Slot):
                self.sum_adds[f] = args[1].index
                return None
            if target in (_aten.zero_.default, _aten.mul_.Scalar):
                return None
            if (
                target is _aten.mul_.Tensor
                and isinstance(args[1], Slot)
                and not self.b(f.ins[args[1].index])
            ):
                return None
        if self.R == 1 and not written & set(uses):
            return None  # Note [one replica, stacked]: the sum over one replica is the value
        opdef = _collective(f.source) if uses == [first] and not written else None
        finish = opdef.rule("sum_read")(f.source, self.R) if opdef is not None else None
        if finish is not None:
            self.sum_reads[f] = finish
            return None
        return self._disqualify(f.ins[uses[0]])

    def _torch(self, f: FlatOp) -> _Verdict:
        uses = self._sum_roots(f)
        if uses:
            verdict = self._sum_use(f, uses, effects(f.source).writes)
            if verdict is not None:
                return verdict
            if f in self.sum_adds:  # the write is of a sum: replica-invariant by design
                return None
        ins = [self.b(n) for n in f.ins]
        any_b = any(ins)
        collective = _collective(f.source)
        if collective is not None:
            # The rule validates the grouping first: (G=R, stride=-1) is an error, not the
            # whole replica set.
            out_b = collective.rule("output_batched")(f.source, self.R, any_b)
        else:
            out_b = any_b or _draws_random(f.source)
        e = effects(f.source)
        written, aliases = e.writes, e.shared  # storage: views of new tensors too
        # An in-place random op (bernoulli_, uniform_, ...) draws per replica: its target
        # must be batched, like a write of a per-replica value.
        write_b = any_b or (self.rows and _draws_random(f.source))
        # Note [per-element list ops] (explicit.py): a fused optimizer kernel writes each list
        # element from that element's inputs only.
        element_inputs = _explicit.element_inputs(f.source)
        for i in written:
            if element_inputs is not None:
                write_b = any(self.b(f.ins[j]) for j in element_inputs[i])
            verdict = self._write(f.ins[i], write_b)
            if verdict is not None:
                return verdict
        for k, out in enumerate(f.outs):
            if k in aliases:
                src = f.ins[aliases[k]]
                self.root.setdefault(out, self.root.get(src, src))
                self._set(out, self.b(src))
            elif out not in self.batched:
                self._set(out, out_b)
        return None

    def _mm_all_reduce(self, f: FlatOp) -> _Verdict:
        self._set(f.outs[0], False)
        return None

    def _alias(self, f: FlatOp) -> _Verdict:
        self._set(f.outs[0], self.b(f.ins[0]))
        return None

    def _clone(self, f: FlatOp) -> _Verdict:
        if self.root.get(f.ins[0], f.ins[0]) in self.sum_names:
            return self._disqualify(f.ins[0])
        self._set(f.outs[0], self.b(f.ins[0]))
        return None

    def _runtime(self, f: FlatOp) -> _Verdict:
        """A runtime op, analysed by its definition (Note [lowering rules])."""
        return _definition(f).rule("lower_analyse")(f.source, f, self)

    # ---- the interface a definition's ``lower_analyse`` rule sees (``LowerAnalysis``)

    def set(self, name: str, batched: bool) -> None:
        self._set(name, batched)

    def write(self, target: str, batched: bool) -> _Verdict:
        return self._write(target, batched)

    def uniform(self, buffer_id: int) -> bool:
        return buffer_id in self.assume.uniform_buffers

    def not_uniform(self, buffer_id: int) -> _Verdict:
        return replace(self.assume, uniform_buffers=self.assume.uniform_buffers - {buffer_id})

    def whole_values(self, names: list[str]) -> _Verdict:
        for n in names:
            if self.root.get(n, n) in self.sum_names:
                return self._disqualify(n)
        return None

    def constant_offset(self, f: FlatOp) -> int | None:
        return _constant_offset(f)

    def _loop(self, f: FlatOp) -> _Verdict:
        for carried, arg in zip(f.outs, f.ins, strict=True):
            self._set(carried, self.b(arg))
            self.root[carried] = self.root.get(arg, arg)  # a by-ref carry aliases its source
        verdict = self.block(f.body)
        if verdict is not None:
            return verdict
        # Loop outputs past the carried ones are not fed back.
        for carried, result in zip(f.outs[: len(f.results)], f.results, strict=True):
            if self.b(result) and not self.b(carried):
                return replace(self.assume, force_batched=self.assume.force_batched | {carried})
        return None


def _fold_matmuls(
    flat: list[FlatOp], plan: Plan, program: Program, R: int, explicit: bool
) -> list[FlatOp]:
    """Note [fold replicas into the matmul]; on stacked values (``explicit``) also Note
    [convolution weight gradients summed over replicas]."""
    uses: dict[str, int] = {}

    def count(ops):
        for f in ops:
            for n in f.ins:
                uses[n] = uses.get(n, 0) + 1
            if f.kind == "loop":
                count(f.body)
                for n in f.results:
                    uses[n] = uses.get(n, 0) + 1

    count(flat)
    if explicit:
        _sum_conv_grads(flat, plan, uses)
    return _fold_block(flat, plan, program, R, uses)


# Note [convolution weight gradients summed over replicas]
#     On stacked values a convolution's weight and bias gradients are per replica, one
#     ``convolution_backward`` per replica (Note [convolutions and batch norm on stacked rows]
#     in explicit.py), each then added into a replica-sum accumulator as ``acc += g.sum(0)``.
#     When every weight or bias gradient an op returns is read only by such an add, their sum
#     over replicas is all the program needs: ONE ``convolution_backward`` over all replicas'
#     images computes it (the sum over a batch is what a convolution's weight gradient is) and
#     the add takes it as it is (``presummed``). The same maths as the matmul fold; R calls
#     and a stack become one call.
def _sum_conv_grads(flat: list[FlatOp], plan: Plan, uses: dict[str, int]) -> None:
    for f in flat:
        if f.kind == "loop":
            _sum_conv_grads(f.body, plan, uses)
    adds = {f.ins[plan.sum_adds[f]]: f for f in flat if f.kind == "torch" and f in plan.sum_adds}
    for f in flat:
        if f.kind != "torch" or f.source.attrs.target is not _aten.convolution_backward.default:
            continue
        readers = []
        for name, path in zip(f.outs, f.source.attrs.out_paths, strict=True):
            if path[0] == 0 or uses.get(name, 0) == 0:
                continue
            reader = adds.get(name)
            if uses[name] != 1 or reader is None or reader.presummed:
                break
            readers.append(reader)
        else:
            if readers:
                f.rows_summed = True
                for reader in readers:
                    reader.presummed = True


def _matmul_behind(src: str, producer: dict[str, FlatOp], uses: dict[str, int], plan: Plan):
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
            and uses.get(src) == 1 and all(plan.b(n) for n in p.ins)):  # fmt: skip
        return p, views
    return None, views


def _fold_block(
    flat: list[FlatOp], plan: Plan, program: Program, R: int, uses: dict[str, int]
) -> list[FlatOp]:
    producer: dict[str, FlatOp] = {}
    for f in flat:
        for n in f.outs:
            producer[n] = f
    removed: set[int] = set()
    result: list[FlatOp] = []

    def fuse(kind: str, mm: FlatOp, views: list[FlatOp], name: str, reduce_op: str = "") -> None:
        """Replace ``mm`` (and the views after it) by ``kind``; the views are re-applied."""
        removed.add(id(mm))
        removed.update(id(v) for v in views)
        prev = program.fresh()
        result.append(FlatOp(kind, None, list(mm.ins), [prev], reduce_op=reduce_op))
        for v in reversed(views):  # forward order
            out = program.fresh()
            result.append(FlatOp("torch", v.op, [prev], [out]))
            prev = out
        result.append(FlatOp("alias", None, [prev], [name]))

    for f in flat:
        if f.kind == "loop":
            f.body = _fold_block(f.body, plan, program, R, uses)
        if f.kind == "torch" and f in plan.sum_adds:
            # Note [replica-sum accumulators]: acc += sum_r (a_r @ b_r) as one matmul.
            src = f.ins[plan.sum_adds[f]]
            mm, views = _matmul_behind(src, producer, uses, plan)
            if mm is not None:
                fuse("mm_replica_sum", mm, views, src)
                f.presummed = True
        collective = _collective(f.source) if f.kind == "torch" else None
        if collective is not None:
            # Note [fold replicas into the matmul].
            fusion = collective.rule("matmul_fusion")(f.source, R)
            if fusion is not None:
                mm, views = _matmul_behind(f.ins[0], producer, uses, plan)
                if mm is not None:
                    fuse("mm_all_reduce", mm, views, f.outs[0], fusion)
                    continue
        result.append(f)
    return [f for f in result if id(f) not in removed]


# ---- phase 3: emit ------------------------------------------------------------------------


# Note [update in place]
#     An optimizer update is a chain of elementwise ops, each allocating a fresh tensor the
#     size of the parameter, ending in ``state.copy_(new_state)``. On a CPU those allocations
#     (page faults of freshly mapped memory) cost as much as the arithmetic. Two rewrites keep
#     the arithmetic and drop the allocations: an elementwise op whose first operand is a
#     temporary used by nothing else (same shape, dtype and batched-ness as the result)
#     overwrites it; and ``t = op(x, ...)`` directly followed by ``x.copy_(t)``, ``t`` used by
#     nothing else, becomes ``op_(x, ...)``. Both compute the same values in the same order.
_INPLACE = {
    _aten.add.Tensor: _aten.add_.Tensor, _aten.sub.Tensor: _aten.sub_.Tensor,
    _aten.mul.Tensor: _aten.mul_.Tensor, _aten.div.Tensor: _aten.div_.Tensor,
    _aten.add.Scalar: _aten.add_.Scalar, _aten.sub.Scalar: _aten.sub_.Scalar,
    _aten.mul.Scalar: _aten.mul_.Scalar, _aten.div.Scalar: _aten.div_.Scalar,
    _aten.sqrt.default: _aten.sqrt_.default, _aten.rsqrt.default: _aten.rsqrt_.default,
    _aten.neg.default: _aten.neg_.default, _aten.exp.default: _aten.exp_.default,
    _aten.reciprocal.default: _aten.reciprocal_.default,
    _aten.pow.Tensor_Scalar: _aten.pow_.Scalar, _aten.lerp.Tensor: _aten.lerp_.Tensor,
    _aten.lerp.Scalar: _aten.lerp_.Scalar, _aten.addcmul.default: _aten.addcmul_.default,
    _aten.addcdiv.default: _aten.addcdiv_.default, _aten.clamp_min.default: _aten.clamp_min_.default,
}  # fmt: skip


def _uses(flat: list[FlatOp], counts: dict[str, int]) -> dict[str, int]:
    for f in flat:
        for n in f.ins:
            counts[n] = counts.get(n, 0) + 1
        for n in f.results:
            counts[n] = counts.get(n, 0) + 1
        _uses(f.body, counts)
    return counts


def _inplace_rewrites(flat: list[FlatOp], plan: Plan, out_names: list[str]) -> dict[FlatOp, str]:
    """Note [update in place]: ``{op: "inplace"}`` for ops to run in place on their first
    operand and ``{copy_: "skip"}`` for the copies that become redundant. Top level only."""
    uses = _uses(flat, {})
    for n in out_names:
        uses[n] = uses.get(n, 0) + 1
    fresh: set[str] = set()  # temporaries this block allocated (no alias, not a variable)
    # a temporary computed from ``x`` by a chain of elementwise ops: x, the chain's first op
    # and the chain's ops (which may run in place on x itself if the chain ends in a copy to
    # x and nothing else reads x meanwhile)
    origin: dict[str, tuple[str, int, list[FlatOp]]] = {}
    found: dict[FlatOp, str] = {}
    for i, f in enumerate(flat):
        if (f.kind == "torch" and f.source.attrs.target is _aten.copy_.default and len(f.ins) == 2
                and f.ins[1] in origin and uses.get(f.ins[1], 0) == 1 and f not in plan.sum_adds):  # fmt: skip
            x, start, chain = origin[f.ins[1]]
            # nothing else may see x change early: no op in between touches it, and the
            # chain reads it only as the root's first operand
            between = [g for g in flat[start:i] if g not in chain]
            touched = [n for g in between for n in [*g.ins, *g.outs]]
            touched += [n for g in chain[1:] for n in g.ins]
            if x == f.ins[0] and not any(plan.root_of(n) == plan.root_of(x) for n in touched):
                for g in chain:
                    found[g] = "inplace"
                found[f] = "skip"
                continue
        if f.kind != "torch":
            continue
        op = f.source
        target = op.attrs.target
        if target not in _INPLACE or f in plan.sum_adds or f in plan.sum_reads:
            continue
        first = op.attrs.args[0] if op.attrs.args else None
        if not isinstance(first, Slot) or len(f.outs) != 1:
            continue
        x, t = f.ins[first.index], f.outs[0]
        x_t, out_t = op.inputs[first.index], op.outputs[0]
        if (tuple(x_t.shape) != tuple(out_t.shape) or x_t.dtype != out_t.dtype
                or plan.b(x) != plan.b(t) or t in plan.force_batched or x in plan.force_batched
                or f.ins.count(x) != 1):  # fmt: skip
            continue
        nxt = flat[i + 1] if i + 1 < len(flat) else None
        if x in fresh and uses.get(x, 0) == 1:
            found[f] = "inplace"
            if x in origin:
                root, start, chain = origin[x]
                origin[t] = (root, start, [*chain, f])
        elif (nxt is not None and nxt.kind == "torch" and nxt.source.attrs.target is _aten.copy_.default
              and nxt.ins == [x, t] and uses.get(t, 0) == 1 and nxt not in plan.sum_adds):  # fmt: skip
            found[f], found[nxt] = "inplace", "skip"
        else:
            fresh.add(t)
            origin[t] = (x, i, [f])
            continue
        fresh.add(t)
    return found


# Note [zeroed accumulators written once]
#     ``popxl.compile`` zeroes a gradient accumulator as the step begins, and the step's
#     accumulation loop adds into it (Note [zeroed before the loop] in compile.py). Where the
#     loop runs once (a folded loop, Note [fold the accumulation loop] in explicit.py, or a
#     count of one) and its ``acc += x`` is the first thing after the zeroing that touches
#     the accumulator, the pair is ``acc.copy_(x)``: one pass over the accumulator instead of
#     a zeroing pass and a read-add-write pass (resnet18: 11.2M parameters, 62 of them per
#     step). ``copy_`` casts and broadcasts as ``add_`` does, and ``0 + x`` is ``x`` (but for
#     the sign of a zero). Top level only; nothing else may read or write the accumulator
#     between the two, nor the loop run its add more than once.
def _zero_then_add(
    flat: list[FlatOp], plan: Plan, explicit: bool
) -> tuple[set[FlatOp], set[FlatOp]]:
    """Note [zeroed accumulators written once]: (the zeroings to drop, the adds to run as
    ``copy_``)."""
    dropped: set[FlatOp] = set()
    copies: set[FlatOp] = set()
    for i, f in enumerate(flat):
        if (f.kind != "torch" or f.source.attrs.target is not _aten.zero_.default
                or len(f.ins) != 1 or f.source.attrs.kwargs):  # fmt: skip
            continue
        acc = plan.root_of(f.ins[0])
        nxt = next((g for g in flat[i + 1 :] if _rooted(plan, _names(g), acc)), None)
        add = None
        if nxt is not None and nxt.kind == "loop" and not nxt.results:
            add = _single_add(nxt, acc, plan, explicit)
        elif nxt is not None and _plain_add(nxt, plan, acc, f.outs[0]):
            add = nxt
        if add is not None:
            dropped.add(f)
            copies.add(add)
    return dropped, copies


def _single_add(loop: FlatOp, acc: str, plan: Plan, explicit: bool) -> FlatOp | None:
    """The one ``add_`` into the accumulator ``acc`` of a ``loop`` that runs it once, or None."""
    repeated: AbstractSet[FlatOp] = frozenset()
    if loop.count != 1:
        folding = _explicit.fold_plan(loop, plan) if explicit and loop.count > 1 else None
        if not isinstance(folding, _explicit.FoldPlan):
            return None
        repeated = folding.repeated  # counters: run once per iteration
    carried = [c for c, a in zip(loop.outs, loop.ins, strict=True) if plan.root_of(a) == acc]
    if len(carried) != 1:
        return None
    inside = {carried[0], acc}
    touching = [g for g in loop.body if any(plan.root_of(n) in inside for n in _names(g))]
    if len(touching) != 1 or touching[0] in repeated:
        return None
    return touching[0] if _plain_add(touching[0], plan, acc, carried[0]) else None


# Note [weight gradients into their accumulators]
#     A weight gradient folded over replicas and micro-batches (Note [fold replicas into the
#     matmul]) that is the first write of its zeroed accumulator (Note [zeroed accumulators
#     written once]) was a fresh product, transposed back and forth, then copied into the
#     accumulator: a parameter-sized temporary and a pass over it per step (the seed MLP's
#     weight gradients: 1.2 M floats). When the product, its views and the copy follow each
#     other with nothing else between (so nothing can read or write the accumulator in between)
#     and each intermediate has no other reader, the product is written straight into the
#     accumulator (``MM_FOLD_INTO``, ``gemm_out_``: the same kernel and bits as the product,
#     Note [gemm kernel]); the views then view the accumulator and the copy is dropped. An
#     even number of transposes (``t`` twice) leaves the product's layout as it was; other
#     views keep the copy, and so does a product that reads the accumulator itself.
#     Explicitly batched fragments, in the block of the copy (a folded accumulation loop's
#     body is where its adds are).
def _gradients_into_accumulators(
    flat: list[FlatOp], plan: Plan, first_writes: AbstractSet[FlatOp]
) -> dict[FlatOp, str]:
    """Note [weight gradients into their accumulators]: {the fold: the accumulator it
    writes, the copy: ""} for every fold and copy rewritten so."""
    uses: dict[str, int] = {}
    for f in flat:
        for n in _reads(f):
            uses[n] = uses.get(n, 0) + 1
    found: dict[FlatOp, str] = {}
    _into_accumulators(flat, plan, first_writes, uses, found)
    return found


def _into_accumulators(block: list[FlatOp], plan: Plan, first_writes: AbstractSet[FlatOp],
                       uses: Mapping[str, int], found: dict[FlatOp, str]) -> None:  # fmt: skip
    """``_gradients_into_accumulators`` in one block and the loop bodies in it."""
    where = {id(f): i for i, f in enumerate(block)}
    producer = {n: f for f in block for n in f.outs}
    for f in block:
        if f.kind == "loop":
            _into_accumulators(f.body, plan, first_writes, uses, found)
        if f not in first_writes or not f.presummed:
            continue
        args = f.source.attrs.args
        acc, src = f.ins[args[0].index], f.ins[args[1].index]
        chain: list[FlatOp] = []
        transposes = 0
        p = producer.get(src)
        while p is not None and len(p.outs) == 1 and uses.get(p.outs[0], 0) == 1:
            chain.append(p)
            if p.kind == "mm_replica_sum":
                break
            if p.kind == "torch" and p.source.attrs.target is _aten.t.default:
                transposes += 1
            elif p.kind != "alias":
                break
            p = producer.get(p.ins[0])
        if not chain or chain[-1].kind != "mm_replica_sum" or transposes % 2:
            continue
        if any(plan.root_of(n) == plan.root_of(acc) for n in chain[-1].ins):
            continue  # the product reads the accumulator
        if where[id(f)] - where[id(chain[-1])] != len(chain):  # something else runs between
            continue
        found[chain[-1]] = acc
        found[f] = ""


def _plain_add(f: FlatOp, plan: Plan, acc: str, name: str) -> bool:
    """Whether ``f`` is ``name.add_(x)`` (``name`` the accumulator ``acc``), ``x`` no alias of it."""
    if f.kind != "torch" or f.source.attrs.target is not _aten.add_.Tensor or f.source.attrs.kwargs:
        return False
    args = f.source.attrs.args
    return (len(args) == 2 and isinstance(args[0], Slot) and isinstance(args[1], Slot)
            and f.ins[args[0].index] == name and plan.root_of(f.ins[args[1].index]) != acc)  # fmt: skip


# Note [release dead values]
#     Generated code keeps a value in a local name, which Python holds until the function
#     returns. Each block therefore ends a value's name (``del``) right after its last use in
#     that block (reads in a loop body count at the loop), as eager torch frees an autograd
#     buffer once the backward pass is done with it: the step's working set is the live values,
#     not every value it made, and with the step cache (csrc/step_cache.cpp) the next value
#     takes a block that is still warm in the CPU caches. A view keeps its base alive
#     through its own reference, so releasing a name never frees memory still in use. Never
#     released: the fragment's parameters and outputs, and in a loop body the names defined
#     around it (carried values, accumulators) and its fed-back results.
# Note [scratch buffers]
#     What is left of an update chain after Note [update in place] still allocates a few
#     parameter-sized temporaries per step (``sqrt(v)``, ``m / denom``). In an explicitly
#     batched fragment such a temporary, when it never leaves the fragment (read only by
#     elementwise ops, never an output, stored, viewed or written in place), is written into a
#     buffer its op owns and reuses on every run (``out=``): same values, no allocation.
_OUT_FORMS = {
    _aten.add.Tensor: "torch.add", _aten.sub.Tensor: "torch.sub", _aten.mul.Tensor: "torch.mul",
    _aten.div.Tensor: "torch.div", _aten.sqrt.default: "torch.sqrt",
    _aten.lerp.Tensor: "torch.lerp", _aten.addcmul.default: "torch.addcmul",
    _aten.addcdiv.default: "torch.addcdiv",
}  # fmt: skip


def _reads_only(user: FlatOp, name: str) -> bool:
    """Whether ``user`` only reads ``name`` elementwise and returns a new tensor."""
    if user.kind != "torch":
        return False
    target = user.source.attrs.target
    if target not in _explicit.ELEMENTWISE or target in (_aten.clone.default,):
        return False
    schema = target._schema
    for i, arg in enumerate(user.source.attrs.args):
        if isinstance(arg, Slot) and user.ins[arg.index] == name and i < len(schema.arguments):
            info = schema.arguments[i].alias_info
            if info is not None:  # the op writes or returns this argument
                return False
    return True


def _scratch_ops(flat: list[FlatOp], plan: Plan, out_names: list[str],
                 inplace: dict[FlatOp, str]) -> set[FlatOp]:  # fmt: skip
    """Note [scratch buffers]: the top-level ops whose result goes to a reused buffer."""
    users: dict[str, list[FlatOp]] = {}

    def collect(ops):
        for f in ops:
            for n in [*f.ins, *f.results]:
                users.setdefault(n, []).append(f)
            collect(f.body)

    collect(flat)
    chosen = set()
    for f in flat:
        if f.kind != "torch" or f in inplace or f in plan.sum_adds or f in plan.sum_reads:
            continue
        if f.source.attrs.target not in _OUT_FORMS or len(f.outs) != 1:
            continue
        out = f.outs[0]
        if _stays_inside(out, users, inplace, out_names, plan):
            chosen.add(f)
    return chosen


def _stays_inside(name: str, users, inplace, out_names, plan, depth: int = 0) -> bool:
    """Whether ``name`` is only read elementwise, directly or through ops that run in place
    on it (Note [update in place]; their results are the same buffer)."""
    if depth > 64 or name in out_names or name in plan.force_batched or not users.get(name):
        return False
    for u in users[name]:
        first = u.source.attrs.args[0] if u.kind == "torch" and u.source.attrs.args else None
        on_it = isinstance(first, Slot) and u.ins[first.index] == name
        if inplace.get(u) == "inplace" and on_it:
            if u.ins.count(name) != 1 or not _stays_inside(u.outs[0], users, inplace, out_names,
                                                            plan, depth + 1):  # fmt: skip
                return False
        elif inplace.get(u) == "skip" or not _reads_only(u, name):
            return False
    return True


# Note [replica-invariant remote buffers]
#     A remote buffer whose variables all hold one value for every replica (unsharded, one
#     replica group) and which is only ever stored to with replica-invariant values at fixed
#     slots keeps R equal rows. Its loads are then replica-invariant (``FastExecutor`` starts
#     from every such buffer and the analysis drops one at the first per-replica store, slot
#     or in-place load): an off-chip optimizer state read as row 0 makes its update, and the
#     weight it updates, replica-invariant (Note [replica-invariant values]), so the update
#     runs once and the weight is not copied per replica. A store still writes every row.
#     Only explicitly batched fragments read row 0; under vmap the buffer is per replica.
# Note [remote slot views]
#     A variable's remote optimizer state is loaded, updated in place and stored back to the
#     same slot. In an explicitly batched fragment, when every replica addresses the same fixed
#     slot (a constant offset), that round trip needs no copy: the load becomes a view of the
#     slots (``torch_popxl::remote_slot_view``, counted as the load), the updates write through
#     it, and the store of that very view moves nothing (``remote_store_stacked_`` sees the
#     value is the slots; it still counts the store). That store is emitted as a direct call
#     of the kernel with every replica's offset as one constant (``stored_slot_view``): the
#     kernel keeps all its checks, the explicit rule's Python wrapper is skipped. Safe when
#     nothing can observe the buffer changing early: no other remote op on the buffer between the load and the store, the
#     value (or any alias of it) is stored to the same slot, is not used after the store, is
#     not a fragment output and never goes to the host or a print.
def _constant_offset(f: FlatOp) -> int | None:
    """The offset of a remote op when it is a constant integer (the same on every replica)."""
    off = f.source.inputs[-1] if f.source.inputs else None
    if not isinstance(off, Constant) or off._data.numel() != 1:
        return None
    if off._data.dtype.is_floating_point or off._data.dtype == torch.bool:
        return None
    return int(off._data.item())


def _effects(f: FlatOp) -> Effects:
    """The effects of the IR op a flat op lowers (none for the flattener's own copies and
    aliases, the fused kinds and loops, whose body ops have theirs)."""
    return _NO_EFFECTS if f.op is None or f.kind == "loop" else effects(f.op)


_NO_EFFECTS = Effects()


def _remote_buffer_id(f: FlatOp) -> int | None:
    if Effect.REMOTE in _effects(f).flags:
        return f.source.attrs.buffer.remote_buffer_id
    return None


def _fresh_load(f: FlatOp) -> bool:
    """A remote load into a new value (not into a tensor it writes)."""
    e = _effects(f)
    return e.reads_buffer and not e.writes


def _to_host(f: FlatOp) -> bool:
    """An op that hands its inputs' values to the host (a host store, a print)."""
    return _effects(f).host_io and bool(f.ins)


def _touches_buffer(flat: list[FlatOp], bid: int) -> bool:
    return any(_remote_buffer_id(g) == bid or _touches_buffer(g.body, bid) for g in flat)


def _names(f: FlatOp) -> list[str]:
    found = [*f.ins, *f.outs, *f.results]
    for g in f.body:
        found += _names(g)
    return found


def _rooted(plan: Plan, names: list[str], root: str) -> bool:
    return any(plan.root_of(n) == root for n in names)


def _remote_views(flat: list[FlatOp], plan: Plan, out_names: list[str]) -> set[FlatOp]:
    """Note [remote slot views]: the top-level remote loads to run as views."""
    chosen: set[FlatOp] = set()
    outputs = {plan.root_of(n) for n in out_names}
    for i, f in enumerate(flat):
        if not _fresh_load(f) or plan.b(f.ins[0]):
            continue
        slot, out = _constant_offset(f), f.outs[0]
        bid = f.source.attrs.buffer.remote_buffer_id
        # (a load from a buffer read per replica is per replica anyway: forcing it is moot)
        forced = out in plan.force_batched and bid in plan.assumptions.uniform_buffers
        if slot is None or forced or out in outputs:
            continue
        for j in range(i + 1, len(flat)):
            g = flat[j]
            if _remote_buffer_id(g) == bid or _touches_buffer(g.body, bid):
                break
        else:
            continue
        g = flat[j]
        if (
            not _effects(g).writes_buffer
            or plan.root_of(g.ins[0]) != out
            or _constant_offset(g) != slot
        ):
            continue

        between = flat[i + 1 : j]
        if any(_to_host(h) and _rooted(plan, _names(h), out) for h in between):
            continue
        if any(_rooted(plan, _names(h), out) for h in flat[j + 1 :]):
            continue
        chosen.add(f)
    return chosen


# Note [aliasing collectives]
#     A full-group all-gather of stacked rows returns those very rows (``[R, *s]`` is the
#     gathered ``[G, *s]``); a copy only keeps the result independent of its input. At the top
#     level of an explicitly batched fragment the copy is dropped (the stanza's
#     ``explicit_alias`` rule) when nothing can see the sharing: neither the input nor the
#     result is written after the op, neither is a fragment output, and the result never goes
#     to the host or a print. An RTS weight update (update the shard, gather, copy into the
#     full weight) then moves the shard once instead of twice.
def _written_names(f: FlatOp) -> list[str]:
    """The value names ``f`` (or its loop body) writes in place."""
    if f.kind == "loop":
        return [n for g in f.body for n in _written_names(g)]
    return [] if f.op is None else [f.ins[i] for i in effects(f.op).writes]


def _alias_collectives(flat: list[FlatOp], plan: Plan, out_names: list[str], R: int,
                       views: set[FlatOp]) -> dict[FlatOp, Callable[..., Any]]:  # fmt: skip
    """Note [aliasing collectives]: the top-level collectives to run through their
    ``explicit_alias`` rule, with the rule's function. Never on a remote slot view (``views``):
    a later store to its buffer would change the result behind the program's back."""
    chosen: dict[FlatOp, Callable[..., Any]] = {}
    outputs = {plan.root_of(n) for n in out_names} | {f.outs[0] for f in views}
    for i, f in enumerate(flat):
        opdef = _collective(f.source) if f.kind == "torch" else None
        if opdef is None or not opdef.has("explicit_alias") or len(f.outs) != 1:
            continue
        if f in plan.sum_reads or f in plan.sum_adds:
            continue
        fn = opdef.rule("explicit_alias")(f.source, [plan.b(n) for n in f.ins], R)
        roots = {plan.root_of(f.ins[0]), plan.root_of(f.outs[0])}
        if fn is None or roots & outputs or f.outs[0] in plan.force_batched:
            continue
        later = flat[i + 1 :]
        if any(plan.root_of(n) in roots for g in later for n in _written_names(g)):
            continue
        if any(_to_host(g) and any(plan.root_of(n) in roots for n in _names(g)) for g in later):
            continue
        chosen[f] = fn
    return chosen


def _alias_sum_reads(flat: list[FlatOp], plan: Plan, out_names: list[str]) -> set[FlatOp]:
    """Note [replica-sum accumulators]: the top-level sum reads whose result may be the
    accumulator's memory."""
    chosen: set[FlatOp] = set()
    outputs = {plan.root_of(n) for n in out_names}
    for i, f in enumerate(flat):
        if f not in plan.sum_reads or len(f.outs) != 1:
            continue
        acc, out = plan.root_of(f.ins[0]), plan.root_of(f.outs[0])
        if out in outputs:
            continue
        later = flat[i + 1 :]
        last = max((j for j, g in enumerate(later) if _rooted(plan, _names(g), out)), default=-1)
        live = later[: last + 1]
        if any(plan.root_of(n) in (acc, out) for g in live for n in _written_names(g)):
            continue
        if any(_to_host(g) and _rooted(plan, _names(g), out) for g in live):
            continue
        chosen.add(f)
    return chosen


# Note [RTS updates in place]
#     A replica-sharded update of a replica-invariant weight ``w`` reads
#         s = reduce_scatter(w, 'local')  ... s updated in place ...
#         g = all_gather(s); w.copy_(view/slice of g)
#     When ``w`` divides into R chunks, ``s`` can be a view of ``w`` (the stanza's
#     ``explicit_alias`` rule): the updates then write ``w`` directly, the gather is a view of
#     the same memory (Note [aliasing collectives]) and the final copy finds nothing to move
#     (``COPY_UNLESS_SAME``). The program cannot tell: nothing else reads or writes ``w``
#     between the slice and the copy, the gathered value reaches the copy only through views
#     used once, and ``s`` is not used after the copy. Traffic is counted as the ops say.
_SLICE_VIEWS = frozenset(_VIEW_OPS | {_aten.slice.Tensor})


def _rts_updates(flat: list[FlatOp], plan: Plan, out_names: list[str], R: int,
                 aliasing: Mapping[FlatOp, Any]) -> tuple[dict[FlatOp, Any], set[FlatOp]]:  # fmt: skip
    """Note [RTS updates in place]: (slice ops to run as views with their function, the
    copy-back ops that may find their source is their target)."""
    shards: dict[FlatOp, Any] = {}
    copies: set[FlatOp] = set()
    uses = _uses(flat, {})
    for n in out_names:
        uses[n] = uses.get(n, 0) + 1
    outputs = {plan.root_of(n) for n in out_names}
    index = {f: i for i, f in enumerate(flat)}
    for i, f in enumerate(flat):
        opdef = _collective(f.source) if f.kind == "torch" else None
        if opdef is None or not opdef.has("explicit_alias") or f in plan.sum_reads:
            continue
        fn = opdef.rule("explicit_alias")(f.source, [plan.b(n) for n in f.ins], R)
        if fn is None or opdef.name != "replicated_reduce_scatter":
            continue
        w, shard = plan.root_of(f.ins[0]), f.outs[0]
        if w in outputs or shard in outputs or shard in plan.force_batched:
            continue
        # the gather of the shard, then views used once, then the copy back into w
        gather = next((g for g in flat[i + 1 :] if g in aliasing
                       and plan.root_of(g.ins[0]) == shard), None)  # fmt: skip
        if gather is None:
            continue
        chain, cur, k = [gather], gather.outs[0], index[gather] + 1
        while k < len(flat) and uses.get(cur) == 1:
            g = flat[k]
            if g.kind != "torch" or cur not in g.ins:
                break
            if g.source.attrs.target in _SLICE_VIEWS and g.ins[0] == cur:
                chain.append(g)
                cur, k = g.outs[0], k + 1
                continue
            break
        if k >= len(flat):
            continue
        back = flat[k]
        if (back.kind != "torch" or back.source.attrs.target is not _aten.copy_.default
                or back.ins != [f.ins[0], cur] or uses.get(cur) != 1):  # fmt: skip
            continue
        # nothing but the idiom touches w between the slice and the copy
        middle = [g for g in flat[i + 1 : k] if g not in chain]
        if any(plan.root_of(n) == w for g in middle for n in _names(g)):
            continue
        if any(_to_host(g) and any(plan.root_of(n) == shard for n in _names(g)) for g in middle):
            continue
        # and the shard (now w's memory) is not used after the copy
        if any(plan.root_of(n) == shard for g in flat[k + 1 :] for n in _names(g)):
            continue
        shards[f] = fn
        copies.add(back)
    return shards, copies


def _copy_unless_same(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``target.copy_(source)``, skipped when ``source`` is ``target``'s very memory and
    layout (Note [RTS updates in place])."""
    if (source.data_ptr() == target.data_ptr() and source.shape == target.shape
            and source.stride() == target.stride() and source.dtype == target.dtype):  # fmt: skip
        return target
    return target.copy_(source)


class _Scratch:
    """Buffers owned by the ops of one program, allocated on first use."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}

    def __call__(
        self, key: int, shape: tuple[int, ...], dtype: torch.dtype, device
    ) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf


def _stacked_view(x: torch.Tensor, shape, R: int) -> torch.Tensor:
    """A per-replica view on stacked ``[R, ...]`` storage (a copy only if a view is impossible)."""
    try:
        return x.view((R, *shape))
    except RuntimeError:
        return x.reshape((R, *shape))


def _mm_fold(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_r a[r] @ b[r]`` as one matmul with the replicas folded into the contraction."""
    R, M, K = a.shape
    at = a.transpose(1, 2)
    if at.is_contiguous():  # a weight gradient's x^T: fold without copying it
        return gemm(at.reshape(R * K, M).t(), b.reshape(R * K, b.shape[2]))
    return gemm(a.permute(1, 0, 2).reshape(M, R * K), b.reshape(R * K, b.shape[2]))


def _mm_fold_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out.copy_(_mm_fold(a, b))`` with the product written into ``out`` itself where it
    can be (Note [weight gradients into their accumulators])."""
    R, M, K = a.shape
    at = a.transpose(1, 2)
    if at.is_contiguous() and out.shape == (M, b.shape[2]) and out.dtype == a.dtype:
        return gemm_out_(out, at.reshape(R * K, M).t(), b.reshape(R * K, b.shape[2]))
    return out.copy_(_mm_fold(a, b))


class Program:
    """Generated code for one Ir on one device: globals, constants and fragment functions."""

    def __init__(self, device: torch.device, num_replicas: int):
        self.device = device
        self.R = num_replicas
        self.globals: dict[str, Any] = {
            "DEVICE": device,
            "REMOTE_VIEW": torch.ops.torch_popxl.remote_slot_view,
            "COPY_UNLESS_SAME": _copy_unless_same,
            "MM_ALL_REDUCE": torch.ops.torch_popxl.mm_all_reduce,
            "VIEW": view_or_copy,
            "REPLICA_SUM": torch.ops.torch_popxl.replica_sum,
            "MM_REPLICA_SUM": torch.ops.torch_popxl.mm_replica_sum,
            "MM_ALL_REDUCE_STACKED": torch.ops.torch_popxl.mm_all_reduce_stacked,
            "MM_FOLD": _mm_fold,
            "MM_FOLD_INTO": _mm_fold_into,
            "GEMM": torch.ops.torch_popxl.gemm.default._op,
            "STACKED_VIEW": _stacked_view,
            "torch": torch,
            "SCRATCH": _Scratch(),
        }
        for opdef in registered():  # what runtime ops' emitted lines call
            if opdef.has("lower_globals"):
                self.globals.update(opdef.rule("lower_globals")())
        self._counter = itertools.count()
        self._literals: dict[int, str] = {}
        self._keepalive: list[Any] = []
        self._constants: dict[int, str] = {}
        self.sources: dict[str, str] = {}
        self.explicit_ok = False  # set by the executor (single process)
        # the ops whose views run as copies (Note [views of new tensors] in ir/views.py)
        self.copied: frozenset[Op] = frozenset()
        self.folded_loops = 0  # Note [fold the accumulation loop]: loops run as one pass
        self.var_names: dict[str, str] = {}
        # Note [inductor backend] (runtime/executor.py): literal name -> the OpOverload whose
        # raw ``_op`` the generated code calls (faster, but torch.compile cannot trace it).
        self.overloads: dict[str, torch._ops.OpOverload] = {
            "GEMM": torch.ops.torch_popxl.gemm.default
        }

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

    def aten(self, target: torch._ops.OpOverload) -> str:
        """The literal for an aten overload's raw ``_op`` (skips the OpOverload dispatch); a
        matmul's is its ``gemm`` form (Note [gemm kernel]), an op torch batches wrongly its
        ``SAFE_FORMS`` one (runtime/explicit.py), dropout's ``bernoulli_`` its counter-based
        form (runtime/random.py)."""
        form = (ATEN_FORMS.get(target) or _explicit.SAFE_FORMS.get(target)
                or RANDOM_FORMS.get(target))  # fmt: skip
        name = self.literal(target._op if form is None else form)
        self.overloads[name] = target
        return name

    def constant(self, t: Constant) -> str:
        key = id(t)
        if key not in self._constants:
            name = f"c{len(self._constants)}"
            self._constants[key] = name
            self._keepalive.append(t)
            self.globals[name] = t._data.to(self.device)
        return self._constants[key]


class _Emitter:
    def __init__(self, program: Program, plan: Plan, params: list[str], explicit: bool = False):
        self.p = program
        self.a = plan
        self.explicit = explicit  # Note [explicit batching]: stacked tensors, no vmap
        self._ind = ""  # the indent of the op being emitted (``line``)
        self.lines: list[str] = []
        self.defined: set[str] = set(params)
        # Note [fold the accumulation loop] (runtime/explicit.py): inside a folded loop the
        # leading dim holds ``fold`` iterations of R replicas.
        self.fold = 1
        self.rows = program.R
        self.fold_repeated: AbstractSet[FlatOp] = frozenset()  # ops run once per iteration
        self.inplace: dict[FlatOp, str] = {}  # Note [update in place]
        # Note [zeroed accumulators written once]
        self.zeroes_dropped: set[FlatOp] = set()
        self.first_writes: set[FlatOp] = set()
        # Note [one gather of a convolution's taps] (explicit.py): (weight root, taps) -> the
        # value holding those taps gathered, for the backward of the same block
        self.shared_taps: dict[tuple[str, Any], str] = {}
        self.scratch: set[FlatOp] = set()  # Note [scratch buffers]
        self.keep: frozenset[str] = frozenset()  # never released: the fragment's outputs, params
        # Note [inductor backend]: every REMOTE_VIEW emitted, as (buffer id, slot, runs per
        # call), so a compiled function can count them outside the graph
        self.slot_views: list[tuple[int, int | None, int]] = []
        self.repeats = 1
        self.views: set[FlatOp] = set()  # Note [remote slot views]
        self.aliasing: dict[FlatOp, Callable[..., Any]] = {}  # Note [aliasing collectives]
        self.sum_aliases: set[FlatOp] = set()  # Note [replica-sum accumulators]
        self.copies: set[FlatOp] = set()  # Note [RTS updates in place]
        # Note [weight gradients into their accumulators]: fold -> accumulator, copy -> ""
        self.into_accumulators: dict[FlatOp, str] = {}
        # Note [one op through torch's batching rule] (explicit.py): the callables emitted
        self.one_op_vmaps: list[Any] = []

    def literal(self, x: Any, f: FlatOp) -> str:
        if isinstance(x, Slot):
            pad = _explicit.rank_padding(f, self.a).get(x.index, 0) if self.explicit else 0
            # Note [broadcasting on stacked values]: unit dims after the replica dim
            return f"{f.ins[x.index]}[:{', None' * pad}]" if pad else f.ins[x.index]
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

    def block(self, flat: list[FlatOp], indent: str,
              keep: frozenset[str] = frozenset()) -> None:  # fmt: skip
        """Emit ``flat``; every value defined here is released after its last use in it
        (Note [release dead values]), except those in ``keep``."""
        last: dict[str, int] = {}
        for i, f in enumerate(flat):
            for n in [*f.outs, *_reads(f)]:
                last[n] = i
        keep = keep | self.keep
        dies: dict[int, set[str]] = {}  # op index -> the values defined here it last uses
        for f in flat:
            for n in f.outs:
                if n not in keep:
                    dies.setdefault(last[n], set()).add(n)
        outer_taps, self.shared_taps = self.shared_taps, {}
        for i, f in enumerate(flat):
            start = len(self.lines)
            getattr(self, f"_{f.kind}")(f, indent)
            self._drop_written_taps(f, indent)
            for n in f.outs:
                # Materialise a forced value once, where it is defined (not after in-place
                # ops that return it again, which would break aliasing).
                if (n in self.a.force_batched and f.kind != "loop" and n not in self.defined
                        and not self._loads_per_replica(f)):  # fmt: skip
                    self.lines.append(f"{indent}{n} = rt.batch({n})")
                self.defined.add(n)
            ending = dies.get(i, set())
            dead = [n for n in dict.fromkeys(f.outs) if n in ending]
            dead += sorted(ending - set(f.outs))
            if f.kind != "loop" and any(line.startswith(f"{indent}_r = ")
                                        for line in self.lines[start:]):  # fmt: skip
                dead.append("_r")
            if dead:
                self.lines.append(f"{indent}del {', '.join(dead)}")
        for name in self.shared_taps.values():  # forwards without a backward in this block
            self.lines.append(f"{indent}del {name}")
        self.shared_taps = outer_taps

    def _drop_written_taps(self, f: FlatOp, indent: str) -> None:
        """Note [one gather of a convolution's taps]: forget the gathered taps of a weight
        ``f`` writes (or, a loop, may write)."""
        written = {self.a.root_of(n) for n in _written_names(f)}
        for key in [k for k in self.shared_taps if k[0] in written]:
            self.lines.append(f"{indent}del {self.shared_taps.pop(key)}")

    def _outer_names(self, loop: FlatOp) -> frozenset[str]:
        """The names a loop body must not release: everything defined around it (carried
        values, accumulators the body adds to), its inputs and its fed-back results."""
        return frozenset(self.defined) | frozenset(loop.ins + loop.outs + loop.results)

    def _loads_per_replica(self, f: FlatOp) -> bool:
        """A remote load that already gives every replica its own row (a value forced per
        replica by an analysis pass that read the buffer as replica-invariant needs no
        broadcast then, Note [replica-invariant remote buffers])."""
        if not _fresh_load(f):
            return False
        bid = f.source.attrs.buffer.remote_buffer_id
        return not (self.explicit and bid in self.a.assumptions.uniform_buffers)

    def _torch(self, f: FlatOp, ind: str) -> None:
        if self.into_accumulators.get(f) == "":  # Note [weight gradients into their accumulators]
            self.lines.append(f"{ind}{f.outs[0]} = {f.ins[0]}")
            return
        if f in self.zeroes_dropped:  # Note [zeroed accumulators written once]
            self.lines.append(f"{ind}{f.outs[0]} = {f.ins[0]}")
            return
        rewrite = self.inplace.get(f)
        if rewrite == "skip":  # Note [update in place]: the op before already wrote it
            if f.outs and f.outs[0] != f.ins[0]:
                self.lines.append(f"{ind}{f.outs[0]} = {f.ins[0]}")
            return
        if f in self.scratch:  # Note [scratch buffers]
            attrs = f.source.attrs
            args = [self.literal(x, f) for x in attrs.args]
            args += [f"{k}={self.literal(v, f)}" for k, v in attrs.kwargs.items()]
            t = f.source.outputs[0]
            shape = (self.p.R, *t.shape) if self.a.b(f.outs[0]) else tuple(t.shape)
            buf = f"SCRATCH({next(self.p._counter)}, {shape!r}, {self.p.literal(t.dtype.as_torch())}, DEVICE)"
            self.lines.append(
                f"{ind}{f.outs[0]} = {_OUT_FORMS[attrs.target]}({', '.join(args)}, out={buf})"
            )
            return
        if f in self.copies:  # Note [RTS updates in place]
            target, source = f.ins
            self.lines.append(f"{ind}{f.outs[0]} = COPY_UNLESS_SAME({target}, {source})")
            return
        if f in self.aliasing:  # Note [aliasing collectives]
            args = [self.literal(x, f) for x in f.source.attrs.args]
            args += [f"{k}={self.literal(v, f)}" for k, v in f.source.attrs.kwargs.items()]
            call = f"{self.p.literal(self.aliasing[f])}({', '.join(args)})"
            self.lines.append(f"{ind}{f.outs[0]} = {call}")
            return
        if rewrite == "inplace":
            fn = self.p.aten(_INPLACE[f.source.attrs.target])
            args = [self.literal(x, f) for x in f.source.attrs.args]
            args += [f"{k}={self.literal(v, f)}" for k, v in f.source.attrs.kwargs.items()]
            self.lines.append(f"{ind}{f.outs[0]} = {fn}({', '.join(args)})")
            return
        if self.explicit:
            _explicit.emit_torch(self, f, ind)
        else:
            self._torch_plain(f, ind)

    def _torch_plain(self, f: FlatOp, ind: str) -> None:
        target = f.source.attrs.target
        is_aten = isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
        if target is _aten.view.default:  # Note [recorded views meet other layouts]
            fn = "VIEW"
        elif f in self.first_writes:  # Note [zeroed accumulators written once]
            fn = self.p.aten(_aten.copy_.default)
        else:
            fn = self.p.aten(target) if is_aten else self.p.literal(target)
        if f in self.a.sum_reads:
            self._sum_read(f, ind)
            return
        if self._passthrough(f, ind):
            return
        args = [self.literal(x, f) for x in f.source.attrs.args]
        batched = [self.a.b(n) for n in f.ins]
        if target in _explicit.PER_ELEMENT and self.p.R > 1 and any(batched):
            # Note [per-element list ops]: on the stacked rows (vmap has no rule for it)
            if not _explicit.per_element_ok(f.source, batched):
                raise NotImplementedError(
                    f"{target} was given a learning rate, step count or other scalar tensor "
                    "that differs between replicas; the fast executor runs it only with "
                    "scalars shared by all replicas. Compute them from replica-invariant "
                    "values, or run with executor='reference'."
                )
            args.insert(0, fn)
            fn = self.p.literal(_explicit.per_element_stacked)
        if f in self.a.sum_adds:
            x = f.ins[self.a.sum_adds[f]]
            if f.presummed:
                summed = x
            elif not self.a.b(x):
                summed = f"({x} * {self.p.R})"
            else:  # on stacked values the sum over replicas is a sum over the first dim
                summed = f"{x}.sum(0)" if self.explicit else f"REPLICA_SUM({x})"
            args = [summed if a == x else a for a in args]
        if (not is_aten and _collective(f.source) is not None and self.p.R > 1
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
        acc = self.into_accumulators.get(f)
        if acc:  # Note [weight gradients into their accumulators]
            self.lines.append(f"{ind}{f.outs[0]} = MM_FOLD_INTO({acc}, {f.ins[0]}, {f.ins[1]})")
            return
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
        if self.a.root_of(src) in self.a.written or self.a.root_of(out) in self.a.written:
            return False
        self.lines.append(f"{ind}{out} = {src}")
        self.lines.append(
            f"{ind}rt.count_collective_call()"
        )  # the runtime still sees one collective
        return True

    def _sum_read(self, f: FlatOp, ind: str) -> None:
        """The full-group reduction of a replica-sum accumulator (its value is the sum)."""
        finish = self.p.literal(self.a.sum_reads[f])
        alias = ", alias=True" if f in self.sum_aliases else ""
        self.lines.append(f"{ind}{f.outs[0]} = rt.sum_read({finish}, {f.ins[0]}{alias})")

    def _mm_all_reduce(self, f: FlatOp, ind: str) -> None:
        a, b = f.ins
        fn = "MM_ALL_REDUCE_STACKED" if self.explicit else "MM_ALL_REDUCE"
        self.lines.append(f"{ind}{f.outs[0]} = {fn}({a}, {b}, {f.reduce_op!r})")

    def _clone(self, f: FlatOp, ind: str) -> None:
        self.lines.append(f"{ind}{f.outs[0]} = {f.ins[0]}.clone()")

    def _alias(self, f: FlatOp, ind: str) -> None:
        self.lines.append(f"{ind}{f.outs[0]} = {f.ins[0]}")

    def _runtime(self, f: FlatOp, ind: str) -> None:
        """A runtime op, emitted by its definition (Note [lowering rules])."""
        self._ind = ind
        _definition(f).rule("lower_emit")(f.source, f, self)

    # ---- the interface a definition's ``lower_emit`` rule sees (``LowerEmission``)

    def line(self, code: str) -> None:
        self.lines.append(f"{self._ind}{code}")

    def global_name(self, value: Any) -> str:
        return self.p.literal(value)

    def b(self, name: str) -> bool:
        return self.a.b(name)

    def written(self, name: str) -> bool:
        return self.a.root_of(name) in self.a.written

    def uniform(self, buffer_id: int) -> bool:
        return buffer_id in self.a.assumptions.uniform_buffers

    def is_view(self, f: FlatOp) -> bool:
        return f in self.views

    def stored_slot_view(self, f: FlatOp) -> int | None:
        bid, slot = f.source.attrs.buffer.remote_buffer_id, _constant_offset(f)
        if not self.explicit or self.fold != 1 or slot is None or self.uniform(bid):
            return None
        own = (g for g in self.views if g.outs[0] == f.ins[0] and _remote_buffer_id(g) == bid)
        return slot if any(_constant_offset(g) == slot for g in own) else None

    def slot_view(self, buffer_id: int, slot: int | None) -> str:
        self.slot_views.append((buffer_id, slot, self.repeats))
        return f"REMOTE_VIEW(rt.buffers[{buffer_id}], {slot}, {buffer_id})"

    def stacked_call(self, f: FlatOp) -> bool:
        """Note [explicit batching]: a runtime op through its definition's ``explicit`` rule,
        called as ``fn(stacked_buffer, *ins)``."""
        if not self.explicit:
            return False
        fn = _explicit.opdef_rule(f.source, [self.a.b(n) for n in f.ins], self.p.R)
        bid = f.source.attrs.buffer.remote_buffer_id
        call = f"{self.p.literal(fn)}(rt.buffers[{bid}]{''.join(', ' + n for n in f.ins)})"
        self.lines.append(f"{self._ind}{f.outs[0]} = {call}" if f.outs else f"{self._ind}{call}")
        return True

    def constant_offset(self, f: FlatOp) -> int | None:
        return _constant_offset(f)

    def _loop(self, f: FlatOp, ind: str) -> None:
        for carried, arg in zip(f.outs, f.ins, strict=True):
            self.defined.add(carried)
            self.lines.append(f"{ind}{carried} = {arg}")
            if carried in self.a.force_batched:
                self.lines.append(f"{ind}{carried} = rt.batch({carried})")
        # A repeat of count 0 runs nothing: the carried values are its results (upstream allows
        # count 0, ops/repeat.py); only the general loop below handles it.
        folding = (_explicit.fold_plan(f, self.a)
                   if self.explicit and self.fold == 1 and f.count > 0 else None)  # fmt: skip
        if isinstance(folding, _explicit.FoldPlan):
            # Note [fold the accumulation loop]: every iteration in one pass
            self.lines.append(f"{ind}# {f.count} iterations folded into the leading dim")
            self.p.folded_loops += 1
            self.fold_repeated = folding.repeated
            outside = _explicit.outside_rows(f, self.a, folding.written_outside)
            for n in outside:  # R rows -> count * R rows, iteration-major
                self.lines.append(f"{ind}_o_{n} = {n}")
                self.lines.append(f"{ind}{n} = {n}.repeat({f.count}, *[1] * ({n}.dim() - 1))")
            self.fold, self.rows = f.count, f.count * self.p.R
            self.block(f.body, ind, self._outer_names(f))
            self.fold, self.rows = 1, self.p.R
            self.fold_repeated = frozenset()
            for n in outside:
                self.lines.append(f"{ind}{n} = _o_{n}")
            return
        self.lines.append(f"{ind}for _ in range({f.count}):")
        outer_repeats = self.repeats
        self.repeats *= f.count
        self.block(f.body, ind + "    ", self._outer_names(f))
        self.repeats = outer_repeats
        results = f.results
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
    plan: Plan  # the analysis the code was generated from
    explicit: bool  # Note [explicit batching]: runs on stacked tensors, not under vmap
    vmap_reason: str | None  # why it runs under vmap (the first op without a rule), if it does
    vmapped_ops: tuple[str, ...]  # ops run alone through torch's batching rule, if explicit
    one_op_vmaps: tuple[Any, ...]  # their callables (``failed``: why one runs under vmap)
    written_streams: frozenset[int]  # host streams whose loaded values it updates in place
    source: str  # the generated Python

    def __call__(self, rt: Any, *params: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


def lower_fragment(program: Program, graph: Graph, params: Sequence[Tensor], ops: list[Op],
                   outputs: Sequence[Tensor], name: str, batched_params: list[bool],
                   assume: Assumptions) -> Fragment:  # fmt: skip
    """Compile ``ops`` of the main graph into ``fn(rt, *params) -> outputs`` under ``assume``;
    ``fn.plan.assumptions`` are the ones the fragment's analysis settled on (narrower than
    ``assume`` when the fragment contradicts them, see ``FastExecutor``)."""
    scope = {}
    param_names = []
    for t in params:
        n = program.fresh()
        scope[t.id] = n
        param_names.append(n)
    program.var_names.update({n: t.id for t, n in zip(params, param_names, strict=True)})
    flat = _Flattener(program).flatten(ops, scope)
    out_names = [scope[t.id] for t in outputs]
    plan = analyse(flat, [(n, t.id, d) for t, n, d in zip(params, param_names, batched_params, strict=True)],
                   program.var_names, program.R, assume, program.explicit_ok)  # fmt: skip
    reason = None
    if program.explicit_ok:
        reason = _explicit.vmap_reason(flat, plan, program.R)
    if plan.assumptions.uniform_buffers and (reason is not None or not program.explicit_ok):
        # Note [replica-invariant remote buffers]: only explicit batching reads row 0
        plan = analyse(flat, [(n, t.id, d) for t, n, d in zip(params, param_names, batched_params, strict=True)],
                       program.var_names, program.R,
                       replace(plan.assumptions, uniform_buffers=frozenset()),
                       program.explicit_ok)  # fmt: skip
        if program.explicit_ok:
            reason = _explicit.vmap_reason(flat, plan, program.R)
    explicit = program.explicit_ok and reason is None
    if program.R > 1 or explicit:
        flat = _fold_matmuls(flat, plan, program, program.R, explicit)
    em = _Emitter(program, plan, param_names, explicit)
    em.inplace = _inplace_rewrites(flat, plan, out_names)
    em.zeroes_dropped, em.first_writes = _zero_then_add(flat, plan, explicit)
    if explicit:
        em.scratch = _scratch_ops(flat, plan, out_names, em.inplace)
        em.views = _remote_views(flat, plan, out_names)
        em.aliasing = _alias_collectives(flat, plan, out_names, program.R, em.views)
        shards, em.copies = _rts_updates(flat, plan, out_names, program.R, em.aliasing)
        em.aliasing.update(shards)
        em.sum_aliases = _alias_sum_reads(flat, plan, out_names)
        em.into_accumulators = _gradients_into_accumulators(flat, plan, em.first_writes)
    em.keep = frozenset(out_names) | frozenset(param_names)
    em.lines.append(f"def fn(rt{''.join(', ' + n for n in param_names)}):")
    em.block(flat, "    ")
    em.lines.append(f"    return ({''.join(n + ', ' for n in out_names)})")
    src = "\n".join(em.lines)
    program.sources[name] = src
    scope_: dict[str, Any] = {}
    exec(compile(src, f"<torch_popxl {graph.id} {name}>", "exec"), program.globals, scope_)
    fn = scope_["fn"]
    fn.out_batched = [plan.b(n) for n in out_names]
    fn.explicit = explicit
    fn.vmap_reason = reason
    # Note [one op through torch's batching rule] (explicit.py)
    fn.one_op_vmaps = tuple(em.one_op_vmaps)
    fn.vmapped_ops = tuple(dict.fromkeys(o.name for o in em.one_op_vmaps))
    fn.plan = plan
    fn.written_streams = _written_streams(flat, plan)
    fn.slot_views = tuple(em.slot_views)
    fn.source = src
    return fn


def _written_streams(flat: list[FlatOp], plan: Plan) -> frozenset[int]:
    """Indices of the host streams whose loaded values (or views of them) an op updates in
    place: only their inputs need a private copy per run (``Session``)."""
    found: set[int] = set()
    for f in flat:
        if _effects(f).host_io and f.outs and f.outs[0] in plan.written:  # a host load
            found.add(f.source.attrs.stream._index)
        found |= _written_streams(f.body, plan)
    return frozenset(found)
