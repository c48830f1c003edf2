"""The cost model: one run's work (``Workload``) turned into an estimated IPU step time.

``workload(ir)`` walks the main program (calls and repeats expanded) and lists, per replica,
every collective (bytes over the replica links, group size), remote load/store, host transfer
and compute op (FLOPs, bytes touched). ``CostModel.breakdown`` prices each item with a few
physical parameters; docs/cost_model.md says what each one means and where its value comes
from, and ``fit`` reproduces the fitted ones from published step times (Note [the fit]).

Note [step time]
~~~~~~~~~~~~~~~~
Per replica (replicas run in lockstep, so one replica's time is the step time):

* compute op      op_overhead_s + max(flops / (flops_per_s * eff), bytes / on_chip_bytes_per_s)
                  with eff = flops / (flops + matmul_half_efficiency_flops) for matmuls
                  (a small matmul cannot keep every tile's AMP unit busy), 1 otherwise.
                  Views (``aten.t``, ``view``, ``detach``...) are free: Poplar aliases them.
* collective      collective_step_latency_s * steps + ring bytes / replica_link_bytes_per_s,
                  steps from the op's traffic rule: 2 (G - 1) for all_reduce, G - 1 for
                  all_gather / reduce_scatter (ring algorithms: one sync-and-exchange per
                  step). Local slices are free.
* remote transfer remote_latency_s + bytes / streaming_memory_bytes_per_s.
* host transfer   host_latency_s + bytes / host_bytes_per_s.
* ipu_copy        ipu_copy_latency_s + bytes / ipu_link_bytes_per_s (a copy between two IPUs of
                  one replica, ``popxl.ipu`` placement and pipelining: the IPU-Links).

Phases add, except that transfers issued from IO tiles (``popxl.io_tiles()``) run beside the
compute tiles: ``io_tile_overlap`` (0..1) of the shorter of the two is hidden.

Note [IO tiles]
~~~~~~~~~~~~~~~
A program reserves IO tiles with the session option ``numIOTiles`` (``ir._pb_ir.
getSessionOptions().numIOTiles = 32``); Poplar then places compute on the other
``tiles_per_ipu - numIOTiles`` tiles. Each tile brings its own AMP unit and its own slice of
In-Processor-Memory bandwidth, so both compute rates (``flops_per_s``, ``on_chip_bytes_per_s``)
shrink by that fraction; the per-op overhead (a BSP superstep) does not. ``workload(ir)``
records the option (``Workload.num_io_tiles``) and ``breakdown`` applies it. What the IO tiles
buy, transfers that overlap compute, is ``io_tile_overlap``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from .. import dtypes as _dtypes
from .. import opdefs
from ..ir.graph import OpKind
from ..ir.walk import executed_ops
from ..opdefs.compute import matmul_flops
from ..opdefs.registry import TRAFFIC_KINDS
from ..opdefs.scalar_tensor import adam_chain_pieces

_ADAM_CHAIN = torch.ops.torch_popxl.adam_chain_.default  # Note [Adam chain in three passes]

if TYPE_CHECKING:
    from ..ir import Ir
    from ..ir.graph import Op

__all__ = [
    "CostModel",
    "FITTED_PARAMETERS",
    "PUBLISHED_SHARDING_STUDY",
    "TRAFFIC_KINDS",
    "Workload",
    "WorkItem",
    "fit",
    "workload",
    "workload_of_ops",
]

_COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "local_slice")
_REMOTE_KINDS = ("remote_load", "remote_store")
_HOST_KINDS = ("host_to_device", "device_to_host")
_IPU_LINK_KINDS = ("ipu_copy",)
WORK_KINDS = (*TRAFFIC_KINDS, "matmul", "compute")
PHASES = ("compute", "replica_links", "streaming_memory", "host_io", "ipu_links", "io_tile_overlap")


# ---- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkItem:
    """``count`` identical pieces of work, per replica.

    ``nbytes``: bytes one replica moves (collective ring bytes, slot bytes, host entry bytes) or,
    for compute, reads and writes; ``group_size`` and ``steps`` (ring steps of one piece, from
    the op's traffic rule) for collectives; ``flops`` for compute; ``io_tiles`` when the op
    runs on IO tiles.
    """

    kind: str
    count: int
    nbytes: float = 0.0
    flops: float = 0.0
    group_size: int = 1
    io_tiles: bool = False
    steps: int = 0


@dataclass(frozen=True)
class Workload:
    """Everything one ``run`` does on one replica, as ``WorkItem``s (see ``workload``)."""

    items: tuple[WorkItem, ...]
    # Tiles the program reserves for IO (session option numIOTiles; Note [IO tiles]).
    num_io_tiles: int = 0

    def count(self, kind: str) -> int:
        return sum(i.count for i in self.items if i.kind == kind)

    def nbytes(self, kind: str) -> float:
        return sum(i.count * i.nbytes for i in self.items if i.kind == kind)

    @property
    def flops(self) -> float:
        return sum(i.count * i.flops for i in self.items)


def workload(ir: Ir) -> Workload:
    """The per-replica work of one run of ``ir``'s main program.

    Byte counts follow the op definitions' formulas (Note [traffic formulas]) divided
    by the replica count; calls count once per call and ``repeat_count`` times in a repeat.
    """
    return workload_of_ops(
        ir.main_graph._ops_in_context("normal"),
        ir.instance_replication_factor,
        ir._pb_ir.getSessionOptions().numIOTiles,
    )


class _Walker:
    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        # (kind, nbytes, flops, group_size, io_tiles, steps) -> count; WorkItem's field order.
        self.items: Counter = Counter()

    def add(self, kind, times, nbytes=0.0, flops=0.0, group_size=1, io=False, steps=0) -> None:
        key = (kind, float(nbytes), float(flops), int(group_size), bool(io), int(steps))
        self.items[key] += times

    def walk(self, ops: Iterable[Op], times: int) -> None:
        for op, count in executed_ops(ops, times):
            # Where an op runs is where its outputs live; a store has none, so its input's.
            io = any(t.tile_set == "io" for t in (op.outputs or op.inputs))
            opdef = opdefs.lookup(op)
            if opdef is not None and opdef.has("traffic"):
                # Per-replica work: the op's total over the replicas that run it, divided back.
                t = opdef.traffic(op, self.num_replicas)
                nbytes = t.total_bytes / self.num_replicas
                group = t.group_size if t.steps else 1
                self.add(t.kind, count, nbytes, 0, group, io, t.steps)
            elif op.kind == OpKind.TORCH:
                self._torch(op, count, io)

    def _torch(self, op: Op, times: int, io: bool) -> None:
        if _is_view(op.attrs.target):
            return  # an alias: no work on the device
        if op.attrs.target is _ADAM_CHAIN:  # the chain it stands for, op by op
            for nbytes in adam_chain_pieces(op):
                self.add("compute", times, nbytes, io=io)
            return
        nbytes = sum(_dtypes.nbytes(t.shape, t.dtype) for t in (*op.inputs, *op.outputs))
        flops = matmul_flops(op)
        if flops is not None:
            self.add("matmul", times, nbytes, flops, io=io)
        else:
            self.add("compute", times, nbytes, io=io)


def _is_view(target) -> bool:
    """An op whose output aliases an input without writing it (``t``, ``view``, ``detach``)."""
    returns = getattr(getattr(target, "_schema", None), "returns", ())
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


# ---- the model ------------------------------------------------------------------------------


_GC200_TILES = 1472  # tiles of one Mk2 GC200 IPU
_GC200_TILE_BYTES = 624 * 1024  # In-Processor Memory of one tile


@dataclass(frozen=True)
class CostModel:
    """Prices a ``Workload`` in seconds per replica (Note [step time]).

    The defaults describe one Mk2 GC200 IPU of an IPU-M2000, four replicas per machine;
    docs/cost_model.md gives each value's source. ``streaming_memory_bytes_per_s``,
    ``remote_latency_s``, ``host_latency_s`` and ``op_overhead_s`` were fitted to the
    popxl-addons sharding-threshold table (``fit``; ``examples/sharding_study.py --fit``).
    Every field can be overridden: ``CostModel(op_overhead_s=0)``.

    ``DEVICE`` names the device the defaults describe and ``DEVICE_MEMORY_BYTES`` is its
    on-chip memory (In-Processor Memory: 1472 tiles of 624 KiB, "900 MB"), the budget
    ``python -m torch_popxl plan`` checks a program against; ``device`` says whether this
    instance still describes it.
    """

    DEVICE: ClassVar[str] = "Mk2 GC200 IPU (IPU-M2000)"
    DEVICE_MEMORY_BYTES: ClassVar[int] = _GC200_TILES * _GC200_TILE_BYTES

    # compute (roofline)
    flops_per_s: float = 62.5e12
    matmul_half_efficiency_flops: float = 4.7e6
    on_chip_bytes_per_s: float = 47.5e12
    op_overhead_s: float = 4.16e-6
    # replica links (collectives)
    replica_link_bytes_per_s: float = 64e9
    collective_step_latency_s: float = 2.0e-6
    # streaming memory (remote buffers)
    streaming_memory_bytes_per_s: float = 4.83e9
    remote_latency_s: float = 15.0e-6
    # host IO
    host_bytes_per_s: float = 3.125e9
    host_latency_s: float = 15.0e-6
    # overlap of IO-tile transfers with compute
    io_tile_overlap: float = 1.0
    # copies between the IPUs of one replica (ipu_copy: popxl.ipu placement, pipelining)
    ipu_link_bytes_per_s: float = 64e9
    ipu_copy_latency_s: float = 2.0e-6
    # tiles of one IPU; compute runs on those the program does not reserve for IO
    tiles_per_ipu: int = _GC200_TILES

    def __post_init__(self):
        tiles = self.tiles_per_ipu
        if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
            raise ValueError(
                f"CostModel.tiles_per_ipu must be a positive int; got {self.tiles_per_ipu!r}."
            )
        for f in dataclasses.fields(self):
            if f.name == "tiles_per_ipu":
                continue
            value = getattr(self, f.name)
            rate = f.name.endswith("_per_s") or f.name == "matmul_half_efficiency_flops"
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and (value > 0 if rate else value >= 0)
            if f.name == "io_tile_overlap":
                ok = ok and value <= 1
            if not ok:
                want = (
                    "a positive finite number"
                    if rate
                    else "a number in [0, 1]"
                    if f.name == "io_tile_overlap"
                    else "a non-negative finite number"
                )
                raise ValueError(f"CostModel.{f.name} must be {want}; got {value!r}.")

    @property
    def device(self) -> str:
        """The modeled device: ``DEVICE``, or that with changed parameters."""
        changed = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        return self.DEVICE if not changed else f"{self.DEVICE} with {', '.join(changed)} changed"

    # -- pricing --

    def compute_tile_fraction(self, num_io_tiles: int) -> float:
        """The share of an IPU's tiles left to compute when ``num_io_tiles`` do IO."""
        if not 0 <= num_io_tiles < self.tiles_per_ipu:
            raise ValueError(
                f"numIOTiles={num_io_tiles!r} leaves no compute tiles: an IPU here has "
                f"{self.tiles_per_ipu} tiles (CostModel.tiles_per_ipu); reserve fewer for IO."
            )
        return (self.tiles_per_ipu - num_io_tiles) / self.tiles_per_ipu

    def item_seconds(self, item: WorkItem, num_io_tiles: int = 0) -> float:
        """Seconds for all ``item.count`` pieces of one work item on one replica, with
        ``num_io_tiles`` of each IPU's tiles reserved for IO (Note [IO tiles])."""
        k = item.kind
        if k in ("matmul", "compute"):
            share = self.compute_tile_fraction(num_io_tiles)
            flops_per_s, bytes_per_s = self.flops_per_s * share, self.on_chip_bytes_per_s * share
            eff = 1.0
            if k == "matmul":
                eff = item.flops / (item.flops + self.matmul_half_efficiency_flops)
            work = item.flops / (flops_per_s * eff) if item.flops else 0.0
            each = self.op_overhead_s + max(work, item.nbytes / bytes_per_s)
        elif k == "local_slice":
            each = 0.0
        elif k in _COLLECTIVE_KINDS:
            each = (
                self.collective_step_latency_s * item.steps
                + item.nbytes / self.replica_link_bytes_per_s
            )
        elif k in _REMOTE_KINDS:
            each = self.remote_latency_s + item.nbytes / self.streaming_memory_bytes_per_s
        elif k in _HOST_KINDS:
            each = self.host_latency_s + item.nbytes / self.host_bytes_per_s
        elif k in _IPU_LINK_KINDS:
            each = self.ipu_copy_latency_s + item.nbytes / self.ipu_link_bytes_per_s
        else:
            raise ValueError(f"unknown work kind {k!r}; expected one of {WORK_KINDS}.")
        return item.count * each

    def breakdown(self, work: Workload) -> dict[str, float]:
        """Seconds per phase of one run (``PHASES``); ``io_tile_overlap`` is <= 0 (time hidden)."""
        phase_of = {"matmul": "compute", "compute": "compute", "local_slice": "replica_links"}
        phase_of.update(dict.fromkeys(_COLLECTIVE_KINDS[:3], "replica_links"))
        phase_of.update(dict.fromkeys(_REMOTE_KINDS, "streaming_memory"))
        phase_of.update(dict.fromkeys(_HOST_KINDS, "host_io"))
        phase_of.update(dict.fromkeys(_IPU_LINK_KINDS, "ipu_links"))
        out = dict.fromkeys(PHASES, 0.0)
        io_transfers = 0.0
        for item in work.items:
            seconds = self.item_seconds(item, work.num_io_tiles)
            out[phase_of[item.kind]] += seconds
            if item.io_tiles and item.kind not in ("matmul", "compute"):
                io_transfers += seconds
        out["io_tile_overlap"] = -self.io_tile_overlap * min(out["compute"], io_transfers)
        return out

    def step_time_s(self, work: Workload) -> float:
        """Estimated device time of one run, per replica."""
        return sum(self.breakdown(work).values())

    # -- the fitted parameters as a linear problem --

    def usage(self, work: Workload) -> dict[str, float]:
        """How much of each latency / rate parameter one run uses: the step time is
        ``sum(usage[p] * value(p)) + fixed`` where ``value`` is a latency or the inverse of
        a ``*_per_s`` rate (Note [the fit]); ``usage["fixed_s"]`` is the rest (compute work).
        Valid while no IO-tile time is hidden (the overlap is a ``min``, not linear)."""
        use = dict.fromkeys(LINEAR_PARAMETERS, 0.0)
        use["fixed_s"] = 0.0
        for item in work.items:
            k, n = item.kind, item.count
            if k in ("matmul", "compute"):
                use["op_overhead_s"] += n
                use["fixed_s"] += (
                    self.item_seconds(item, work.num_io_tiles) - n * self.op_overhead_s
                )
            elif k in _COLLECTIVE_KINDS and k != "local_slice":
                use["collective_step_latency_s"] += n * item.steps
                use["replica_link_bytes_per_s"] += n * item.nbytes
            elif k in _REMOTE_KINDS:
                use["remote_latency_s"] += n
                use["streaming_memory_bytes_per_s"] += n * item.nbytes
            elif k in _HOST_KINDS:
                use["host_latency_s"] += n
                use["host_bytes_per_s"] += n * item.nbytes
            elif k in _IPU_LINK_KINDS:
                # Not fitted (the table has no IPU copies): a fixed cost at the model's values.
                use["fixed_s"] += self.item_seconds(item, work.num_io_tiles)
        return use

    def value(self, name: str) -> float:
        """A parameter as it enters the step time linearly: seconds, or seconds per byte."""
        v = getattr(self, name)
        return 1.0 / v if name.endswith("_per_s") else v


LINEAR_PARAMETERS = (
    "op_overhead_s",
    "collective_step_latency_s",
    "replica_link_bytes_per_s",
    "remote_latency_s",
    "streaming_memory_bytes_per_s",
    "host_latency_s",
    "host_bytes_per_s",
)
# Parameters the fit may tie into one unknown (the same physical mechanism).
TIED_PARAMETERS = {"transfer_latency_s": ("remote_latency_s", "host_latency_s")}


# ---- the fit ----
# Note [the fit]
# ~~~~~~~~~~~~~~
# The step time is linear in every latency and in every inverse bandwidth (``usage``), so
# fitting some of them to measured step times is a non-negative least-squares problem; each
# row is divided by its measured time so that every case weighs the same (relative error).
# ``FITTED_PARAMETERS`` are the ones the defaults took from the published table below
# (``examples/sharding_study.py --fit`` redoes it; tests/test_cost_model.py checks it):
# the other parameters are datasheet figures or assumptions (docs/cost_model.md), and the
# collective latency cannot be fitted here: every row of the table runs 48 ring steps.

# popxl-addons tutorial "Remote variables and RTS" (seed 002), MNIST with off-chip Adam state,
# data parallel 4, gradient accumulation 8, micro-batch 8 (256 samples per step), IPU hardware:
# (case, sharding threshold or None for no sharding / on-chip, published samples/s).
PUBLISHED_SHARDING_STUDY = (
    ("no sharding", None, "remote", 43418.9),
    ("only state related to fc1.weight", 262145, "remote", 50909.2),
    ("all state related to weights", 1024, "remote", 67403.4),
    ("all state", 512, "remote", 72570.0),
    ("on-chip optimizer", None, "on_chip", 107418.9),
)
FITTED_PARAMETERS = ("streaming_memory_bytes_per_s", "transfer_latency_s", "op_overhead_s")


def fit(
    works: Sequence[Workload],
    step_times_s: Sequence[float],
    free: Sequence[str],
    start: CostModel | None = None,
) -> CostModel:
    """``start`` (default ``CostModel()``) with the ``free`` parameters fitted to measured step
    times by non-negative least squares on relative error (Note [the fit]).

    ``free`` names ``LINEAR_PARAMETERS`` or ``TIED_PARAMETERS`` keys. Raises ``ValueError`` when
    the data cannot determine a parameter (it comes out zero or unbounded).
    """
    start = start or CostModel()
    if len(works) != len(step_times_s):
        raise ValueError(
            f"fit needs one step time per workload; got {len(works)} workloads and "
            f"{len(step_times_s)} times."
        )
    unknown = [n for n in free if n not in LINEAR_PARAMETERS and n not in TIED_PARAMETERS]
    if unknown or not free:
        raise ValueError(
            f"fit: free parameters must be some of {LINEAR_PARAMETERS + tuple(TIED_PARAMETERS)};"
            f" got {list(free)!r}."
        )
    if start.io_tile_overlap and any(i.io_tiles for w in works for i in w.items):
        raise ValueError(
            "fit: the IO-tile overlap is not linear in the parameters; pass "
            "start=CostModel(io_tile_overlap=0) to fit programs that use IO tiles."
        )
    members = {n: TIED_PARAMETERS.get(n, (n,)) for n in free}
    rows, rhs = [], []
    for work, t in zip(works, step_times_s, strict=True):
        use = start.usage(work)
        fixed = use["fixed_s"] + sum(
            use[p] * start.value(p)
            for p in LINEAR_PARAMETERS
            if not any(p in m for m in members.values())
        )
        rows.append([sum(use[p] for p in members[n]) / t for n in free])
        rhs.append((t - fixed) / t)
    x = _nnls(np.array(rows), np.array(rhs))
    if not np.all(x > 0):
        zero = [n for n, v in zip(free, x, strict=True) if v <= 0]
        raise ValueError(
            f"fit: the data does not determine {zero} (fitted to 0); fix them instead of "
            "fitting them."
        )
    values: dict[str, Any] = {}  # fitted floats; CostModel also has an int field
    for n, v in zip(free, x, strict=True):
        for p in members[n]:
            values[p] = 1.0 / v if p.endswith("_per_s") else float(v)
    return dataclasses.replace(start, **values)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    # Columns are scaled to unit norm so that seconds and seconds-per-byte mix well.
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    n = a.shape[1]
    passive = np.zeros(n, bool)
    x = np.zeros(n)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        if passive.all() or np.max(np.where(passive, -np.inf, w)) <= 1e-12:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x / scale


def workload_of_ops(ops: Iterable[Op], num_replicas: int, num_io_tiles: int = 0) -> Workload:
    """The per-replica work of running ``ops`` (ops of one graph, in order; calls and repeats
    expanded) once: ``workload`` for a slice of a program, such as one phase of a phased
    program (the memory report's per-phase traffic and modeled time). ``num_io_tiles``: the
    program's ``numIOTiles`` session option (Note [IO tiles])."""
    walker = _Walker(num_replicas)
    walker.walk(ops, 1)
    return Workload(
        tuple(
            WorkItem(kind, n, nbytes, flops, group, io, steps)
            for (kind, nbytes, flops, group, io, steps), n in walker.items.items()
        ),
        num_io_tiles,
    )
