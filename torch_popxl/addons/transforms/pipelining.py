"""Pipelined execution (popxl-addons' ``transforms.pipelining``; issue 16).

Note [pipelining]
    ``with addons.pipelined_execution(steps) as p:`` records the ops created inside, each in the
    stage named by the enclosing ``with p.stage(i):`` (stages 0..S-1, every op in one; stages
    usually sit on IPUs with ``popxl.ipu``). On leaving the block the ops move out of the graph
    into one graph per stage plus one graph holding every ``ipu_copy`` of the region, and the
    graph instead runs the pipeline schedule over ``steps`` micro batches, in cycles:

    * fill:  S-1 cycles; cycle i runs stages 0..i-1;
    * main:  ``steps - S + 1`` cycles, one ``repeat`` of a graph running every stage;
    * flush: S-1 cycles; cycle i runs stages i..S-1.

    A cycle calls its stages in stage order, then the copies graph (except in the last cycle),
    so a value copied from stage s reaches stage s+1 in the next cycle, when s+1 works on the
    same micro batch. Each stage runs ``steps`` times, each copy ``steps + S - 2`` times. A value
    a stage produces and another stage reads is held between cycles (its latest value), as the
    loop-carried tensors of upstream's schedule; a stage reading a value produced in an
    earlier stage without a stash therefore sees a later micro batch's value, exactly as on
    hardware. Activations a gradient stage needs from an earlier stage go through a FIFO
    stash (``stash_and_restore_tensor`` / ``stash_and_restore_activations``): the producing
    stage writes each micro batch's value into a variable of ``to - from + 1`` slots, the
    consuming stage reads them back in order. Anything the stages read from outside the region
    (variables, earlier tensors) is passed by reference, so accumulators add up over the
    micro batches. Host streams loaded or stored inside run once per micro batch (set
    ``ir.num_host_transfers`` to ``steps``). Tensors made inside the region cannot be used
    after it: the region's ops no longer exist in the graph.

    Each stage sees its micro batches in order and the stages run the same ops on them, so a
    pipelined program gives the numbers of the same ops run ``steps`` times in sequence (tests).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from ... import dtypes as _dtypes
from ...ir.context import gcg, in_sequence, ipu
from ...ir.graph import Graph, Op
from ...ir.tensor import Tensor, _fake_like, graph_input, graph_output
from ...opdefs import lookup
from ...ops import dynamic_slice, dynamic_update_, increment_mod_, init
from ...ops.call import CallSiteInfo, call, repeat_with_info
from ...transforms.autodiff import GradGraphInfo
from ..module import Module

__all__ = ["pipelined_execution", "PipelineStages"]

_COPIES = "ipu_copies"  # the unit holding every ipu_copy of the region


def _ipu_transfer(op: Op) -> bool:
    """Whether the op's definition says it moves a value between IPUs (``ipu_copy``)."""
    opdef = lookup(op)
    return opdef is not None and opdef.has("ipu_transfer") and opdef.rule("ipu_transfer")(op)


class Stash(Module):
    """Writes one micro batch's ``t`` into the next slot of a ``stash_size``-slot FIFO."""

    def build(self, t: Tensor, stash_size: int) -> None:
        if stash_size <= 1:
            raise ValueError(f"A stash needs at least 2 slots; got stash_size={stash_size}.")
        with in_sequence(True):
            counter = self.add_variable_input(
                "counter", partial(np.zeros, (1,)), _dtypes.uint32, by_ref=True
            )
            shape = tuple(t.shape) or (1,)
            stash = self.add_variable_input(
                "stash", partial(np.zeros, (stash_size, *shape)), t.dtype, by_ref=True
            )
            dynamic_update_(stash, counter, t.reshape((1, *shape)), axes=[0], sizes=[1],
                            no_overlap=True)  # fmt: skip
            increment_mod_(counter, 1, stash_size)


