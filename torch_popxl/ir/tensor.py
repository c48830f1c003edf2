"""Symbolic tensor handles: ``Tensor``, ``Variable``, ``Constant``, ``TensorSpec``.

A popxl ``Tensor`` is a handle into a graph, not a ``torch.Tensor`` subclass, so it keeps
PopXL's semantics (``dtype`` is a popxl dtype, ``==`` is identity, ``meta_shape``, ids).
It implements ``__torch_function__``: any torch function, ``torch.nn.Module`` or
``torch.Tensor`` method applied to handles inside a graph context runs on fake tensors and
is recorded at aten level (see ``capture.py``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import dtypes as _dtypes
from ..errors import DataDependentError, UndefinedValue, given
from .context import current_ipu, current_tile_set, gcg
from .fake import fake_like

if TYPE_CHECKING:
    from ..tensor_methods import _TensorMethods
    from .graph import Graph
    from .ir import Ir
    from .remote_buffer import RemoteBuffer
    from .replica_grouping import ReplicaGrouping

    # The type checker sees the operators and methods that ``tensor_methods.install`` puts on
    # Tensor at import time (Note [tensor methods are installed from above]); at run time the
    # class derives from object only.
    _InstalledMethods = _TensorMethods
else:
    _InstalledMethods = object

__all__ = [
    "Placement",
    "RtsLayout",
    "VariableInfo",
    "Tensor",
    "Variable",
    "Constant",
    "TensorSpec",
    "TensorByRef",
    "variable",
    "constant",
    "graph_input",
    "graph_output",
    "HostTensor",
]

HostTensor = np.ndarray | torch.Tensor | float | int | bool | list

# A variable's or constant's name when none is given (upstream's Graph._create_tensor_id default).
_DEFAULT_NAME = "t"


class TensorSpec(Mapping):
    """Shape, dtype and meta_shape of a tensor; the placeholder type for ``create_graph``."""

    __slots__ = ("_shape", "_dtype", "_meta_shape")

    def __init__(self, shape, dtype, meta_shape=()):
        self._shape = tuple(int(s) for s in shape)
        self._dtype = _dtypes.dtype.as_dtype(dtype)
        self._meta_shape = tuple(int(s) for s in (meta_shape or ()))

    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self._dtype)
    meta_shape = property(lambda self: self._meta_shape)

    def __getitem__(self, key):
        if key == "shape":
            return self._shape
        if key == "dtype":
            return self._dtype
        if key == "meta_shape":
            return self._meta_shape
        raise KeyError(key)

    def __iter__(self):
        return iter(("shape", "dtype", "meta_shape"))

    def __len__(self):
        return 3

    def __hash__(self):
        return hash((self._shape, self._dtype, self._meta_shape))

    def __eq__(self, other):
        if not isinstance(other, TensorSpec):
            return NotImplemented
        return (self._shape, self._dtype, self._meta_shape) == (
            other._shape,
            other._dtype,
            other._meta_shape,
        )

    def __repr__(self):
        return (
            f"TensorSpec(shape={self._shape}, dtype={self._dtype}, meta_shape={self._meta_shape})"
        )


class Tensor(_InstalledMethods):
    """A value in a popxl graph (an op output, a graph input, a variable or constant)."""

    # PopXL disables iteration and `in` on tensors (they would silently loop forever).
    __iter__ = None
    __contains__ = None
    # Make `np_array @ tensor` dispatch to the Tensor.
    __array_ufunc__ = None

    # Set by ``_create`` (handles are built with ``object.__new__``, never ``__init__``).
    _graph: Graph
    _fake: torch.Tensor
    _dtype: _dtypes.dtype
    _meta_shape: tuple[int, ...]
    _ipu: int | None
    _tile_set: str
    _id: str

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "popxl Tensors cannot be constructed directly; create them with popxl.variable, "
            "popxl.constant, popxl.graph_input or an op."
        )

    @classmethod
    def _create(cls, graph: Graph, name: str, fake: torch.Tensor, meta_shape=(), **extra):
        t = object.__new__(cls)
        t._graph = graph
        t._fake = fake
        t._dtype = _dtypes.dtype.as_dtype(fake.dtype)
        t._meta_shape = tuple(int(s) for s in meta_shape)
        t._ipu = current_ipu()
        t._tile_set = current_tile_set()
        for k, v in extra.items():
            setattr(t, k, v)
        t._id = graph._register_tensor(t, name)
        return t

    # ---- identity and naming --------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def name(self) -> str:
        """The id without the graph prefix (PopXL keeps name scopes: ``fc1/weight``)."""
        g = self._graph
        if g is g.ir.main_graph:
            return self._id
        prefix = g.id + "/"
        return self._id[len(prefix) :] if self._id.startswith(prefix) else self._id

    @property
    def scope(self) -> str:
        parts = self._id.split("/")
        start = 1 if self._graph is not self._graph.ir.main_graph else 0
        return "/".join(parts[start:-1])

    @property
    def ir(self) -> Ir:
        return self._graph.ir

    @property
    def graph(self) -> Graph:
        return self._graph

    def __eq__(self, other):
        return (
            isinstance(other, Tensor)
            and other._id == self._id
            and other._graph.ir is self._graph.ir
        )

    def __hash__(self):
        return hash((self._id, id(self._graph.ir)))

    def __repr__(self):
        return f"{type(self).__name__}[{self._id} {self._dtype.name} {self.shape}]"

    def __str__(self):
        return repr(self)

    def __bool__(self):
        # Upstream PopXL tensors have no __bool__, so `assert w`, `if t:` and `t or default` see
        # any tensor as true; that holds here for variables, constants, graph inputs and the
        # results of loads and calls. A value computed by a captured torch op is almost always
        # a data-dependent test (`if t.sum() > 0:`, torch code run on handles), which upstream
        # would silently take as true: that raises.
        producer = self._graph._producer(self)
        if producer is None or producer.kind != "torch":
            return True
        raise _data_dependent(self, "bool()")

    def __float__(self):
        raise _data_dependent(self, "float()")

    def __int__(self):
        raise _data_dependent(self, "int()")

    # ---- shape and type -------------------------------------------------------------------

    @property
    def dtype(self) -> _dtypes.dtype:
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._fake.shape)

    @property
    def rank(self) -> int:
        return self._fake.dim()

    @property
    def nelms(self) -> int:
        return math.prod(self.shape)

    @property
    def meta_shape(self) -> tuple[int, ...]:
        return self._meta_shape

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self._dtype, self._meta_shape)

    @property
    def ipu(self) -> int:
        """The IPU the tensor is on: the ``popxl.ipu(n)`` it was made in; an op's output made
        outside any ``popxl.ipu`` is on IPU 0, upstream's default virtual graph.

        Raises:
            UndefinedValue: for a variable, constant or graph input made outside any
                ``popxl.ipu`` (upstream derives theirs from the ops that use them).
        """
        if self._ipu is not None:
            return self._ipu
        if self._graph._producer(self) is not None:
            return 0
        raise UndefinedValue(
            f"Tensor {self._id!r} has no ipu set: it is not an op's output and was created "
            "outside any popxl.ipu(n); create it inside `with popxl.ipu(n):`."
        )

    @property
    def tile_set(self) -> str:
        return self._tile_set

    @property
    def in_sync_with_ipu(self) -> bool:
        return True

    def strides(self, shape=None) -> tuple[int, ...]:
        """Byte strides of a C-contiguous tensor of ``shape`` (default: this tensor's)."""
        shape = tuple(self.shape if shape is None else shape)
        item = self._dtype.as_torch().itemsize if self._dtype.as_torch() is not None else 1
        out, acc = [], item
        for s in reversed(shape):
            out.append(acc)
            acc *= s
        return tuple(reversed(out))

    def __len__(self) -> int:
        if not self.shape:
            raise ValueError(f"len() of the scalar tensor {self._id!r} is undefined.")
        return self.shape[0]


class TensorByRef(Tensor):
    """Annotation marking a ``create_graph`` parameter as pass-by-reference.

    PopXL makes it an alias annotation of ``Tensor``; a subclass does the same for the type
    checker: the annotated parameter is a tensor. It is never instantiated."""


def _data_dependent(t: Tensor, what: str):
    return DataDependentError(
        f"{what} needs the value of popxl tensor {t._id!r}, which is not known while the graph is "
        "being built (for example `if t.sum() > 0:`). Express the choice with ops such as "
        "popxl.ops.where / torch.where instead of Python control flow."
    )


@dataclass(frozen=True, slots=True)
class RtsLayout:
    """How an RTS variable's per-group value is split (Note [RTS layout] in ``remote.py``)."""

    shard_over: int
    num_elements: int

    @property
    def shard_elements(self) -> int:
        return -(-self.num_elements // self.shard_over)  # ceil(n / k)


class Placement(enum.Enum):
    """Where a variable's value lives between runs."""

    ON_CHIP = "on_chip"
    REMOTE = "remote"  # a slot of a remote buffer (streaming memory)
    REMOTE_SHARDED = "remote_sharded"  # RTS: one shard per replica in a remote buffer


@dataclass(frozen=True, slots=True, kw_only=True)
class VariableInfo:
    """Everything about a variable beyond its tensor spec; replaced, never mutated."""

    replica_grouping: ReplicaGrouping
    retrieval_mode: str | None = None
    remote: tuple[RemoteBuffer, int] | None = None  # (buffer, entry) when off chip
    shard: RtsLayout | None = None  # the RTS layout when sharded
    # Compiler hint (Note [replica-sum accumulators] in runtime/lower.py): only the sum over
    # replicas of this accumulator is ever observed, so it may be stored as that sum.
    replica_sum: bool = False

    def __post_init__(self) -> None:
        assert self.shard is None or self.remote is not None, "an RTS variable lives remotely"

    @property
    def placement(self) -> Placement:
        if self.remote is None:
            return Placement.ON_CHIP
        return Placement.REMOTE if self.shard is None else Placement.REMOTE_SHARDED


class Variable(Tensor):
    """A tensor whose value persists across ``Session.run`` calls (a weight)."""

    def __bool__(self):
        return True  # as upstream, whose tensors have no __bool__

    _info: VariableInfo

    @property
    def info(self) -> VariableInfo:
        return self._info

    @property
    def _memmap_arr(self) -> np.memmap | None:
        """The np.memmap holding this variable's host data (Note [memmap variables]), as
        upstream's private attribute of that name; None when the host data is not a memmap."""
        entry = self._graph.ir._variables.get(self._id)
        host = entry[1] if entry is not None else None
        return host if isinstance(host, np.memmap) else None

    def _set_hints(self, *, replica_sum: bool) -> None:
        """Record compiler hints (a builder's privilege, like adding ops to a graph)."""
        self._info = replace(self._info, replica_sum=replica_sum)

    @property
    def replica_grouping(self) -> ReplicaGrouping:
        return self._info.replica_grouping

    @property
    def retrieval_mode(self) -> str:
        return self._info.retrieval_mode or "one_per_group"

    @property
    def shape_on_host(self) -> tuple[int, ...]:
        n = self._info.replica_grouping.num_groups
        base = self._host_shape_base()
        return (n, *base) if n > 1 else base

    @property
    def shape_on_replica(self) -> tuple[int, ...]:
        return self.shape

    def _host_shape_base(self) -> tuple[int, ...]:
        return tuple(self.shape)


class Constant(Tensor):
    """A tensor with a fixed value known at graph-construction time."""

    _data: torch.Tensor  # the real (not fake) value, set by ``_create``

    def __bool__(self):
        return True  # as upstream, whose tensors have no __bool__

    @property
    def data(self) -> np.ndarray:
        return (
            self._data.numpy().copy()
            if self._data.dtype != torch.bfloat16
            else self._data.float().numpy()
        )


# ---- construction helpers ----------------------------------------------------------------


def _host_array(data, dtype, downcast, log2_scale, nan_on_overflow) -> np.ndarray:
    """Host data as a new array; an ``np.memmap`` is checked and returned as it is (Note
    [memmap variables])."""
    if isinstance(data, np.memmap):
        return _memmap_data(data, dtype, downcast)
    return _dtypes.to_numpy(
        data, dtype=dtype, downcast=downcast, log2_scale=log2_scale, nan_on_overflow=nan_on_overflow
    )


# Note [memmap variables]
# A variable made from an np.memmap keeps the memmap as its host storage (PopXL does not copy
# it): Session.weights_to_host writes the device values into it and flushes, so a checkpoint
# file is updated in place. Because the storage is the caller's file, nothing may convert it:
# it must be C-contiguous, already of the variable's dtype, and need no 64 -> 32 bit downcast
# (ValueError otherwise). A read-only memmap makes weights_to_host an error for the session.
# A variable with a non-constant replica grouping (one made from assignments) warns and is
# copied (Ir._add_variable); a grouped constant grouping keeps the memmap, of shape
# (num_groups, *shape).
_NEEDS_DOWNCAST = frozenset({np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.float64)})


def _memmap_data(data: np.memmap, dtype, downcast: bool) -> np.memmap:
    # The messages begin as upstream PopXL's (tests match on those prefixes).
    if not data.flags.c_contiguous:
        raise ValueError(
            "When passing a memory-mapped NumPy array, it must already be in C-ordered layout: "
            "the variable keeps it as its host storage and cannot reorder it. Create the memmap "
            "with order='C'."
        )
    if dtype is not None and np.dtype(dtype.as_numpy()) != data.dtype:
        raise ValueError(
            f"When passing a memory-mapped NumPy array, the `dtype` parameter must be None or "
            f"the array's dtype: the np.memmap has dtype {data.dtype} but dtype={dtype} was "
            f"given. The variable keeps the memmap as its host storage and cannot convert it; "
            f"open it with dtype {np.dtype(dtype.as_numpy())} or leave dtype=None."
        )
    if downcast and data.dtype in _NEEDS_DOWNCAST:
        raise ValueError(
            f"When passing a memory-mapped NumPy array, the dtype {dtype} is not supported, as "
            f"it requires downcasting the {data.dtype} data to 32 bits, which would copy it "
            f"instead of keeping the memmap as the variable's host storage. Pass downcast=False "
            f"or open the memmap with a 32-bit dtype."
        )
    if _dtypes._lookup(data.dtype) is None:
        raise ValueError(f"A np.memmap of dtype {data.dtype} cannot hold popxl variable data.")
    return data


def _torch_from_numpy(arr: np.ndarray, dt: _dtypes.dtype) -> torch.Tensor:
    if arr.dtype.fields is not None:  # float8 / bfloat16 structured arrays: their bits
        return _dtypes.numpy_to_torch(arr, dt)
    if arr.dtype in (np.uint16, np.uint32, np.uint64):
        return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("=")).copy()).to(dt.as_torch())
    return torch.from_numpy(np.array(arr, copy=True)).to(dt.as_torch())


