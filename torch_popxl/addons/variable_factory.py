"""``VariableFactory`` and ``NamedVariableFactories`` (spec addons §3).

A factory remembers how to make one variable (host data stream, dtype, replica grouping,
sharding) so that the graph that *uses* the variable can be built once and instantiated many
times: ``facts.init()`` makes main-graph variables, ``facts.init_remote(buffers)`` remote ones,
``facts.init_zero()`` zero tensors in the current graph.

Note [factory data draws]
    The data stream is consumed exactly as popxl-addons does, because programs seed numpy
    once and their results depend on the order of draws: a callable is called once at
    construction as a smoke test (result discarded) and once more to peek the first value,
    which the first created tensor then uses. Later tensors draw again. ``init`` creates the
    variables in sorted key order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from .. import dtypes as _dtypes
from .. import ops
from ..ir.context import gcg
from ..ir.remote_buffer import RemoteBuffer
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor, Variable, graph_input, variable
from ..remote import remote_replica_sharded_variable, remote_variable
from .dot_tree import DotTree
from .named_replica_grouping import NamedReplicaGrouping
from .named_tensors import NamedTensors

__all__ = [
    "VariableFactory",
    "NamedVariableFactories",
    "add_variable_input",
    "add_replica_sharded_variable_input",
]

_NO_PEEK = object()


def _endless(fn: Callable[[], Any]) -> Iterator[Any]:
    while True:
        yield fn()


def _host_shape(data: Any) -> tuple[int, ...]:
    shape = getattr(data, "shape", None)
    return tuple(int(s) for s in (shape if shape is not None else np.shape(data)))


def _host_dtype(data: Any) -> _dtypes.dtype:
    dt = getattr(data, "dtype", None)
    if dt is None:
        dt = np.asarray(data).dtype
    return _dtypes.dtype.as_dtype(dt)


def _as_numpy(data: Any) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        return data.detach().cpu().numpy()
    return np.asarray(data)


class VariableFactory:
    """How to create one variable: data stream, dtype, name, by_ref, grouping, sharding.

    ``shard_over > 1`` makes a replica-sharded factory: ``meta_shape`` is the full shape and
    ``shape`` the flat shard ``(ceil(n / shard_over),)``.
    """

    def __init__(self, data_iter: Callable[[], Any] | Iterable[Any], dtype=None, name: str | None = None,
                 by_ref: bool = False, replica_grouping: ReplicaGrouping | None = None,
                 shard_over: int | bool = 1):  # fmt: skip
        # The 2.6/3.0 signature was (..., by_ref, replica_sharded: bool, replica_grouping).
        if isinstance(replica_grouping, bool):
            replica_grouping, shard_over = (shard_over if isinstance(shard_over, ReplicaGrouping) else None,
                                            replica_grouping)  # fmt: skip
        self.data_iter = self._stream(data_iter)
        self._peeked = next(self.data_iter)
        self.name = name
        self.by_ref = by_ref
        self._replica_grouping = replica_grouping
        self.dtype = (
            _dtypes.dtype.as_dtype(dtype) if dtype is not None else _host_dtype(self._peeked)
        )
        shape = _host_shape(self._peeked)
        if isinstance(shard_over, bool):
            shard_over = self.replica_grouping.group_size if shard_over else 1
        shard_over = int(shard_over)
        if shard_over < 1:
            raise ValueError(
                f"VariableFactory {name!r}: shard_over must be >= 1; got {shard_over}."
            )
        if shard_over > 1 and shard_over > self.replica_grouping.group_size:
            raise ValueError(
                f"VariableFactory {name!r}: shard_over={shard_over} is larger than the replica "
                f"group size {self.replica_grouping.group_size}; shards live on members of one group."
            )
        self.shard_over = shard_over
        if shard_over > 1:
            self.meta_shape: tuple[int, ...] | None = shape
            self.shape: tuple[int, ...] = (math.ceil(math.prod(shape) / shard_over),)
        else:
            self.meta_shape = None
            self.shape = shape

    @staticmethod
    def _stream(data_iter) -> Iterator[Any]:
        if callable(data_iter):
            try:
                data_iter()  # smoke test, result discarded (see Note [factory data draws])
            except Exception as e:
                raise ValueError("Passed callable via data_iter throws error.") from e
            return _endless(data_iter)
        if isinstance(data_iter, Iterable) and not isinstance(data_iter, str | bytes):
            return iter(data_iter)
        raise ValueError(
            f"data_iter must be a zero-argument callable or an iterable of host arrays; got "
            f"{type(data_iter).__name__}. Wrap a fixed array as `lambda: array`."
        )

    # ---- attributes -----------------------------------------------------------------------

    @property
    def replica_grouping(self) -> ReplicaGrouping:
        """The grouping; defaults to all replicas in one group (of the current Ir)."""
        if self._replica_grouping is None:
            self._replica_grouping = gcg().ir.replica_grouping()
        return self._replica_grouping

    @replica_grouping.setter
    def replica_grouping(self, rg: ReplicaGrouping | None) -> None:
        self._replica_grouping = rg

    @property
    def replica_sharded(self) -> bool:
        return self.meta_shape is not None

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.meta_shape if self.meta_shape is not None else self.shape

    def __repr__(self) -> str:
        meta = f", meta_shape={self.meta_shape}" if self.meta_shape else ""
        return f"VariableFactory(name={self.name!r}, shape={self.shape}, dtype={self.dtype.name}{meta})"

    # ---- data -----------------------------------------------------------------------------

    def _draw(self) -> Any:
        if self._peeked is not _NO_PEEK:
            data, self._peeked = self._peeked, _NO_PEEK
            return data
        return next(self.data_iter)

    def next_data(self, empty: bool = False) -> np.ndarray:
        """The next host array; stacked ``(num_groups, *shape)`` when the grouping has groups."""
        n = self.replica_grouping.num_groups
        if empty:
            shape = (n, *self.full_shape) if n > 1 else self.full_shape
            return np.empty(shape, dtype=self.dtype.as_numpy())
        if n > 1:
            return np.stack([_as_numpy(self._draw()) for _ in range(n)])
        return _as_numpy(self._draw())

    # ---- tensors --------------------------------------------------------------------------

    def _name(self, name: str | None, prefix: str | None = None) -> str | None:
        name = name or self.name
        if prefix:
            return f"{prefix}.{name}" if name else prefix
        return name

    def create_input(self, prefix: str | None = None) -> Tensor:
        """A graph input of the current graph with this factory's shape, dtype and meta_shape."""
        return graph_input(self.shape, self.dtype, self._name(None, prefix), by_ref=self.by_ref,
                           meta_shape=self.meta_shape)  # fmt: skip

    def create_tensor(self, name: str | None = None, empty: bool = False, memmap_dir: str | None = None,
                      read_only_if_exists: bool = False) -> Variable:  # fmt: skip
        """A main-graph variable holding the next data (always the full, unsharded data)."""
        name = self._name(name)
        data = self._memmap(name, empty, memmap_dir, read_only_if_exists)
        return variable(data, self.dtype, name, replica_grouping=self.replica_grouping)

    def _memmap(self, name, empty, memmap_dir, read_only_if_exists) -> np.ndarray:
        if memmap_dir is None:
            return self.next_data(empty)
        path = os.path.join(memmap_dir, f"{name}.npy")
        if os.path.exists(path):
            return np.load(path, mmap_mode="r" if read_only_if_exists else "r+")
        os.makedirs(memmap_dir, exist_ok=True)
        data = self.next_data(empty).astype(self.dtype.as_numpy())
        mm = np.lib.format.open_memmap(path, mode="w+", dtype=data.dtype, shape=data.shape)
        mm[...] = data
        mm.flush()
        return mm

    def create_remote_tensor(self, buffer: RemoteBuffer, entry: int, name: str | None = None,
                             empty: bool = False, memmap_dir: str | None = None,
                             read_only_if_exists: bool = False) -> Variable:  # fmt: skip
        """A remote variable at ``entry`` of ``buffer`` (replica-sharded if the buffer is)."""
        name = self._name(name)
        data = self._memmap(name, empty, memmap_dir, read_only_if_exists)
        make = remote_replica_sharded_variable if buffer.meta_shape else remote_variable
        return make(data, buffer, entry, self.dtype, name, replica_grouping=self.replica_grouping)