class Restore(Module):
    """Reads the stash slots back in the order ``Stash`` wrote them."""

    def build(self, stash: Tensor, shape: tuple[int, ...]) -> Tensor:
        with in_sequence(True):
            counter = self.add_variable_input(
                "counter", partial(np.zeros, (1,)), _dtypes.uint32, by_ref=True
            )
            t = dynamic_slice(stash, counter, axes=[0], sizes=[1], no_overlap=True)
            increment_mod_(counter, 1, stash.shape[0])
            return t.reshape(shape)


@dataclass
class PipelineStages:
    """What ``pipelined_execution`` yields: ``stage(i)`` places the ops created inside in stage
    ``i``; the stash helpers carry activations between stages (Note [pipelining])."""

    _graph: Graph
    _stage: int | None = None
    ops: dict[int, list[Op]] = field(default_factory=lambda: defaultdict(list))
    _stage_of: dict[int, int] = field(default_factory=dict)  # id(op) -> stage

    def _hook(self, op: Op) -> None:
        if self._stage is None:
            raise RuntimeError(
                f"pipelined_execution: op {op.name!r} was created outside a stage. Create every "
                "op of the pipelined region inside `with p.stage(i):`."
            )
        self.ops[self._stage].append(op)
        self._stage_of[id(op)] = self._stage

    @contextlib.contextmanager
    def stage(self, i: int) -> Iterator[None]:
        """Place the ops created inside in pipeline stage ``i``."""
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"A pipeline stage must be a non-negative int; got {i!r}.")
        previous, self._stage = self._stage, i
        try:
            yield
        finally:
            self._stage = previous

    def _producer_stage(self, t: Tensor) -> int | None:
        """The stage of the region op that made ``t``; None for a tensor from outside."""
        for op in reversed(self._graph._ops):
            if any(o is t for o in op.outputs) and not any(x is t for x in op.inputs):
                return self._stage_of.get(id(op))
        return None

    def stash_and_restore_tensor(self, t: Tensor, from_stage: int | None = None) -> Tensor:
        """``t`` (made in ``from_stage``, default: its producer's stage) as seen by the current
        stage for the same micro batch, through a FIFO stash of ``current - from + 1`` slots."""
        if from_stage is None:
            from_stage = self._producer_stage(t)
            if from_stage is None:
                raise ValueError(
                    f"stash_and_restore_tensor: {t.id!r} was not made inside a stage of this "
                    "pipeline, so its stage is unknown; pass from_stage=<the stage that makes it>."
                )
        to_stage = self._stage
        if to_stage is None:
            raise RuntimeError("stash_and_restore_tensor must be called in a `p.stage(i)` context.")
        if to_stage <= from_stage:
            raise ValueError(
                f"stash_and_restore_tensor: a stash carries a value to a later stage; got "
                f"from_stage={from_stage} and the current stage {to_stage}."
            )
        place = ipu(t._ipu) if t._ipu is not None else contextlib.nullcontext()
        with self.stage(from_stage), place:
            facts, graph = Stash().create_graph(t, to_stage - from_stage + 1)
            stash_vars = facts.init()
            graph.bind(stash_vars).call(t)
        facts, graph = Restore().create_graph(stash_vars.stash, tuple(t.shape))
        (restored,) = graph.bind(facts.init()).call(stash_vars.stash)
        return restored

    def stash_and_restore_activations(self, call_info: CallSiteInfo,
                                      grad_info: GradGraphInfo) -> dict[Tensor, Tensor]:  # fmt: skip
        """``grad_info.inputs_dict(call_info)`` with every activation made in another stage of
        the pipeline replaced by its stashed-and-restored value (tensors from outside the
        pipeline, such as variables, are passed as they are)."""
        activations = grad_info.inputs_dict(call_info)
        from_stage = self._stage_of.get(id(call_info._op))
        if from_stage is None:
            raise ValueError(
                "stash_and_restore_activations: the forward call was not made inside a stage of "
                "this pipeline."
            )
        if self._stage is None:
            raise RuntimeError(
                "stash_and_restore_activations must be called in a `p.stage(i)` context."
            )
        if self._stage == from_stage:
            return activations
        return {
            gt: act if self._producer_stage(act) is None else self.stash_and_restore_tensor(
                act, from_stage)
            for gt, act in activations.items()
        }  # fmt: skip


