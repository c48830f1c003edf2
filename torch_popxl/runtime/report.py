"""Memory and traffic report of a ``Session`` (``session.memory_report()``).

Everything is computed from the IR, per replica for memory and per ``run`` for traffic, and
set next to what the runtime counted during the last ``run`` (``kernels.traffic_counters``),
so the two can be checked against each other.

Traffic per op comes from its op definition (Note [traffic formulas] in
opdefs/collectives.py; remote and host transfers in opdefs/transfers.py). Ops inside called graphs count once per call, and ``repeat_count`` times inside ``repeat``.

Note [peak intermediates]
~~~~~~~~~~~~~~~~~~~~~~~~~
The peak is taken over the main program's op order (the simulator's schedule): an op's
outputs become live when it runs and die after their last reader. Variables, constants and
RTS shards are counted separately, so they are not intermediates. A call adds the callee's
own peak while it runs. Views are counted as copies, so the figure is an upper bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from .. import opdefs
from ..ir.graph import Graph, Op, OpKind, Slot
from ..ir.tensor import Constant, Tensor, Variable
from .cost_model import _COLLECTIVE_KINDS, TRAFFIC_KINDS, CostModel, Workload, workload
from .executor import ReferenceExecutor

if TYPE_CHECKING:
    from .session import Session

__all__ = ["CostModel", "MemoryReport", "TRAFFIC_KINDS", "build_report"]


@dataclass(frozen=True)
class MemoryReport:
    """Per-replica memory and per-run traffic of a session's program.

    Memory fields are bytes on ONE replica. ``traffic`` / ``op_counts`` are per ``run``, bytes
    summed over all replicas, keyed by ``TRAFFIC_KINDS``. ``predicted_counters`` restates them
    with the names of ``kernels.traffic_counters()``; ``measured_counters`` is what the
    runtime counted in the session's last ``run`` (``None`` before the first run, and with the
    reference executor, whose Python collectives do not feed the C++ counters).
    """

    num_replicas: int
    variable_bytes: int
    rts_shard_bytes: int
    constant_bytes: int
    peak_intermediate_bytes: int
    streaming_bytes: int
    buffers: tuple[tuple[int, int, int], ...]  # (remote_buffer_id, entries, slot bytes)
    traffic: Mapping[str, int]
    op_counts: Mapping[str, int]
    flops: int
    predicted_counters: Mapping[str, int]
    measured_counters: Mapping[str, int] | None
    cost_model: CostModel = field(default_factory=CostModel)
    workload: Workload = field(default_factory=lambda: Workload(()))  # what the model prices

    @property
    def on_chip_bytes(self) -> int:
        """Variables + RTS shards + constants + peak live intermediates, per replica."""
        return (
            self.variable_bytes
            + self.rts_shard_bytes
            + self.constant_bytes
            + self.peak_intermediate_bytes
        )

    @property
    def time_breakdown_s(self) -> dict[str, float]:
        return self.cost_model.breakdown(self.workload)

    @property
    def estimated_step_time_s(self) -> float:
        """The cost model's device time for one ``run`` (torch_popxl/runtime/cost_model.py)."""
        return self.cost_model.step_time_s(self.workload)

    def __str__(self) -> str:
        def row(label, *cells) -> str:
            return f"  {label:<34}" + "".join(f"{c:>14}" for c in cells)

        lines = [f"Memory per replica (R={self.num_replicas})".ljust(36) + f"{'bytes':>14}"]
        for label, value in (
            ("on-chip variables", self.variable_bytes),
            ("RTS shards (persistent)", self.rts_shard_bytes),
            ("constants", self.constant_bytes),
            ("peak live intermediates", self.peak_intermediate_bytes),
            ("on-chip total", self.on_chip_bytes),
            ("streaming memory (remote buffers)", self.streaming_bytes),
        ):
            lines.append(row(label, f"{value:,}"))
        lines += ["", "Traffic per run (all replicas)".ljust(36) + f"{'ops':>14}{'bytes':>14}"]
        for kind in TRAFFIC_KINDS:
            lines.append(row(kind, self.op_counts[kind], f"{self.traffic[kind]:,}"))
        lines += ["", "Counters".ljust(36) + f"{'IR':>14}{'runtime':>14}"]
        measured = self.measured_counters
        for name, value in self.predicted_counters.items():
            lines.append(
                row(name, f"{value:,}", "-" if measured is None else f"{measured[name]:,}")
            )
        lines += ["", f"Estimated step time (matmul FLOPs per replica: {self.flops:,})".ljust(36)
                  + f"{'us':>14}"]  # fmt: skip
        for phase, seconds in self.time_breakdown_s.items():
            lines.append(row(phase, f"{seconds * 1e6:.3f}"))
        lines.append(row("total", f"{self.estimated_step_time_s * 1e6:.3f}"))
        return "\n".join(lines)


# ---- building the report ------------------------------------------------------------------


def _bytes(t: Tensor) -> int:
    return math.prod(t.shape) * _itemsize(t.dtype)


def _itemsize(dt) -> int:
    tdt = dt.as_torch()
    return tdt.itemsize if tdt is not None else 1


