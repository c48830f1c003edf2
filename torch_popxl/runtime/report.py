"""Memory and traffic report of a program (``Session.memory_report()``).

``build_report`` takes what it reads explicitly: the program (``Ir``), what the executor says
about it (``executor.ExecutorFacts``: on-chip variables, RTS shards defined by
WeightsFromHost, whether traffic is measured) and the last run's counters; it never looks
inside a ``Session``.

Everything is computed from the IR, per replica for memory and per ``run`` for traffic, and
set next to what the runtime counted during the last ``run`` (``backends.traffic_counters``),
so the two can be checked against each other.

Traffic per op comes from its op definition's ``traffic`` rule (Note [traffic formulas] in
opdefs/registry.py; each op's formula in its stanza under opdefs/). Ops inside called graphs
count once per call, and ``repeat_count`` times inside ``repeat``.

Note [peak intermediates]
~~~~~~~~~~~~~~~~~~~~~~~~~
The peak is taken over the main program's op order (the simulator's schedule): an op's
outputs become live when it runs and die after their last reader. Variables, constants and
RTS shards are counted separately, so they are not intermediates. A call adds the callee's
own peak while it runs. The output of a captured view op (``detach``, ``t``, ``view``: an
alias that writes nothing, ``cost_model._is_view``) adds no bytes; it keeps its base alive
as long as it is read. Other aliasing (in-place ops returning a new handle) is counted as a
copy, so the figure is an upper bound.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from .. import dtypes as _dtypes
from ..ir.graph import Graph, Op, OpKind
from ..ir.tensor import Constant, Tensor, Variable
from ..ir.walk import Interpreter, effects
from .cost_model import (
    _COLLECTIVE_KINDS,
    TRAFFIC_KINDS,
    CostModel,
    Workload,
    _is_view,
    workload,
    workload_of_ops,
)

if TYPE_CHECKING:
    from ..ir.ir import Ir
    from .executor import ExecutorFacts

__all__ = [
    "CostModel",
    "IpuMemory",
    "MemoryReport",
    "PhaseMemory",
    "TRAFFIC_KINDS",
    "build_report",
    "format_bytes",
    "format_seconds",
    "ipu_memory",
]


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``136 B``, ``785.0 KiB``, ``7.11 MiB``, ``1.50 GiB``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if abs(n) < 1024 * scale or unit == "TiB":
            value = n / scale
            return f"{value:.1f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    """A duration in ns / µs / ms / s with 3-4 significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.1f} {unit}"
    return f"{s * 1e9:.1f} ns"


def _format_rate(name: str, value: float) -> str:
    """A cost-model setting for people: ``replica links 64 GB/s``, ``60 TFLOP/s``."""
    label = name.removesuffix("_bytes_per_s").removesuffix("_per_s").removesuffix("_s")
    label = label.replace("_", " ")
    if name.endswith("bytes_per_s"):
        if value >= 1e12:
            return f"{label} {value / 1e12:.3g} TB/s"
        return f"{label} {value / 1e9:.3g} GB/s"
    if name.endswith("flops_per_s"):
        return f"{value / 1e12:.3g} TFLOP/s"
    if name.endswith("_s"):
        return f"{label} {format_seconds(value)}"
    if name.endswith("_flops"):
        return f"{label} {value / 1e6:.3g} MFLOP"
    return f"{label} {value:g}"


def _wrap_items(first: str, items: list[str], last: str, width: int) -> list[str]:
    """``first + ", ".join(items) + last`` in lines of at most ``width``, breaking between
    items only (a setting and its unit stay on one line)."""
    lines, line = [], first
    for i, item in enumerate(items):
        piece = item + (last if i == len(items) - 1 else ",")
        if len(line) + len(piece) + 1 > width and line.strip():
            lines.append(line.rstrip())
            line = "   "
        line += piece + " "
    lines.append(line.rstrip())
    return lines


# How the report names traffic kinds and cost-model phases for people (keys stay as they are
# in ``traffic`` / ``time_breakdown_s``; a phase the cost model adds later shows its own key).
_TRAFFIC_LABELS = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "local_slice": "local slices (no traffic)",
    "remote_load": "loads",
    "remote_store": "stores",
    "host_to_device": "host to device",
    "device_to_host": "device to host",
    "ipu_copy": "ipu_copy (between the IPUs of a replica)",
}
_TRAFFIC_GROUPS = (
    ("replica links (collectives)", _COLLECTIVE_KINDS),
    ("streaming memory", ("remote_load", "remote_store")),
    ("host", ("host_to_device", "device_to_host")),
    ("IPU links (popxl.ipu placement)", ("ipu_copy",)),
)
_PHASE_LABELS = {
    "compute": "compute (matmuls and other ops)",
    "replica_links": "replica links",
    "streaming_memory": "streaming memory",
    "host_io": "host transfers",
    "ipu_links": "IPU links (ipu_copy)",
}