@contextlib.contextmanager
def pipelined_execution(steps: int) -> Iterator[PipelineStages]:
    """Run the ops created inside as a pipeline over ``steps`` micro batches; stages are
    annotated with ``with p.stage(i):`` (Note [pipelining]). ``steps`` must be at least twice
    the number of stages."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"pipelined_execution(steps) expects a positive int; got {steps!r}.")
    graph = gcg()
    stages = PipelineStages(graph)
    first = len(graph._ops)
    handle = graph.register_op_created_hook(stages._hook)
    try:
        yield stages
    finally:
        graph.remove_op_created_hook(handle)
    _Pipeline(graph, steps, stages, first).apply()


@dataclass
class _Unit:
    """One stage's graph (or the copies graph) and how it connects to the region's values."""

    graph: Graph
    external: dict[Tensor, Tensor]  # tensor from outside the region -> by-reference input
    carried: dict[Tensor, Tensor]  # value made by another unit -> input
    exported: list[Tensor]  # values other units read, in output order


class _Pipeline:
    def __init__(self, graph: Graph, steps: int, stages: PipelineStages, first: int):
        self.graph, self.steps, self.stages, self.first = graph, steps, stages, first

    def apply(self) -> None:
        region = self.graph._ops[self.first :]
        keys = sorted(self.stages.ops)
        if not keys:
            raise ValueError("pipelined_execution: no op was created inside a stage.")
        if keys != list(range(len(keys))):
            raise ValueError(
                f"pipelined_execution: stages must be numbered 0..S-1 without gaps; got {keys}."
            )
        self.num_stages = len(keys)
        if self.steps < 2 * self.num_stages:
            raise ValueError(
                "Pipelining requires the steps at least 2x the number of stages in the pipeline. "
                f"steps={self.steps} stages={self.num_stages}"
            )
        unit_ops: dict[object, list[Op]] = defaultdict(list)
        for op in region:
            stage = self.stages._stage_of[id(op)]
            unit_ops[_COPIES if _ipu_transfer(op) else stage].append(op)
        producer: dict[Tensor, object] = {}
        for key, ops in unit_ops.items():
            for op in ops:
                for t in op.outputs:
                    if not any(x is t for x in op.inputs):
                        producer[t] = key
        readers: dict[Tensor, set] = defaultdict(set)
        for key, ops in unit_ops.items():
            for op in ops:
                for t in op.inputs:
                    if t in producer and producer[t] != key:
                        readers[t].add(key)
        self.carried = [t for t in producer if readers[t]]  # in order of production
        units = {
            key: self._build_unit(key, ops, producer, readers) for key, ops in unit_ops.items()
        }
        self.units = units
        # All-or-nothing: the graph changes only once every unit graph is complete.
        del self.graph._ops[self.first :]
        self.graph._version += 1
        self._schedule()

    def _build_unit(self, key, ops: list[Op], producer, readers) -> _Unit:
        ir = self.graph.ir
        name = key if key == _COPIES else f"stage_{key}"
        g = ir.create_empty_graph(name)
        new_of: dict[Tensor, Tensor] = {}
        external: dict[Tensor, Tensor] = {}
        carried: dict[Tensor, Tensor] = {}
        cloned: list[Op] = []
        with g:
            for op in ops:
                ins = []
                for t in op.inputs:
                    if t not in new_of:
                        outside = t not in producer
                        new = graph_input(t.shape, t.dtype, t.name, outside, t.meta_shape)
                        new._ipu, new._tile_set = t._ipu, t._tile_set
                        new_of[t] = new
                        (external if outside else carried)[t] = new
                    ins.append(new_of[t])
                outs = []
                for t in op.outputs:
                    if t not in new_of:  # else an in-place op's output: its mapped input
                        new = Tensor._create(g, t.name, _fake_like(t.shape, t.dtype), t.meta_shape)
                        new._ipu, new._tile_set = t._ipu, t._tile_set
                        new_of[t] = new
                    outs.append(new_of[t])
                cloned.append(replace(op, inputs=tuple(ins), outputs=tuple(outs)))
        for op in cloned:
            g._append_op(op)
        exported = [t for t in producer if producer[t] == key and readers.get(t)]
        with g:
            for t in exported:
                graph_output(new_of[t])
        return _Unit(g, external, carried, exported)

    # ---- the schedule -------------------------------------------------------------------------

    def _run_unit(self, key, current: dict[Tensor, Tensor], externals: dict[Tensor, Tensor]):
        unit = self.units.get(key)
        if unit is None:
            return
        inputs = {gt: externals[t] for t, gt in unit.external.items()}
        inputs.update({gt: current[t] for t, gt in unit.carried.items()})
        place = _ipu_of(unit.graph)
        with place:
            outs = call(unit.graph, inputs_dict=inputs)
        for out, inner in zip(outs, unit.graph._outputs, strict=True):
            out._ipu = inner._ipu  # each value stays on its IPU (copies: the destination)
        current.update(zip(unit.exported, outs, strict=True))

    def _cycle(self, start: int, end: int, current, externals) -> None:
        for stage in range(start, end):
            self._run_unit(stage, current, externals)
        if start != self.num_stages - 1:  # the last flush cycle has nothing left to copy
            self._run_unit(_COPIES, current, externals)

    def _schedule(self) -> None:
        S, g = self.num_stages, self.graph
        externals = {t: t for u in self.units.values() for t in u.external}
        with g, in_sequence(True):
            # Values read before the unit that makes them has run start as zeros (upstream's
            # placeholder inputs; nothing reads them for a micro batch that exists).
            current: dict[Tensor, Tensor] = {}
            for t in self.carried:
                with ipu(t._ipu) if t._ipu is not None else contextlib.nullcontext():
                    current[t] = init(t.shape, t.dtype, f"{t.name}_pipeline_init")
            for i in range(1, S):
                self._cycle(0, i, current, externals)
            body = g.ir.create_empty_graph("pipeline_main_cycle")
            with body:
                inner = {t: _input_like(t, False) for t in self.carried}
                inner_ext = {t: _input_like(t, True) for t in externals}
            with body, in_sequence(True):
                loop_current = dict(inner)
                self._cycle(0, S, loop_current, inner_ext)
                for t in self.carried:
                    graph_output(loop_current[t])
            ext_inputs = {inner_ext[t]: t for t in externals}
            with ipu(0):
                info = repeat_with_info(body, self.steps - S + 1,
                                        *[current[t] for t in self.carried],
                                        inputs_dict=ext_inputs)  # fmt: skip
            for out, t in zip(info.outputs, self.carried, strict=True):
                out._ipu = t._ipu
            current.update(zip(self.carried, info.outputs, strict=True))
            for i in range(1, S):
                self._cycle(i, S, current, externals)


def _input_like(t: Tensor, by_ref: bool) -> Tensor:
    new = graph_input(t.shape, t.dtype, t.name, by_ref, t.meta_shape)
    new._ipu, new._tile_set = t._ipu, t._tile_set
    return new


def _ipu_of(graph: Graph):
    """The IPU a stage graph's call site sits on: its tensors' IPU when they agree."""
    placed = {t._ipu for t in graph._tensors.values() if t._ipu is not None}
    return ipu(placed.pop()) if len(placed) == 1 else contextlib.nullcontext()