def build_report(session: Session, cost_model: CostModel | None = None) -> MemoryReport:
    """The report for ``session`` (see ``Session.memory_report``)."""

    ir = session.ir
    R = ir.instance_replication_factor
    on_chip, defined = session._executor.on_chip, session._executor.defined
    main = ir.main_graph
    persistent = {t.id for t in defined}
    constants = {id(c): c for g in ir.graphs for c in g.constants}
    buffers = tuple(
        (rb.remote_buffer_id, rb.entries, math.prod(rb.tensor_shape) * _itemsize(rb.tensor_dtype))
        for rb in ir._remote_buffers
    )
    counter = _TrafficCounter(R)
    counter.count(main._ops_in_context("normal"), 1)
    traffic = {k: counter.bytes[k] for k in TRAFFIC_KINDS}
    counts = {k: counter.calls[k] for k in TRAFFIC_KINDS}
    predicted = {
        "collective_bytes": sum(traffic[k] for k in _COLLECTIVE_KINDS),
        "remote_load_bytes": traffic["remote_load"],
        "remote_store_bytes": traffic["remote_store"],
        "host_bytes": traffic["host_to_device"] + traffic["device_to_host"],
        "num_collectives": sum(counts[k] for k in _COLLECTIVE_KINDS),
        "num_remote_loads": counts["remote_load"],
        "num_remote_stores": counts["remote_store"],
    }
    measured = getattr(session, "_last_run_counters", None)
    if isinstance(session._executor, ReferenceExecutor):
        measured = None
    return MemoryReport(
        num_replicas=R,
        variable_bytes=sum(_bytes(v) for v in on_chip),
        rts_shard_bytes=sum(_bytes(t) for t in defined),
        constant_bytes=sum(_bytes(c) for c in constants.values()),
        peak_intermediate_bytes=_Liveness(persistent).peak(main, main._ops_in_context("normal")),
        streaming_bytes=sum(entries * slot for _, entries, slot in buffers),
        buffers=buffers,
        traffic=MappingProxyType(traffic),
        op_counts=MappingProxyType(counts),
        flops=counter.flops,
        predicted_counters=MappingProxyType(predicted),
        measured_counters=None if measured is None else MappingProxyType(dict(measured)),
        cost_model=cost_model or CostModel(),
        workload=workload(ir),
    )


def _arg(op: Op, i: int) -> Tensor:
    a = op.attrs.args[i]
    assert isinstance(a, Slot), f"{op.name}: argument {i} is not a tensor"
    return op.inputs[a.index]


# The tensor argument whose last dim is the contraction size K, per matmul-like aten op.
_MATMUL_K_ARG = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1, "mv": 0, "dot": 0}


class _TrafficCounter:
    def __init__(self, num_replicas: int):
        self.R = num_replicas
        self.bytes = dict.fromkeys(TRAFFIC_KINDS, 0)
        self.calls = dict.fromkeys(TRAFFIC_KINDS, 0)
        self.flops = 0
        self._ops = torch.ops.torch_popxl

    def add(self, kind: str, nbytes: int, times: int) -> None:
        self.bytes[kind] += nbytes * times
        self.calls[kind] += times

    def count(self, ops, times: int) -> None:
        for op in ops:
            if op.kind in (OpKind.CALL, OpKind.REPEAT):
                self.count(op.attrs.graph._ops, times * op.attrs.repeat_count)
                continue
            opdef = opdefs.lookup(op)
            if opdef is not None:
                traffic = opdef.traffic(op, self.R)
                self.add(traffic.kind, traffic.total_bytes, times)
            elif op.kind == OpKind.TORCH and getattr(op.attrs.target, "namespace", None) == "aten":
                k_arg = _MATMUL_K_ARG.get(op.attrs.target._schema.name.split("::")[-1])
                if k_arg is not None:
                    k = _arg(op, k_arg).shape[-1]
                    self.flops += 2 * max(1, math.prod(op.outputs[0].shape)) * k * times


class _Liveness:
    """Peak bytes of live intermediates over a graph's op order (Note [peak intermediates])."""

    def __init__(self, persistent: set[str]):
        self.persistent = persistent
        self._callee_peaks: dict[int, int] = {}

    def _is_intermediate(self, t: Tensor, graph: Graph) -> bool:
        if isinstance(t, Variable | Constant) or t.id in self.persistent:
            return False
        return all(t.id != x.id for x in graph._inputs)

    def peak(self, graph: Graph, ops: list[Op]) -> int:
        last_use: dict[str, int] = {}
        for i, op in enumerate(ops):
            for t in op.inputs:
                last_use[t.id] = i
        for t in graph._outputs:
            last_use[t.id] = len(ops)
        live: dict[str, int] = {}
        total = peak = 0
        for i, op in enumerate(ops):
            if op.kind in (OpKind.CALL, OpKind.REPEAT):
                peak = max(peak, total + self._callee_peak(op.attrs.graph))
            for t in op.outputs:
                if t.id not in live and self._is_intermediate(t, graph):
                    live[t.id] = _bytes(t)
                    total += live[t.id]
            peak = max(peak, total)
            for tid in [tid for tid in live if last_use.get(tid, i) <= i]:
                total -= live.pop(tid)
        return peak

    def _callee_peak(self, graph: Graph) -> int:
        key = id(graph)
        if key not in self._callee_peaks:
            self._callee_peaks[key] = self.peak(graph, graph._ops)
        return self._callee_peaks[key]
