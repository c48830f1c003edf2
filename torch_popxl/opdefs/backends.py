"""Transport under the op stanzas: the traffic counters and the collective backend.

Note [collective backends]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A backend is transport only; what a collective computes is its stanza's business. The vmap
rule of a per-replica collective asks ``collectives()`` for the active backend and:

* when no group of the grouping crosses a process (``spans_instances`` is False: always so
  for ``SimulatorCollectives``, which holds every replica in this process), runs the stacked
  C++ kernel over the vmap dim, which is then all R replicas;
* otherwise runs its stanza's ``distributed`` rule, which uses the backend's services (gather
  rows across instances, all-reduce a partial tensor, member indices, traffic shares).

``runtime/distributed.py`` provides the ``torch.distributed`` backend (process groups, layout
and row transport; Note [cross-instance collectives] there). A distributed ``Session``
activates it (``use_collectives``) only while it runs a program.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torch import Tensor

from ._common import ops

__all__ = [
    "Collectives",
    "InstanceTransport",
    "SimulatorCollectives",
    "add_collective_traffic",
    "add_host_bytes",
    "collectives",
    "reset_traffic_counters",
    "traffic_counters",
    "traffic_scope",
    "use_collectives",
]

_COUNTER_NAMES = (
    "collective_bytes",
    "remote_load_bytes",
    "remote_store_bytes",
    "host_bytes",
    "num_collectives",
    "num_remote_loads",
    "num_remote_stores",
)


# ---- traffic counters (Note [traffic accounting] in csrc/traffic.cpp) ----------------------


def traffic_counters() -> dict[str, int]:
    """Bytes and call counts accumulated by the collective and remote-buffer kernels."""
    return dict(zip(_COUNTER_NAMES, ops.traffic_counters(), strict=True))


def reset_traffic_counters() -> None:
    """Zero the process-wide counters (sessions never call this: see ``traffic_scope``)."""
    ops.reset_traffic_counters()


# Held by every traffic_scope: scopes in different threads take turns, so the counters move
# only for the scope that is open while it measures. Re-entrant: a nested scope (same thread)
# measures its own part, which the outer scope's figures include.
_SCOPE_LOCK = threading.RLock()


@contextlib.contextmanager
def traffic_scope() -> Iterator[dict[str, int]]:
    """Measure the traffic of the enclosed code: yields a dict that holds, on exit, how much
    each counter grew inside the scope (the names of ``traffic_counters()``).

    The process-wide counters keep accumulating (a scope never resets them), so several
    sessions, or a caller measuring around them, see independent figures. Scopes serialise
    across threads; counting done by other threads outside any scope is not excluded.
    """
    with _SCOPE_LOCK:
        delta: dict[str, int] = {}
        before = ops.traffic_counters()
        try:
            yield delta
        finally:
            after = ops.traffic_counters()
            delta.update(
                zip(
                    _COUNTER_NAMES, (a - b for a, b in zip(after, before, strict=True)), strict=True
                )
            )


def add_host_bytes(n: int) -> None:
    """Record ``n`` bytes moved between host and device (called by the host-IO layer)."""
    ops.add_host_bytes(n)


def add_collective_traffic(nbytes: int, calls: int) -> None:
    """Record collective bytes and calls that no C++ kernel counted (shortcuts, transports)."""
    ops.add_collective_traffic(nbytes, calls)


# ---- backends (Note [collective backends]) --------------------------------------------------


class Collectives(Protocol):
    """The services a stanza's vmap and distributed rules use. Tensors are stacked over the
    LOCAL replicas (``[R_local, ...]``); groupings ``(group_size, stride)`` and replica
    indices are GLOBAL."""

    def num_replicas(self, batch_size: int) -> int:
        """The global replica count, given the vmap batch (the local replica count)."""
        ...

    def spans_instances(self, group_size: int, stride: int) -> bool:
        """Whether some group of the grouping has members in another process."""
        ...

    def reference(self, fn: Callable[..., list[Tensor]], values: list[Tensor], *args: Any):
        """Run per-replica reference semantics (one list entry per replica) over all replicas
        and return the local replicas' entries (the reference executor's path)."""
        ...


class SimulatorCollectives:
    """Every replica lives in this process: the stacked kernels over the vmap dim are the
    whole story."""

    def num_replicas(self, batch_size: int) -> int:
        return batch_size

    def spans_instances(self, group_size: int, stride: int) -> bool:
        return False

    def reference(self, fn, values, *args):
        return fn(values, *args)


_SIMULATOR = SimulatorCollectives()
_active: list[Any] = []


def collectives() -> Any:
    """The backend the collective vmap rules use now (the simulator unless a distributed
    Session is running). Typed ``Any``: a stanza's distributed rule runs only on a backend
    whose ``spans_instances`` said yes, which offers the distributed services as well."""
    return _active[-1] if _active else _SIMULATOR


@contextlib.contextmanager
def use_collectives(backend: Collectives | None):
    """Route collectives to ``backend`` inside the block (``None``: leave them as they are)."""
    if backend is None:
        yield
        return
    _active.append(backend)
    try:
        yield
    finally:
        _active.pop()


class InstanceTransport(Collectives, Protocol):
    """What a stanza's ``distributed`` rule may use: the backend of one process among several
    (``runtime/distributed.py``). Only transport and layout; the collective's maths stays in
    its stanza."""

    @property
    def R(self) -> int:
        """The global replica count."""
        ...

    @property
    def local(self) -> int:
        """The replicas this instance holds."""
        ...

    @property
    def offset(self) -> int:
        """The global index of this instance's first replica."""
        ...

    def gather_component(self, x: Tensor, group_size: int, stride: int) -> Tensor:
        """``[R_local, ...]`` -> ``[R, ...]``: the rows of every instance linked to this one by
        the grouping, zeros elsewhere."""
        ...

    def gather_all(self, x: Tensor) -> Tensor:
        """``[R_local, ...]`` -> ``[R, ...]``: every instance's rows, in global order."""
        ...

    def component(self, group_size: int, stride: int) -> tuple[int, ...]:
        """The instances linked to this one by the grouping, ascending (this one included)."""
        ...

    def all_reduce_component(
        self, t: Tensor, group_size: int, stride: int, reduction: str
    ) -> Tensor:
        """Combine ``t`` with ``'sum'``, ``'min'`` or ``'max'`` over the instances of
        ``component(group_size, stride)``."""
        ...

    def reduce_scatter_component(
        self, t: Tensor, group_size: int, stride: int, reduction: str
    ) -> Tensor:
        """``[members * R_local, ...]`` -> ``[R_local, ...]``: combine ``t`` with ``'sum'``,
        ``'min'`` or ``'max'`` over the instances of ``component(group_size, stride)``; this
        instance keeps the block of rows at its position among them."""
        ...

    def local_rows(self, rows: Tensor) -> Tensor:
        """This instance's rows of a global ``[R, ...]`` tensor."""
        ...

    def member_index(self, group_size: int, stride: int) -> Tensor:
        """``i(r)`` of every local replica r, from its global index (popxl.md §2.1)."""
        ...

    def all_reduce_partial(self, t: Tensor, reduction: str) -> Tensor:
        """Combine each instance's partial ``t`` in place with ``'sum'``, ``'min'`` or
        ``'max'`` across all instances."""
        ...

    def count(self, total: int, counted: int = 0, calls: int = 0) -> None:
        """Record this instance's share of ``total`` ring bytes, less the ``counted`` bytes a
        stacked kernel already recorded here, and ``calls`` calls."""
        ...
