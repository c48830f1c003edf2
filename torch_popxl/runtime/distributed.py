"""Many processes, one PopXL program: replication over ``torch.distributed`` (DESIGN.md §4).

Launch the same script on every process with ``torchrun`` (one host or several:
``--nnodes``). Each process is then one PopXL *instance* (popxl.md §10), whichever way the Ir
spells its replication (Note [one program, any launch]):

* the global replica count R is the ``Ir(replication=R)`` integer (or a later
  ``ir.replication_factor = R``), or for ``Ir(replication="popdist")``
  ``$TORCH_POPXL_REPLICATION_FACTOR``, else the world size W; it must be a multiple of W;
* instance k holds the contiguous block of global replicas ``[k * R/W, (k+1) * R/W)`` and
  runs them together under ``vmap``, exactly as the simulator runs all R;
* groupings, collectives, sharding and variable host data are global; ``session.run`` arrays
  hold the local replicas only (``ir.instance_replication_factor = R / W`` rows);
* host reads (``weights_to_host``, ``get_tensor_data``) assemble the full global value on every
  instance, so they are collective: every instance must make them, in the same order.

Note [one program, any launch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``ir/instances.py`` (``layout_for``) decides the layout when the replication is set:

* ``Ir(replication=R)`` without torchrun: one instance of R replicas. Under torchrun with W
  processes: W instances of R/W, the layout ``"popdist"`` with R gives. R = 1 stays one
  independent instance per process (nothing to split); any other R that W does not divide is
  a ValueError.
* ``Ir(replication="popdist")`` under torchrun: R from ``$TORCH_POPXL_REPLICATION_FACTOR`` or
  W. Without torchrun: one instance holding R from ``$TORCH_POPXL_REPLICATION_FACTOR`` or 1,
  as popdist reports one instance (index 0) when the script is not launched by poprun. In
  popdist mode the ``replication_factor`` setter sets the instance-local count, as upstream.

Environment:

* ``TORCH_POPXL_REPLICATION_FACTOR``: the global R for ``Ir(replication="popdist")``.
* ``TORCH_POPXL_DIST_TIMEOUT_S`` (default 60): how long any collective, group creation or
  process-group start may wait for the other instances before every waiting rank raises
  :class:`DistributedError`.
* ``TORCH_POPXL_DIST_BACKEND``: the backend when torch_popxl starts the process group itself
  (default ``gloo``, or ``cpu:gloo,cuda:nccl`` when CUDA is available).

Note [cross-instance collectives]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A grouping ``(group_size G, stride S)`` links the instances that hold members of one group.
The connected sets of instances (its *components*) are computed per grouping and become
``torch.distributed`` process groups, created eagerly and in the same order on every rank
when a Session is built (``new_group`` is collective) and cached by rank set.

* No group crosses an instance (``G == 1`` or ``R/W`` a multiple of ``G*S``): the stacked
  kernel runs on the local rows, no communication.
* All-reduce: each instance reduces its own replicas first, one partial per group that has a
  member on the linked instances (the neutral element where it holds none), and one
  ``dist.all_reduce`` over those instances combines them (the full group: one partial over
  the world group; matmul+all-reduce likewise). Each replica keeps its group's row.
* Reduce-scatter: one ``dist.reduce_scatter_tensor`` over the linked instances of a
  ``[members * R/W, chunk]`` tensor whose row ``(p, l)`` is this instance's partial of the
  chunk that replica ``l`` of instance ``p`` owns; each instance receives its replicas'
  chunks. Half the bytes of the all-reduce + slice it replaces. A backend without
  ``reduce_scatter_tensor`` (gloo and nccl have it) gets that all-reduce + slice instead.
* All-gather: ``dist.all_gather_into_tensor`` of the local rows over the linked instances
  (the world group for the full group: the result). For a smaller group the gathered rows
  are laid into a global ``[R, ...]`` tensor (zeros for instances not linked) and the stacked
  kernel picks each replica's members; that is local work, the wire carries only the rows.
* The reference executor's path (``reference``) gathers every instance's rows and runs the
  per-replica semantics: it checks the fast path, it does not need to be lean.
* ``take_own`` and the ``'local'`` reduce-scatter move nothing: they pick the member index of
  each local replica from its *global* index.

Floating-point sums reduce locally first, so they can differ from the single-process
simulator in the last bits; integer and min/max results are identical.

Traffic counters (``backends.traffic_counters``) count per instance: one call per collective,
and this instance's replicas' share of the ring-model bytes (csrc/traffic.cpp), so the bytes
summed over the instances equal the single-process figures. ``wire_counters()`` counts what
this process handed to torch.distributed (Note [wire bytes]); with one replica per instance
the two agree collective by collective (tests/test_distributed.py checks it on 4 processes).

This module is transport only (process groups, layout, moving rows, counting shares): what
each collective does across instances is its op stanza's ``distributed`` rule
(``torch_popxl/opdefs/``; Note [collective backends] in opdefs/backends.py).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import opdefs
from ..ir.instances import (
    ENV_BACKEND,
    ENV_REPLICATION_FACTOR,
    ENV_TIMEOUT,
    DistributedError,
    InstanceLayout,
    init_process_group,
    instance_batch,
    instance_layout,
    launched,
    layout_for,
    local_replicas,
    num_instances,
    timeout_s,
)
from ..ir.ir import Ir
from ..opdefs import reference as refc
from ..opdefs._common import NARROW_FLOATS
from ..opdefs.all_gather import all_gather_bytes
from ..opdefs.all_reduce import all_reduce_bytes
from ..opdefs.backends import add_collective_traffic
from ..opdefs.reduce_scatter import reduce_scatter_bytes
from ..opdefs.registry import Effect

__all__ = [
    "ENV_BACKEND",
    "ENV_REPLICATION_FACTOR",
    "ENV_TIMEOUT",
    "DistributedError",
    "InstanceLayout",
    "TorchDistributedCollectives",
    "collectives_for",
    "init_process_group",
    "instance_batch",
    "instance_layout",
    "launched",
    "local_replicas",
    "make_ir",
    "mean_over_instances",
    "num_instances",
    "timeout_s",
    "wire_counters",
]


def make_ir(replication_factor: int):
    """``Ir(replication=R)``: under torchrun, R global replicas split over the processes."""
    return Ir(replication=replication_factor)


def mean_over_instances(value: float, replication_factor: int | None = None) -> float:
    """The mean of a per-instance number over all instances (the value itself in one process).

    With ``replication_factor``, over the instances of that program's layout
    (:func:`layout_for`): a one-replica program runs alone in every process, so its value is
    its own.
    """
    if not launched():  # one process: one instance, whatever the layout
        return value
    instances = (
        num_instances()
        if replication_factor is None
        else layout_for(replication_factor).num_instances
    )
    if instances == 1:
        return value
    world = _process_group(tuple(range(dist.get_world_size())))
    backend = str(dist.get_backend(world))
    nccl_only = "nccl" in backend and "gloo" not in backend
    device = torch.device("cuda", torch.cuda.current_device()) if nccl_only else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=device)
    _comm("all-reduce of a host value", lambda: dist.all_reduce(t, group=world))
    return float(t.item()) / dist.get_world_size()


# Note [wire bytes]
# ~~~~~~~~~~~~~~~~~
# What this process sent through torch.distributed, counted at the call with the ring
# algorithm's per-process figure for the tensor handed over on P processes: reduce-scatter
# and all-gather (P-1)/P of the full tensor, all-reduce twice that (each op's own formula,
# Note [traffic formulas], for a ring of P with one row per process). gloo and nccl run these
# collectives as rings (or as trees/halving-doubling that send no more), so this is the
# payload each process puts on the wire, headers aside. The traffic counters instead count
# the ring among *replicas* (Note [traffic accounting]); the two agree when every instance
# holds one replica, and the wire figure is lower when an instance holds several (their
# links are free: they share memory).
_WIRE = {"bytes": 0, "calls": 0}


def wire_counters() -> dict[str, int]:
    """Bytes this process has sent through torch.distributed collectives and their number
    (Note [wire bytes]); process-wide and only growing."""
    return dict(_WIRE)


# ---- process groups -----------------------------------------------------------------------

_groups: dict[tuple[int, tuple[int, ...]], Any] = {}


def _process_group(ranks: tuple[int, ...]):
    """A process group over ``ranks`` with our timeout, made once per default group. Every rank
    must call this with the same ``ranks`` in the same order (``new_group`` is collective)."""
    key = (id(dist.group.WORLD), ranks)
    if key not in _groups:
        _groups[key] = _comm(
            f"creation of the process group {list(ranks)}",
            lambda: dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s())),
        )
    return _groups[key]


def _comm(what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except RuntimeError as error:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        world = dist.get_world_size() if dist.is_initialized() else "?"
        raise DistributedError(
            f"torch_popxl: the {what} across instances failed on rank {rank} of {world} "
            f"(timeout {timeout_s():g} s, set with {ENV_TIMEOUT}). Another instance has probably "
            "exited, crashed or stopped making the same calls: every instance must build the same "
            "Ir and make the same Session calls (runs and host reads such as get_tensor_data) in "
            f"the same order. Cause: {error}"
        ) from error


def _components(layout: InstanceLayout, group_size: int, stride: int) -> list[tuple[int, ...]]:
    """Sets of instances joined by the groups of ``(group_size, stride)``, ascending."""
    local = layout.instance_replication_factor
    parent = list(range(layout.num_instances))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for members in refc.groups(layout.replication_factor, group_size, stride):
        first, *rest = (r // local for r in members)
        for other in rest:
            parent[root(other)] = root(first)
    sets: dict[int, list[int]] = {}
    for i in range(layout.num_instances):
        sets.setdefault(root(i), []).append(i)
    return sorted(tuple(s) for s in sets.values())


def _canonical(group_size: int, stride: int) -> tuple[int, int]:
    """The key of a grouping: PopXL forces the stride of singleton groups to 1, so
    ``(1, s)`` for every ``s`` is one grouping (and one set of process groups)."""
    return group_size, 1 if group_size == 1 else stride


def _ir_groupings(ir) -> list[tuple[int, int]]:
    """Every ``(group_size, stride)`` a collective of the Ir uses, in a fixed order."""
    found: set[tuple[int, int]] = set()
    for graph in ir._graphs:
        for op in graph._ops:
            opdef = opdefs.lookup(op)
            if opdef is not None and Effect.COLLECTIVE in opdef.effects:
                group_size, stride = op.attrs.argument("group_size"), op.attrs.argument("stride")
                found.add(_canonical(group_size, stride))
    return sorted(found)


def collectives_for(ir, device: torch.device) -> TorchDistributedCollectives:
    """The backend of a Session on ``ir`` (a popdist Ir); creates its process groups."""
    layout = InstanceLayout(ir._num_instances, ir._instance_index, ir.instance_replication_factor)
    return TorchDistributedCollectives(layout, _ir_groupings(ir), device)


# ---- the backend --------------------------------------------------------------------------


def _wire(x: torch.Tensor) -> torch.Tensor:
    """A dtype every backend can move byte for byte (gathers only, no arithmetic)."""
    x = x.contiguous()
    if x.dtype == torch.bool or x.dtype in NARROW_FLOATS[2:]:
        return x.view(torch.uint8)
    return x


def _unwire(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.view(dtype) if x.dtype != dtype else x


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def _native_reduce_scatter(pg) -> bool:
    """Whether the process group's backend implements ``reduce_scatter_tensor`` (gloo does
    from torch 2.x, nccl always; checked against gloo in tests/test_distributed.py)."""
    backend = str(dist.get_backend(pg))
    return "gloo" in backend or "nccl" in backend


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchDistributedCollectives:
    """``backends.InstanceTransport`` over ``torch.distributed`` (Note [cross-instance
    collectives])."""

    def __init__(
        self, layout: InstanceLayout, groupings: Sequence[tuple[int, int]], device: torch.device
    ):
        self.layout = layout
        self.device = device
        world = tuple(range(layout.num_instances))
        self._world = _process_group(world)
        # grouping -> (process group, member instances) of this rank's component; None when
        # no group crosses an instance.
        self._links: dict[tuple[int, int], tuple[Any, tuple[int, ...]] | None] = {}
        for grouping in groupings:
            self._links[grouping] = self._link(*grouping)

    # -- layout

    @property
    def R(self) -> int:
        return self.layout.replication_factor

    @property
    def local(self) -> int:
        return self.layout.instance_replication_factor

    @property
    def offset(self) -> int:
        return self.layout.replica_offset

    def _within_instance(self, group_size: int, stride: int) -> bool:
        """Whether every group of ``(group_size, stride)`` lies inside one instance: the
        groups tile each instance's ``local`` consecutive replicas (popxl.md §2.1)."""
        return group_size == 1 or self.local % (group_size * stride) == 0

    def _link(self, group_size: int, stride: int):
        if self._within_instance(group_size, stride):
            return None
        mine = None
        for component in _components(self.layout, group_size, stride):
            if len(component) > 1:
                pg = _process_group(component)  # every rank creates every group, in order
                if self.layout.instance_index in component:
                    mine = (pg, component)
        return mine

    def _link_for(self, group_size: int, stride: int):
        group_size, stride = _canonical(group_size, stride)
        if (group_size, stride) not in self._links:
            # Not seen when the Session was built: the world group always works (all instances
            # run the same program) at the price of gathering every instance's rows.
            local = self._within_instance(group_size, stride)
            world = tuple(range(self.layout.num_instances))
            self._links[(group_size, stride)] = None if local else (self._world, world)
        return self._links[(group_size, stride)]

    def member_index(self, group_size: int, stride: int) -> torch.Tensor:
        """``i(r)`` of every local replica r, from its global index (popxl.md §2.1)."""
        rows = [refc.index_in_group(self.offset + r, group_size, stride) for r in range(self.local)]
        return torch.tensor(rows, device=self.device)

    # -- moving rows

    def _sent(self, wire_bytes: int, members: int) -> None:
        """Count this process's wire bytes of one collective over ``members`` processes
        (Note [wire bytes]): ``wire_bytes`` from the op's own formula (Note [traffic
        formulas]) for a ring of ``members`` with one row per process."""
        if members > 1:
            _WIRE["bytes"] += wire_bytes
            _WIRE["calls"] += 1

    def _gather(self, x: torch.Tensor, pg, members: tuple[int, ...]) -> torch.Tensor:
        """``[R_local, ...]`` -> ``[R, ...]``: the rows of ``members``, zeros elsewhere."""
        wire = _wire(x)
        buf = wire.new_empty((len(members) * self.local, *x.shape[1:]))
        _comm("all-gather", lambda: _all_gather_single(buf, wire, group=pg))
        row = buf.numel() * buf.element_size() // len(members)
        self._sent(all_gather_bytes(1, len(members), row), len(members))
        rows = _unwire(buf, x.dtype)
        if len(members) == self.layout.num_instances:
            return rows
        out = x.new_zeros((self.R, *x.shape[1:]))
        for j, m in enumerate(members):
            out[m * self.local : (m + 1) * self.local] = rows[j * self.local : (j + 1) * self.local]
        return out

    def local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[self.offset : self.offset + self.local]

    def count(self, total: int, counted: int = 0, calls: int = 0) -> None:
        """Record this instance's share of ``total`` ring bytes (Note [traffic accounting]),
        less the ``counted`` bytes a stacked kernel already recorded here."""
        share = total * self.local // self.R
        if self.layout.instance_index == 0:  # the rounding remainder, so shares sum to total
            share += total - share * self.layout.num_instances
        add_collective_traffic(share - counted, calls)

    def all_reduce_partial(self, t: torch.Tensor, reduction: str) -> torch.Tensor:
        op = _REDUCE_OPS[reduction]
        _comm("all-reduce", lambda: dist.all_reduce(t, op=op, group=self._world))
        n = self.layout.num_instances
        self._sent(all_reduce_bytes(1, n, t.numel() * t.element_size()), n)
        return t

    def component(self, group_size: int, stride: int) -> tuple[int, ...]:
        link = self._link_for(group_size, stride)
        return (self.layout.instance_index,) if link is None else link[1]

    def all_reduce_component(
        self, t: torch.Tensor, group_size: int, stride: int, reduction: str
    ) -> torch.Tensor:
        link = self._link_for(group_size, stride)
        assert link is not None, "no group of this grouping crosses an instance"
        pg, members = link
        t = t.contiguous()
        _comm("all-reduce", lambda: dist.all_reduce(t, op=_REDUCE_OPS[reduction], group=pg))
        self._sent(all_reduce_bytes(1, len(members), t.numel() * t.element_size()), len(members))
        return t

    def reduce_scatter_component(
        self, t: torch.Tensor, group_size: int, stride: int, reduction: str
    ) -> torch.Tensor:
        link = self._link_for(group_size, stride)
        assert link is not None, "no group of this grouping crosses an instance"
        pg, members = link
        op = _REDUCE_OPS[reduction]
        t = t.contiguous()
        out = t.new_empty((self.local, *t.shape[1:]))
        if _native_reduce_scatter(pg):
            _comm("reduce-scatter", lambda: dist.reduce_scatter_tensor(out, t, op=op, group=pg))
            self._sent(reduce_scatter_bytes(1, len(members), t.numel(), t.element_size(), "add"),
                       len(members))  # fmt: skip
            return out
        # A backend without reduce_scatter_tensor (mpi, ucc, third-party): all-reduce the
        # whole tensor and keep this instance's rows; it moves twice the bytes, counted so.
        _comm("all-reduce", lambda: dist.all_reduce(t, op=op, group=pg))
        self._sent(all_reduce_bytes(1, len(members), t.numel() * t.element_size()), len(members))
        j = members.index(self.layout.instance_index)
        out = t[j * self.local : (j + 1) * self.local]
        return out

    def gather_component(self, x: torch.Tensor, group_size: int, stride: int) -> torch.Tensor:
        link = self._link_for(group_size, stride)
        assert link is not None, "no group of this grouping crosses an instance"
        return self._gather(x, *link)

    def gather_all(self, x: torch.Tensor) -> torch.Tensor:
        return self._gather(x, self._world, tuple(range(self.layout.num_instances)))

    def gather_rows(self, rows: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """Every instance's local rows, ``[R, ...]`` in global replica order."""
        if invariant:
            return rows[:1].expand(self.R, *rows.shape[1:])
        return self.gather_all(rows)

    # -- backends.Collectives

    def num_replicas(self, batch_size: int) -> int:
        if batch_size != self.local:
            raise RuntimeError(
                f"torch_popxl: a collective ran under a vmap of {batch_size} replicas, but this "
                f"instance holds {self.local}. Distributed collectives only run inside a Session."
            )
        return self.R

    def spans_instances(self, group_size: int, stride: int) -> bool:
        return self._link_for(group_size, stride) is not None

    def reference(self, fn, values, *args):
        stacked = torch.stack([v.contiguous() for v in values])
        everyone = self.gather_all(stacked)
        return fn(list(everyone.unbind(0)), *args)[self.offset : self.offset + self.local]