def _fake_like(shape, dt: _dtypes.dtype) -> torch.Tensor:
    return fake_like(shape, dt.as_torch())


def constant(
    data: HostTensor,
    dtype=None,
    name: str | None = None,
    downcast: bool = True,
    log2_scale: int | None = None,
    nan_on_overflow: bool | None = None,
) -> Constant:
    """A constant tensor in the current graph (any graph)."""
    if isinstance(data, Tensor):
        raise TypeError(
            f"popxl.constant expects host data (numpy, torch, Python numbers); got the popxl "
            f"tensor {data.id!r}. Use the tensor directly."
        )
    if dtype is None and isinstance(data, np.ndarray) and data.dtype.fields is not None:
        raise TypeError(
            "popxl.constant cannot infer a float8 or bfloat16 dtype from structured numpy "
            "data; pass dtype=."
        )
    graph = gcg()
    dt = _dtypes.dtype.as_dtype(dtype) if dtype is not None else None
    arr = _host_array(data, dt, downcast, log2_scale, nan_on_overflow)
    dt = dt or _dtypes.dtype.as_dtype(arr.dtype)
    value = _torch_from_numpy(arr, dt)
    return graph._add_constant(value, dt, name or _DEFAULT_NAME)


def _constant_from_torch(graph: Graph, value: torch.Tensor, name: str = "constant") -> Constant:
    from torch.utils._python_dispatch import _disable_current_modes

    # Called while capture modes are active: the copy must be a real tensor, not a fake one.
    with _disable_current_modes():
        value = value.detach().to("cpu").clone()
    return graph._add_constant(value, _dtypes.dtype.as_dtype(value.dtype), name)