@dataclass(frozen=True)
class MemoryReport:
    """Per-replica memory and per-run traffic of a session's program.

    ``print(report)`` gives a table for people (human units, where state lives, what sharding
    and off-chip state saved, the modeled time split); ``report.to_dict()`` the same figures
    as plain numbers; ``report.plot()`` a chart; ``report.format(counters=True)`` adds the
    runtime's own counters.

    Memory fields are bytes on ONE replica. ``traffic`` / ``op_counts`` are per ``run``, bytes
    summed over all replicas, keyed by ``TRAFFIC_KINDS``. ``predicted_counters`` restates them
    with the names of ``backends.traffic_counters()``; ``measured_counters`` is what the
    runtime counted in the session's last ``run`` (``None`` before the first run, and with the
    reference executor, whose Python collectives do not feed the C++ counters).

    Streaming memory splits into ``sharded_streaming_bytes`` (replica-sharded state kept
    off-chip), ``backing_streaming_bytes`` (the streaming-memory home of on-chip RTS shards,
    ``replica_sharded_variable``) and the rest, unsharded. ``rts_saved_bytes`` is what
    sharding saves per replica against full copies; ``shard_counts`` the distinct numbers of
    replicas a tensor is sharded over.
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
    sharded_streaming_bytes: int = 0
    backing_streaming_bytes: int = 0
    rts_saved_bytes: int = 0
    shard_counts: tuple[int, ...] = ()
    # (graph id, where its code lives, remote_code_load sites) for the called and loaded
    # subgraphs, once the program uses ops.remote_code_load; empty otherwise.
    code_locations: tuple[tuple[str, str, int], ...] = ()
    # Per IPU of one replica, for programs placed with ``popxl.ipu`` (empty otherwise).
    ipu_memory: tuple[IpuMemory, ...] = ()
    # Per-phase live memory and streaming traffic of a phased program (Note [phases]); empty
    # when no main-program op was recorded inside a ``name_scope``.
    phases: tuple[PhaseMemory, ...] = ()

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
    def persistent_on_chip_bytes(self) -> int:
        """What is on chip during every phase: variables, RTS shards and constants."""
        return self.variable_bytes + self.rts_shard_bytes + self.constant_bytes

    @property
    def unsharded_streaming_bytes(self) -> int:
        """Streaming memory holding full (unsharded) copies, per replica."""
        return self.streaming_bytes - self.sharded_streaming_bytes - self.backing_streaming_bytes

    @property
    def offchip_bytes(self) -> int:
        """State kept off-chip instead of on chip (excludes the backing copies of on-chip
        shards, which the on-chip program also has), per replica."""
        return self.sharded_streaming_bytes + self.unsharded_streaming_bytes

    @property
    def unsharded_on_chip_bytes(self) -> int:
        """On-chip bytes of the same program with every tensor unsharded and on chip, per
        replica (intermediates counted as they are now)."""
        return self.on_chip_bytes + self.rts_saved_bytes + self.offchip_bytes

    @property
    def time_breakdown_s(self) -> dict[str, float]:
        return self.cost_model.breakdown(self.workload)

    @property
    def estimated_step_time_s(self) -> float:
        """The cost model's device time for one ``run`` (torch_popxl/runtime/cost_model.py)."""
        return self.cost_model.step_time_s(self.workload)

    def _shard_label(self) -> str:
        counts = self.shard_counts
        return f"1/{counts[0]} on each replica" if len(counts) == 1 else "split over replicas"

    def savings_summary(self) -> str:
        """One sentence: what sharding and off-chip state saved against the same program
        unsharded and on chip."""
        base = self.unsharded_on_chip_bytes
        if base == self.on_chip_bytes:
            return "Nothing is sharded or off-chip: every tensor is a full copy on chip."
        saved = 1 - self.on_chip_bytes / base if base else 0.0
        return (
            f"RTS saves {format_bytes(self.rts_saved_bytes)} per replica; off-chip moves "
            f"{format_bytes(self.offchip_bytes)} to streaming memory. On chip: "
            f"{format_bytes(self.on_chip_bytes)} instead of {format_bytes(base)} "
            f"({saved:.0%} less)."
        )

    def format(self, counters: bool = False) -> str:
        """The report as text; ``counters=True`` adds the IR-predicted and runtime-counted
        traffic counters (they agree; tests check it), for debugging the simulator."""
        width = 48

        def row(label: str, *cells: str, indent: int = 2) -> str:
            return (" " * indent + label).ljust(width) + "".join(f"{c:>14}" for c in cells)

        def mem(label: str, value: int, indent: int = 4, always: bool = True) -> list[str]:
            return [row(label, format_bytes(value), indent=indent)] if always or value else []

        R = self.num_replicas
        lines = [
            f"Memory per replica ({R} replica{'s' if R != 1 else ''}; KiB/MiB = 2^10/2^20 bytes)"
        ]
        lines += [row("on chip", format_bytes(self.on_chip_bytes))]
        lines += mem("variables (a full copy on every replica)", self.variable_bytes)
        lines += mem(f"sharded variables (RTS, {self._shard_label()})", self.rts_shard_bytes,
                     always=False)  # fmt: skip
        lines += mem("constants", self.constant_bytes)
        lines += mem("peak live intermediates (upper bound)", self.peak_intermediate_bytes)
        lines += [row("streaming memory (off-chip)", format_bytes(self.streaming_bytes))]
        lines += mem(f"sharded state (RTS, {self._shard_label()})", self.sharded_streaming_bytes,
                     always=False)  # fmt: skip
        lines += mem("unsharded state", self.unsharded_streaming_bytes, always=False)
        lines += mem("home of the on-chip RTS shards", self.backing_streaming_bytes,
                     always=False)  # fmt: skip
        lines += self._ipu_lines(row)
        lines += ["", "Against the same program unsharded and on chip:"]
        lines += textwrap.wrap(self.savings_summary(), 88, initial_indent="  ",
                               subsequent_indent="  ")  # fmt: skip

        lines += ["", row(f"Traffic per run (all {R} replicas)", "ops", "bytes", indent=0)]
        for group, kinds in _TRAFFIC_GROUPS:
            if kinds == ("ipu_copy",) and not self.op_counts["ipu_copy"]:
                continue  # a program on one IPU: no copies to show
            lines.append(row(group, "", format_bytes(sum(self.traffic[k] for k in kinds))))
            for kind in kinds:
                lines.append(
                    row(
                        _TRAFFIC_LABELS[kind],
                        str(self.op_counts[kind]),
                        format_bytes(self.traffic[kind]),
                        indent=4,
                    )  # fmt: skip
                )

        total = self.estimated_step_time_s
        settings = [
            _format_rate(f.name, getattr(self.cost_model, f.name))
            for f in dataclasses.fields(self.cost_model)
        ]
        lines += ["", row("Modeled device time per run", "time", "share", indent=0)]
        lines += _wrap_items(
            f"  (cost model of one {self.cost_model.device} per replica: ",
            settings,
            "; docs/cost_model.md)",
            88,
        )
        for phase, seconds in self.time_breakdown_s.items():
            if phase in ("io_tile_overlap", "ipu_links") and seconds == 0:
                continue  # nothing ran on IO tiles / no copies between IPUs
            label = _PHASE_LABELS.get(phase, phase.replace("_", " "))
            share = f"{seconds / total:.0%}" if total else "-"
            lines.append(row(label, format_seconds(seconds), share))
        lines.append(row("total", format_seconds(total), ""))
        flops = f"{self.flops / 1e6:,.1f} MFLOP" if self.flops >= 1e6 else f"{self.flops:,} FLOP"
        lines.append(f"  ({flops} of matmuls per replica)")

        lines += self._code_location_lines()
        if self.phases:
            lines += ["", *_format_phases(self.phases, self.persistent_on_chip_bytes, R)]

        if counters:
            measured = self.measured_counters
            lines += ["", row("Counters (IR vs runtime)", "IR", "runtime", indent=0)]
            for name, value in self.predicted_counters.items():
                lines.append(
                    row(name, f"{value:,}", "-" if measured is None else f"{measured[name]:,}")
                )
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.format()

    def _code_location_lines(self) -> list[str]:
        """Where each subgraph's code lives (PopXL guide, "Code loading"): a graph that
        ``remote_code_load`` names is kept in streaming memory and loaded before its calls;
        every other called graph stays in executable memory for the whole program."""
        if not self.code_locations:
            return []
        lines = ["", "Code location (ops.remote_code_load)"]
        for graph_id, where, loads in self.code_locations:
            detail = f"; loaded by {loads} remote_code_load op{'s' if loads != 1 else ''}"
            lines.append(f"  {graph_id}".ljust(48) + where + (detail if loads else ""))
        return lines

    def _ipu_lines(self, row) -> list[str]:
        """The per-IPU split of the on-chip memory (Note [memory per IPU])."""
        if not self.ipu_memory:
            return []
        lines = ["", row("On chip per IPU (one replica)", "variables", "peak live", "total",
                         indent=0)]  # fmt: skip
        for m in self.ipu_memory:
            lines.append(
                row(f"IPU {m.ipu}", format_bytes(m.variable_bytes),
                    format_bytes(m.peak_intermediate_bytes), format_bytes(m.on_chip_bytes))
            )  # fmt: skip
        return lines

    def to_dict(self) -> dict:
        """Every figure as plain numbers (bytes, seconds), ready for ``json.dumps``."""
        breakdown = self.time_breakdown_s
        return {
            "num_replicas": self.num_replicas,
            "memory_per_replica_bytes": {
                "on_chip": self.on_chip_bytes,
                "variables": self.variable_bytes,
                "rts_shards": self.rts_shard_bytes,
                "constants": self.constant_bytes,
                "peak_intermediates": self.peak_intermediate_bytes,
                "streaming": self.streaming_bytes,
                "streaming_sharded": self.sharded_streaming_bytes,
                "streaming_unsharded": self.unsharded_streaming_bytes,
                "streaming_home_of_on_chip_shards": self.backing_streaming_bytes,
            },
            "savings_per_replica_bytes": {
                "unsharded_on_chip": self.unsharded_on_chip_bytes,
                "rts_saved": self.rts_saved_bytes,
                "moved_off_chip": self.offchip_bytes,
            },
            "shard_counts": list(self.shard_counts),
            "code_locations": {g: {"location": w, "loads": n} for g, w, n in self.code_locations},
            "memory_per_ipu_bytes": {
                str(m.ipu): {
                    "on_chip": m.on_chip_bytes,
                    "variables": m.variable_bytes,
                    "peak_intermediates": m.peak_intermediate_bytes,
                }
                for m in self.ipu_memory
            },  # fmt: skip
            "traffic_per_run_bytes": dict(self.traffic),
            "ops_per_run": dict(self.op_counts),
            "matmul_flops_per_replica": self.flops,
            "modeled_time_s": {**breakdown, "total": sum(breakdown.values())},
            "cost_model": dataclasses.asdict(self.cost_model),
            "counters": {
                "ir": dict(self.predicted_counters),
                "runtime": None if self.measured_counters is None else dict(self.measured_counters),
            },
            "phases": [dataclasses.asdict(p) for p in self.phases],
        }

    def plot(self, path: str | os.PathLike | None = None, title: str | None = None):
        """A ``matplotlib`` figure: memory per replica now and unsharded on chip, and the
        modeled time split. Saved to ``path`` when given; returned either way.

        Needs matplotlib (``pip install 'torch_popxl[examples]'``).
        """
        try:
            # Optional dependency, so imported on use; the Figure API needs no GUI backend.
            mfigure = importlib.import_module("matplotlib.figure")
        except ImportError as e:
            raise ImportError(
                "MemoryReport.plot() needs matplotlib, which is not installed. Install it with "
                "pip install matplotlib (or pip install 'torch_popxl[examples]')."
            ) from e
        fig = mfigure.Figure(figsize=(11, 4.2))
        ax_mem, ax_time = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.2, 1]})
        mib = 2**20
        parts = (
            ("full-copy variables", self.variable_bytes, self.variable_bytes),
            ("RTS shards", self.rts_shard_bytes, 0),
            ("constants + peak intermediates",
             self.constant_bytes + self.peak_intermediate_bytes,
             self.constant_bytes + self.peak_intermediate_bytes),
            ("sharded + off-chip state as full copies", 0,
             self.unsharded_on_chip_bytes - self.on_chip_bytes + self.rts_shard_bytes),
        )  # fmt: skip
        columns = ("on chip now", "unsharded,\non chip", "streaming\nmemory now")
        bottoms = [0.0, 0.0, 0.0]
        for label, now, base in parts:
            values = [now / mib, base / mib, 0.0]
            ax_mem.bar(columns, values, bottom=bottoms, label=label)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        for label, value in (
            ("sharded state", self.sharded_streaming_bytes),
            ("unsharded state", self.unsharded_streaming_bytes),
            ("home of on-chip shards", self.backing_streaming_bytes),
        ):
            ax_mem.bar(columns[2], value / mib, bottom=bottoms[2], label=label)
            bottoms[2] += value / mib
        ax_mem.set_ylabel("MiB per replica")
        ax_mem.set_title("Memory per replica")
        ax_mem.legend(fontsize=7)
        breakdown = self.time_breakdown_s
        labels = [_PHASE_LABELS.get(k, k.replace("_", " ")) for k in breakdown]
        ax_time.barh(labels, [v * 1e6 for v in breakdown.values()], color="tab:orange")
        ax_time.invert_yaxis()
        ax_time.set_xlabel("µs per run (cost model)")
        ax_time.set_title(
            f"Modeled time on one {self.cost_model.device}: "
            f"{format_seconds(self.estimated_step_time_s)}",
            fontsize=9,
        )
        fig.suptitle(title or f"{self.num_replicas} replicas: {self.savings_summary()}", fontsize=9)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=110)
        return fig