class NamedVariableFactories(DotTree[VariableFactory]):
    """Factories addressed by dotted keys; ``init`` turns them into variables."""

    def init(self, prefix: str | None = None, empty: bool = False, memmap_dir: str | None = None,
             read_only_if_exists: bool = False) -> NamedTensors:  # fmt: skip
        """One main-graph variable per factory, created in sorted key order, named by key."""
        made = {}
        for key, f in sorted(self.to_dict().items()):
            name = f"{prefix}.{key}" if prefix else key
            made[key] = f.create_tensor(name, empty, memmap_dir, read_only_if_exists)
        return NamedTensors.from_dict(made)

    def init_remote(self, buffers: DotTree, entry: int = 0, prefix: str | None = None,
                    empty: bool = False, memmap_dir: str | None = None,
                    read_only_if_exists: bool = False) -> NamedTensors:  # fmt: skip
        """As ``init``, but each factory becomes a remote variable in ``buffers[key]``."""
        made = {}
        for key, f in sorted(self.to_dict().items()):
            name = f"{prefix}.{key}" if prefix else key
            made[key] = f.create_remote_tensor(
                buffers[key], entry, name, empty, memmap_dir, read_only_if_exists
            )
        return NamedTensors.from_dict(made)

    def init_zero(self) -> NamedTensors:
        """A zero tensor (of the factory ``shape``: shards stay shards) per key, in the current graph."""
        return self._init_tensors("zero")

    def init_undef(self) -> NamedTensors:
        """An uninitialised tensor per key, in the current graph."""
        return self._init_tensors("undef")

    def _init_tensors(self, init_type: str) -> NamedTensors:
        made = {}
        for key, f in self.to_dict().items():
            t = ops.init(f.shape, f.dtype, key, init_type, meta_shape=f.meta_shape)
            t.graph._rename_tensor(t, key)
            made[key] = t
        return NamedTensors.from_dict(made)

    @property
    def replica_groupings(self) -> NamedReplicaGrouping:
        return NamedReplicaGrouping.from_dict(
            {k: f.replica_grouping for k, f in self.to_dict().items()}
        )


# ---- free functions -------------------------------------------------------------------------


def add_variable_input(name: str, data_iter, dtype=None, by_ref: bool = False,
                       replica_grouping: ReplicaGrouping | None = None) -> tuple[Tensor, VariableFactory]:  # fmt: skip
    """A graph input of the current graph plus the factory that makes its variables."""
    factory = VariableFactory(data_iter, dtype, name, by_ref, replica_grouping)
    return factory.create_input(), factory


def add_replica_sharded_variable_input(name: str, data_iter, dtype=None, by_ref: bool = False,
                                       replica_grouping: ReplicaGrouping | None = None,
                                       shard_over: int | None = None) -> tuple[Tensor, VariableFactory]:  # fmt: skip
    """A replica-sharded graph input (flat shard, ``meta_shape`` = full shape) and its factory.

    ``shard_over`` defaults to the grouping's group size (all replicas by default).
    """
    rg = replica_grouping if replica_grouping is not None else gcg().ir.replica_grouping()
    shard_over = rg.group_size if shard_over is None else shard_over
    factory = VariableFactory(data_iter, dtype, name, by_ref, rg, shard_over)
    return factory.create_input(), factory