def variable(
    data: HostTensor,
    dtype=None,
    name: str | None = None,
    downcast: bool = True,
    replica_grouping: ReplicaGrouping | None = None,
    retrieval_mode: str | None = None,
    log2_scale: int | None = None,
    nan_on_overflow: bool | None = None,
) -> Variable:
    """A variable of the main graph, initialised per replica group from host ``data``."""
    graph = gcg()
    ir = graph.ir
    if graph is not ir.main_graph:
        raise ValueError(
            f"popxl.variable must be created in the main graph; the current graph is "
            f"{graph.id!r}. Use popxl.graph_input (and pass the variable at the call site) "
            "or popxl.constant inside subgraphs."
        )
    rg = ir._check_grouping(replica_grouping)
    _check_retrieval_mode(retrieval_mode)
    dt = _dtypes.dtype.as_dtype(dtype) if dtype is not None else None
    arr = _host_array(data, dt, downcast, log2_scale, nan_on_overflow)
    dt = dt or _dtypes.dtype.as_dtype(arr.dtype)
    shape = _per_replica_shape(arr.shape, rg, name)
    v = Variable._create(
        graph,
        name or _DEFAULT_NAME,
        _fake_like(shape, dt),
        _info=VariableInfo(replica_grouping=rg, retrieval_mode=retrieval_mode),
    )
    ir._add_variable(v, arr)
    return v