# ---- building the report ------------------------------------------------------------------


def build_report(
    ir: Ir,
    facts: ExecutorFacts,
    last_run_counters: Mapping[str, int] | None,
    cost_model: CostModel | None = None,
) -> MemoryReport:
    """The report for ``ir`` run by an executor that says ``facts``; ``last_run_counters``
    are the traffic counters of the last run (None before the first). See
    ``Session.memory_report``."""

    R = ir.instance_replication_factor
    on_chip, defined = facts.on_chip, facts.defined
    main = ir.main_graph
    persistent = {t.id for t in defined}
    constants = {id(c): c for g in ir.graphs for c in g.constants}
    buffers = tuple(
        (
            rb.remote_buffer_id,
            rb.entries,
            math.prod(rb.tensor_shape) * _dtypes.itemsize(rb.tensor_dtype),
        )
        for rb in ir._remote_buffers
    )
    # One walk of the program (the cost model's workload, per replica) gives the traffic too.
    work = workload(ir)
    traffic = {k: round(work.nbytes(k) * R) for k in TRAFFIC_KINDS}
    counts = {k: work.count(k) for k in TRAFFIC_KINDS}
    predicted = {
        "collective_bytes": sum(traffic[k] for k in _COLLECTIVE_KINDS),
        "remote_load_bytes": traffic["remote_load"],
        "remote_store_bytes": traffic["remote_store"],
        "host_bytes": traffic["host_to_device"] + traffic["device_to_host"],
        "num_collectives": sum(counts[k] for k in _COLLECTIVE_KINDS),
        "num_remote_loads": counts["remote_load"],
        "num_remote_stores": counts["remote_store"],
    }
    placement = _buffer_placement(ir, main)
    phases = _phases(ir, main._ops_in_context("normal"), persistent, cost_model or CostModel())
    measured = last_run_counters if facts.measures_traffic else None
    return MemoryReport(
        num_replicas=R,
        variable_bytes=sum(_dtypes.nbytes(v.shape, v.dtype) for v in on_chip),
        rts_shard_bytes=sum(_dtypes.nbytes(t.shape, t.dtype) for t in defined),
        constant_bytes=sum(_dtypes.nbytes(c.shape, c.dtype) for c in constants.values()),
        peak_intermediate_bytes=_Liveness(persistent).peak(main, main._ops_in_context("normal")),
        streaming_bytes=sum(entries * slot for _, entries, slot in buffers),
        buffers=buffers,
        traffic=MappingProxyType(traffic),
        op_counts=MappingProxyType(counts),
        flops=round(work.flops),
        predicted_counters=MappingProxyType(predicted),
        measured_counters=None if measured is None else MappingProxyType(dict(measured)),
        cost_model=cost_model or CostModel(),
        workload=work,
        code_locations=_code_locations(ir),
        ipu_memory=ipu_memory(ir, [*on_chip, *defined], persistent),
        phases=phases,
        **placement,
    )


# Where code lives, in the words of the report.
CODE_IN_STREAMING_MEMORY = "streaming memory, loaded into executable memory"
CODE_ALWAYS_LIVE = "executable memory (always live)"


def _code_locations(ir) -> tuple[tuple[str, str, int], ...]:
    """(graph id, location, load sites) of every called or loaded subgraph, in creation order;
    empty for a program without ``remote_code_load`` (whose code is all resident)."""
    if not ir._code_loads:
        return ()
    loads: dict[int, int] = {}
    for _, graph, _ in ir._code_loads:
        loads[id(graph)] = loads.get(id(graph), 0) + 1
    called = {id(c) for g in ir.graphs for c in g.called_graphs}
    rows = []
    for g in ir.graphs:
        if id(g) in loads:
            rows.append((g.id, CODE_IN_STREAMING_MEMORY, loads[id(g)]))
        elif id(g) in called:
            rows.append((g.id, CODE_ALWAYS_LIVE, 0))
    return tuple(rows)


def _buffer_placement(ir, main: Graph) -> dict:
    """Which streaming memory holds sharded state, which is the home of on-chip RTS shards
    (loaded in WeightsFromHost), and what sharding saves against full copies, per replica."""
    shard_over: dict[int, int] = {}
    for v in ir._all_variables:
        remote, layout = v.info.remote, v.info.shard
        if remote is not None and layout is not None:
            shard_over[id(remote[0])] = layout.shard_over
    homes = {
        id(op.attrs.buffer)
        for op in main._ops_in_context("weights_from_host")
        if effects(op).reads_buffer
    }
    sharded = backing = saved = 0
    for rb in ir._remote_buffers:
        itemsize = _dtypes.itemsize(rb.tensor_dtype)
        slot = math.prod(rb.tensor_shape) * itemsize
        if id(rb) not in shard_over and not rb.meta_shape:
            continue
        full = math.prod(rb.meta_shape or rb.tensor_shape) * itemsize
        saved += rb.entries * max(0, full - slot)
        if id(rb) in homes:
            backing += rb.entries * slot
        else:
            sharded += rb.entries * slot
    return {
        "sharded_streaming_bytes": sharded,
        "backing_streaming_bytes": backing,
        "rts_saved_bytes": saved,
        "shard_counts": tuple(sorted(set(shard_over.values()))),
    }