def _check_retrieval_mode(mode):
    if mode not in (None, "one_per_group", "all_replicas"):
        raise ValueError(
            f"retrieval_mode must be None, 'one_per_group' or 'all_replicas'; got {mode!r}."
        )


def _per_replica_shape(host_shape, rg, name) -> tuple[int, ...]:
    n = rg.num_groups
    if n == 1:
        return tuple(host_shape)
    if len(host_shape) == 0 or host_shape[0] != n:
        raise ValueError(
            f"Variable {name or _DEFAULT_NAME!r}: host data of shape {tuple(host_shape)} does not "
            f"have the group dimension. Its replica grouping has {n} groups, so the data must "
            f"have shape ({n}, *shape) with one row per group (Return mismatch with possibly "
            f"appended outer dimension should match numGroups: {n})."
        )
    return tuple(host_shape[1:])


def graph_input(
    shape, dtype, name: str | None = None, by_ref: bool = False, meta_shape=None
) -> Tensor:
    """Append a new input to the current graph."""
    graph = gcg()
    dt = _dtypes.dtype.as_dtype(dtype)
    t = Tensor._create(graph, name or "input", _fake_like(shape, dt), meta_shape or ())
    graph._add_input(t, by_ref)
    return t


def graph_output(t: Tensor) -> None:
    """Mark ``t`` as the next output of the current graph."""
    if not isinstance(t, Tensor):
        raise TypeError(f"graph_output expects a popxl Tensor; got {given(t)}.")
    graph = gcg()
    if t._graph is not graph:
        raise ValueError(
            f"graph_output: tensor {t.id!r} belongs to graph {t._graph.id!r}, not the current "
            f"graph {graph.id!r}."
        )
    graph._add_output(t)


def _iter_tensors(x) -> Iterator[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for y in x:
            yield from _iter_tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _iter_tensors(y)