class _Liveness(Interpreter[None]):
    """Peak bytes of live intermediates over a graph's op order (Note [peak intermediates]).

    A walk of one graph (``ir.walk.Interpreter``) that carries no values: each op's outputs
    become live, a call or repeat first adds its callee's own peak (one walk per callee graph,
    shared by every call site), and values die after their last reader."""

    def __init__(self, persistent: set[str], callee_peaks: dict[int, int] | None = None):
        self.persistent = persistent
        self._callee_peaks: dict[int, int] = {} if callee_peaks is None else callee_peaks

    def peak(self, graph: Graph, ops: list[Op]) -> int:
        self.graph = graph
        self.last_use: dict[str, int] = {}
        for i, op in enumerate(ops):
            for t in op.inputs:
                self.last_use[t.id] = i
        for t in graph._outputs:
            self.last_use[t.id] = len(ops)
        # A view aliases its base: it adds no bytes and its reads keep the base alive.
        self.alias: dict[str, str] = {}
        for op in ops:
            if op.kind == OpKind.TORCH and op.inputs and op.outputs and _is_view(op.attrs.target):
                base = op.inputs[0].id
                base = self.alias.get(base, base)
                for t in op.outputs:
                    self.alias[t.id] = base
        for view, base in self.alias.items():
            if view in self.last_use:
                self.last_use[base] = max(self.last_use.get(base, -1), self.last_use[view])
        self.live: dict[str, int] = {}
        self.index = self.total = self.max = 0
        self.run(ops, {})
        return self.max

    def op(self, op: Op, ins: list[None], env) -> list[None]:
        for t in op.outputs:
            if t.id not in self.live and t.id not in self.alias and self._is_intermediate(t):
                self.live[t.id] = _dtypes.nbytes(t.shape, t.dtype)
                self.total += self.live[t.id]
        self.max = max(self.max, self.total)
        i = self.index
        for tid in [tid for tid in self.live if self.last_use.get(tid, i) <= i]:
            self.total -= self.live.pop(tid)
        self.index += 1
        return [None] * len(op.outputs)

    def call(self, op: Op, ins: list[None]) -> list[None]:
        self.max = max(self.max, self.total + self._callee_peak(op.attrs.graph))
        return self.op(op, ins, {})

    repeat = call

    def constant(self, t: Constant) -> None:
        return None

    def unbound(self, t: Tensor) -> None:
        return None

    def _is_intermediate(self, t: Tensor) -> bool:
        if isinstance(t, Variable | Constant) or t.id in self.persistent:
            return False
        return all(t.id != x.id for x in self.graph._inputs)

    def _callee_peak(self, graph: Graph) -> int:
        key = id(graph)
        if key not in self._callee_peaks:
            walk = _Liveness(self.persistent, self._callee_peaks)
            self._callee_peaks[key] = walk.peak(graph, graph._ops)
        return self._callee_peaks[key]


# ---- memory per IPU ---------------------------------------------------------------------------
#
# Note [memory per IPU]
# ~~~~~~~~~~~~~~~~~~~~~
# A program placed with ``popxl.ipu(n)`` splits each replica over several IPUs. A tensor lives on
# the IPU it was created on (``Tensor._ipu``); one created outside any ``popxl.ipu`` context
# lives where the op that uses it runs: inside a called graph, the IPU of the call site (the
# first placed output or input of the call), and IPU 0 in the main graph. Variables (pipeline
# stashes included) and RTS shards count on their IPU; constants are left out (PopXL places a
# copy on each IPU that reads one). The peak of live intermediates is taken per IPU over the
# same schedule as the whole-replica peak (Note [peak intermediates]): each IPU's own maximum,
# reached at its own moment, so the per-IPU peaks may add up to more than the replica's.


@dataclass(frozen=True)
class IpuMemory:
    """On-chip bytes of one IPU of a replica: variables (and RTS shards) placed on it and the
    peak of its live intermediates (Note [memory per IPU])."""

    ipu: int
    variable_bytes: int
    peak_intermediate_bytes: int

    @property
    def on_chip_bytes(self) -> int:
        return self.variable_bytes + self.peak_intermediate_bytes


def _uses_ipus(ir) -> bool:
    return any(t._ipu is not None for g in ir.graphs for t in g._tensors.values())


def ipu_memory(ir, on_chip: list[Tensor], persistent: set[str]) -> tuple[IpuMemory, ...]:
    """Per-IPU on-chip memory of ``ir``'s program, one entry per IPU in use, or ``()`` when
    no tensor was placed with ``popxl.ipu`` (Note [memory per IPU]). ``on_chip``: the
    variables and RTS shards the device holds; ``persistent``: ids that are not intermediates."""
    if not _uses_ipus(ir):
        return ()
    main = ir.main_graph
    variables: dict[int, int] = {}
    for v in {t.id: t for t in on_chip}.values():
        ipu = 0 if v._ipu is None else v._ipu
        variables[ipu] = variables.get(ipu, 0) + _dtypes.nbytes(v.shape, v.dtype)
    peaks = _IpuLiveness(persistent).peaks(main, main._ops_in_context("normal"), 0)
    ipus = sorted(set(variables) | set(peaks))
    return tuple(IpuMemory(i, variables.get(i, 0), peaks.get(i, 0)) for i in ipus)


class _IpuLiveness(_Liveness):
    """``_Liveness`` with one running total per IPU (Note [memory per IPU]): the same op
    order, last uses and view aliases; only the bookkeeping of live bytes is per IPU."""

    def __init__(self, persistent: set[str], callee_peaks: dict | None = None):
        super().__init__(persistent)
        self._ipu_peaks: dict[tuple[int, int], dict[int, int]] = (
            {} if callee_peaks is None else callee_peaks
        )

    def peaks(self, graph: Graph, ops: list[Op], default_ipu: int) -> dict[int, int]:
        self.default_ipu = default_ipu
        self.placed: dict[str, tuple[int, int]] = {}  # live id -> (ipu, bytes)
        self.totals: dict[int, int] = {}
        self.maxima: dict[int, int] = {}
        self.peak(graph, ops)
        return self.maxima

    def _ipu_of(self, t: Tensor) -> int:
        return self.default_ipu if t._ipu is None else t._ipu

    def _note(self, extra: dict[int, int] | None = None) -> None:
        extra = extra or {}
        for ipu in set(self.totals) | set(extra):
            now = self.totals.get(ipu, 0) + extra.get(ipu, 0)
            self.maxima[ipu] = max(self.maxima.get(ipu, 0), now)

    def op(self, op: Op, ins: list[None], env) -> list[None]:
        for t in op.outputs:
            if t.id not in self.placed and t.id not in self.alias and self._is_intermediate(t):
                ipu, n = self._ipu_of(t), _dtypes.nbytes(t.shape, t.dtype)
                self.placed[t.id] = (ipu, n)
                self.totals[ipu] = self.totals.get(ipu, 0) + n
        self._note()
        i = self.index
        for tid in [tid for tid in self.placed if self.last_use.get(tid, i) <= i]:
            ipu, n = self.placed.pop(tid)
            self.totals[ipu] -= n
        self.index += 1
        return [None] * len(op.outputs)

    def call(self, op: Op, ins: list[None]) -> list[None]:
        site = next((t._ipu for t in (*op.outputs, *op.inputs) if t._ipu is not None), None)
        self._note(self._callee(op.attrs.graph, self.default_ipu if site is None else site))
        return self.op(op, ins, {})

    repeat = call

    def _callee(self, graph: Graph, ipu: int) -> dict[int, int]:
        key = (id(graph), ipu)
        if key not in self._ipu_peaks:
            walk = _IpuLiveness(self.persistent, self._ipu_peaks)
            self._ipu_peaks[key] = walk.peaks(graph, graph._ops, ipu)
        return self._ipu_peaks[key]


# ---- phases -------------------------------------------------------------------------------
#
# Note [phases]
# ~~~~~~~~~~~~~
# A phased program (popxl-addons' phased execution) runs as a sequence of phases, each
# loading a layer's variables (and optimizer state) from streaming memory, computing and
# storing them back, so that only one phase's tensors are on chip at a time. The report
# takes a phase to be a run of consecutive main-program ops recorded in the same
# ``popxl.name_scope`` (the op's ``scope``; nested scopes are distinct phases, ops outside any
# scope form unnamed ones). Per phase it gives, per replica: the peak of live intermediates
# while the phase runs (the same walk as Note [peak intermediates]: loaded variables are
# intermediates, a call adds its callee's peak), the intermediates that were live when it
# began (values carried over from earlier phases rather than through remote buffers), and,
# over all replicas like the traffic table, the bytes it loads from and stores to streaming
# memory; and the cost model's time for its ops. On chip during a phase is its peak plus
# what is always there (variables, RTS shards, constants); the program's peak is the
# largest phase's.


@dataclass(frozen=True)
class PhaseMemory:
    """One phase of a phased program (Note [phases]).

    ``name`` is the ``name_scope`` (``""`` for ops outside any); ``num_ops`` counts the
    main-program ops in it. Bytes: ``peak_intermediate_bytes`` and ``live_in_bytes`` per
    replica; ``remote_load_bytes`` / ``remote_store_bytes`` / ``host_bytes`` summed over all
    replicas per run (like ``MemoryReport.traffic``). ``modeled_time_s``: the cost model's
    device time of the phase."""

    name: str
    num_ops: int
    peak_intermediate_bytes: int
    live_in_bytes: int
    remote_load_bytes: int
    remote_store_bytes: int
    num_remote_loads: int
    num_remote_stores: int
    host_bytes: int
    modeled_time_s: float


class _PhaseLiveness(_Liveness):
    """``_Liveness`` over the main program that also records, per op, the live intermediates
    before it runs and the peak while it runs (its callee's peak included)."""

    def peak(self, graph: Graph, ops: list[Op]) -> int:
        self.before: list[int] = []
        self.during: list[int] = []
        return super().peak(graph, ops)

    def _measure(self, op: Op, ins: list[None], callee: int) -> list[None]:
        self.before.append(self.total)
        saved, self.max = self.max, self.total + callee
        out = _Liveness.op(self, op, ins, {})
        self.during.append(self.max)
        self.max = max(saved, self.max)
        return out

    def op(self, op: Op, ins: list[None], env) -> list[None]:
        return self._measure(op, ins, 0)

    def call(self, op: Op, ins: list[None]) -> list[None]:
        return self._measure(op, ins, self._callee_peak(op.attrs.graph))

    repeat = call


def _phases(
    ir, ops: list[Op], persistent: set[str], cost_model: CostModel
) -> tuple[PhaseMemory, ...]:
    if not any(op.scope for op in ops):
        return ()
    walk = _PhaseLiveness(persistent)
    walk.peak(ir.main_graph, ops)
    R = ir.instance_replication_factor
    spans: list[tuple[str, int, int]] = []  # (scope, first op, end)
    for i, op in enumerate(ops):
        if spans and spans[-1][0] == op.scope:
            spans[-1] = (op.scope, spans[-1][1], i + 1)
        else:
            spans.append((op.scope, i, i + 1))
    phases = []
    for scope, start, end in spans:
        work = workload_of_ops(ops[start:end], R, ir._pb_ir.getSessionOptions().numIOTiles)
        phases.append(
            PhaseMemory(
                name=scope.rstrip("/"),
                num_ops=end - start,
                peak_intermediate_bytes=max(walk.during[start:end]),
                live_in_bytes=walk.before[start],
                remote_load_bytes=round(work.nbytes("remote_load") * R),
                remote_store_bytes=round(work.nbytes("remote_store") * R),
                num_remote_loads=work.count("remote_load"),
                num_remote_stores=work.count("remote_store"),
                host_bytes=round(
                    (work.nbytes("host_to_device") + work.nbytes("device_to_host")) * R
                ),
                modeled_time_s=cost_model.step_time_s(work),
            )
        )
    return tuple(phases)


def _format_phases(phases: tuple[PhaseMemory, ...], persistent: int, R: int) -> list[str]:
    name_width = max(12, *(len(p.name or "(no name_scope)") for p in phases)) + 2
    cells = ("on chip", "live in", "loads", "stores", "time")
    lines = [
        f"Phases by name_scope (memory per replica, loads / stores over all {R} replicas)",
        "  " + "phase".ljust(name_width) + "".join(f"{c:>12}" for c in cells),
    ]
    for p in phases:
        values = (
            format_bytes(persistent + p.peak_intermediate_bytes),
            format_bytes(p.live_in_bytes),
            format_bytes(p.remote_load_bytes),
            format_bytes(p.remote_store_bytes),
            format_seconds(p.modeled_time_s),
        )
        label = (p.name or "(no name_scope)").ljust(name_width)
        lines.append("  " + label + "".join(f"{v:>12}" for v in values))
    lines.append(
        f"  (on chip = {format_bytes(persistent)} always there (variables, shards, constants) "
        "+ the phase's peak live intermediates)"
    )
    return lines
