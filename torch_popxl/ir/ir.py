"""``Ir``: the whole program (graphs, variables, streams, remote buffers, replication)."""

from __future__ import annotations

import inspect
import itertools
import logging
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import given
from .graph import Graph
from .instances import layout_for
from .module import Module
from .replica_grouping import ReplicaGrouping
from .session_options import PbIr
from .tensor import Tensor, TensorByRef, TensorSpec, graph_input, graph_output
from .verify import verify_ir

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .remote_buffer import RemoteBuffer
    from .streams import DeviceToHostStream, HostToDeviceStream
    from .tensor import Variable

__all__ = ["Ir"]

_ir_ids = itertools.count()


class Ir:
    """A PopXL program: a main graph, subgraphs, variables and streams.

    ``replication`` is the global number of data-parallel replicas (an int), or ``"popdist"``
    to take it from ``$TORCH_POPXL_REPLICATION_FACTOR`` (else the world size under
    ``torchrun``, else 1). Under ``torchrun`` both spellings make every process one instance
    holding ``replication_factor / world_size`` replicas; without it the one process holds
    them all (see ``torch_popxl.runtime.distributed``).
    """

    def __init__(self, replication: int | str = 1):
        self._id = next(_ir_ids)
        self._graph_counter = itertools.count()
        self._graphs: list[Graph] = []
        self._main = Graph._create(self, "main_graph", "main_graph")
        self._graphs.append(self._main)
        self._variables: dict[str, tuple[Variable, np.ndarray]] = {}
        self._h2d_streams: list[HostToDeviceStream] = []
        self._d2h_streams: list[DeviceToHostStream] = []
        self._remote_buffers: list[RemoteBuffer] = []
        # (graph holding the load, graph whose code is loaded, destination), in creation order.
        self._code_loads: list[tuple[Graph, Graph, str]] = []
        self._param_variables: dict[int, Any] = {}
        # Gradient graphs of the custom autograd Functions captured in this Ir: {forward
        # graph: GradGraphInfo} (Note [custom autograd Functions], transforms/functions.py).
        self._function_grads: dict[Graph, Any] = {}
        self._num_host_transfers = 1
        self._sessions = 0
        self._instance_index = 0
        self._num_instances = 1
        self._popdist = replication == "popdist"
        self._pb = PbIr(self)
        if self._popdist:
            self._set_layout(layout_for("popdist"))
        else:
            self._replication_factor = 1
            self.replication_factor = replication

    def _set_layout(self, layout) -> None:
        self._num_instances = layout.num_instances
        self._instance_index = layout.instance_index
        self._replication_factor = layout.instance_replication_factor

    # ---- identity -------------------------------------------------------------------------

    @property
    def id(self) -> int:
        return self._id

    def __repr__(self) -> str:
        return f"Ir[id={self._id}]"

    def __eq__(self, other) -> bool:
        if not isinstance(other, Ir):
            raise TypeError(f"Cannot compare an Ir with {type(other).__name__}.")
        return self._id == other._id

    def __hash__(self) -> int:
        return hash(self._id)

    # ---- settings -------------------------------------------------------------------------

    @property
    def _pb_ir(self) -> PbIr:
        """Upstream's handle on PopART's internal Ir, as far as programs use it:
        ``ir._pb_ir.getSessionOptions()`` (Note [session options])."""
        return self._pb

    @property
    def main_graph(self) -> Graph:
        return self._main

    @property
    def replication_factor(self) -> int:
        """The global number of replicas."""
        return self._replication_factor * self._num_instances

    @replication_factor.setter
    def replication_factor(self, value: object) -> None:  # validated: any value may come in
        if self._sessions:
            raise RuntimeError(
                f"Cannot set replication_factor of {self!r}: a Session has been created from it "
                "and owns it now. Set the replication factor before creating the Session."
            )
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"replication_factor must be a positive int; got {value!r}.")
        if self._popdist:
            # Upstream sets the instance-local count (replicatedGraphCount) in popdist mode.
            self._replication_factor = int(value)
        else:
            # The global count: under torchrun it splits over the processes (instances.py).
            self._set_layout(layout_for(int(value)))

    @property
    def instance_replication_factor(self) -> int:
        """The number of replicas on this process."""
        return self._replication_factor

    @property
    def num_host_transfers(self) -> int:
        return self._num_host_transfers

    @num_host_transfers.setter
    def num_host_transfers(self, value: int) -> None:
        self._check_mutable()
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"num_host_transfers must be a positive int; got {value!r}.")
        self._num_host_transfers = int(value)

    def _check_mutable(self) -> None:
        if self._sessions:
            raise RuntimeError(
                f"{self!r} is owned by a Session and cannot be modified. Build the whole program "
                "before creating the Session (or build a new Ir)."
            )

    # ---- replica groupings ----------------------------------------------------------------

    def replica_grouping(self, stride: int = 1, group_size: int | None = None) -> ReplicaGrouping:
        return ReplicaGrouping._from_params(self, stride, group_size)

    def replica_grouping_from_assignments(self, assignment: list[int]) -> ReplicaGrouping:
        return ReplicaGrouping._from_assignments(self, assignment)

    def _check_grouping(self, rg: ReplicaGrouping | None) -> ReplicaGrouping:
        if rg is None:
            return self.replica_grouping()
        if not isinstance(rg, ReplicaGrouping):
            raise TypeError(f"Expected a ReplicaGrouping; got {given(rg)}.")
        if rg.ir is not self:
            raise ValueError(
                f"{rg!r} was created by {rg.ir!r}, not {self!r}. Create the grouping with "
                "this Ir's replica_grouping()."
            )
        return rg

    # ---- graphs ---------------------------------------------------------------------------

    def _new_graph_id(self, name: str) -> str:
        return f"{name}_subgraph({next(self._graph_counter)})"

    def create_empty_graph(self, name: str | None = None) -> Graph:
        self._check_mutable()
        gid = self._new_graph_id(name or "graph")
        g = Graph._create(self, gid, name or "graph")
        self._graphs.append(g)
        return g

    def create_graph(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
        """Build a subgraph by calling ``fn`` with tensor arguments replaced by graph inputs."""
        if isinstance(fn, Module):
            qualname = type(fn).__qualname__
            call = fn.build
        elif callable(fn) and hasattr(fn, "__qualname__"):
            qualname = fn.__qualname__
            call = fn
        else:
            raise TypeError(
                f"create_graph expects a callable with a __qualname__ or a popxl.Module; got "
                f"{type(fn).__name__}."
            )
        name = qualname.replace(".<locals>", "")
        graph = self.create_empty_graph(name)
        try:
            sig = inspect.signature(call)
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise ValueError(
                f"create_graph: the arguments do not match the signature of {qualname}{sig}: {e}"
            ) from e
        bound.apply_defaults()
        hints = _type_hints(call)
        with graph:
            call_args, call_kwargs = _graph_arguments(sig, bound, hints)
            result = call(*call_args, **call_kwargs)
            for out in _graph_outputs(result, qualname):
                graph_output(out)
        return graph

    @property
    def graphs(self) -> tuple[Graph, ...]:
        return tuple(self._graphs)

    # ---- streams and variables ------------------------------------------------------------

    def verify(self) -> None:
        """Check every graph's invariants (``ir/verify.py``); raise ``IrVerificationError``."""
        verify_ir(self)

    def get_all_h2d_streams(self) -> set[HostToDeviceStream]:
        return {s for s in self._h2d_streams if s._used}

    def get_all_d2h_streams(self) -> set[DeviceToHostStream]:
        return {s for s in self._d2h_streams if s._used}

    def _stream_ids(self) -> set[str]:
        """Every host stream's id (they share the main graph's tensor namespace)."""
        return {s.tensor_id for s in (*self._h2d_streams, *self._d2h_streams)}

    def _add_variable(self, v: Variable, host: np.ndarray) -> None:
        if isinstance(host, np.memmap) and not v.replica_grouping.is_const:
            # Note [memmap variables] in ir/tensor.py: a non-constant grouping is stored as
            # its constant refinement on device, so PopXL copies the memmap and says so.
            # Logged (once per variable), not warned, as upstream PopXL does.
            _log.warning(
                f"Variable {v.id!r}: you have passed np.memmap data and a non-const replica "
                f"grouping ({v.replica_grouping!r}), so the data is copied: weights_to_host "
                "will not write to the memmap."
            )
            host = np.array(host, copy=True)
        self._variables[v.id] = (v, host)

    @property
    def _all_variables(self) -> list[Variable]:
        return [v for v, _ in self._variables.values()]

    def dot_checkpoint(self, check: str, save_dir: str | None = None) -> None:
        """Debug hook of PopXL; a no-op in the simulator."""


def _type_hints(fn) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:
        return getattr(fn, "__annotations__", {}) or {}


def _is_by_ref(hint) -> bool:
    if hint is TensorByRef:
        return True
    origin = typing.get_origin(hint)
    if origin in (list, tuple, typing.Union):
        return any(a is TensorByRef for a in typing.get_args(hint))
    return False


def _as_input(x, name: str, by_ref: bool):
    if isinstance(x, Tensor | TensorSpec):
        return graph_input(x.shape, x.dtype, name, by_ref=by_ref, meta_shape=x.meta_shape)
    return x


def _container(value, name: str, by_ref: bool):
    kinds = [isinstance(v, Tensor | TensorSpec) for v in value]
    if any(kinds) and not all(kinds):
        raise TypeError(
            f"create_graph: argument {name!r} mixes tensors and non-tensors; pass tensors and "
            "other values in separate arguments."
        )
    items = [_as_input(v, f"{name}_{i}", by_ref) for i, v in enumerate(value)]
    return type(value)(items) if isinstance(value, tuple) else items


def _graph_arguments(
    sig: inspect.Signature, bound: inspect.BoundArguments, hints: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    call_args: list[Any] = []
    call_kwargs: dict[str, Any] = {}
    for pname, value in bound.arguments.items():
        param = sig.parameters[pname]
        by_ref = _is_by_ref(hints.get(pname))
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            call_args.extend(_container(tuple(value), pname, by_ref))
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            for k, v in value.items():
                call_kwargs[k] = _as_input(v, k, by_ref)
        else:
            if isinstance(value, list | tuple):
                value = _container(value, pname, by_ref)
            else:
                value = _as_input(value, pname, by_ref)
            if param.kind is inspect.Parameter.KEYWORD_ONLY:
                call_kwargs[pname] = value
            else:
                call_args.append(value)
    return call_args, call_kwargs


def _graph_outputs(result, qualname: str) -> list[Tensor]:
    if result is None:
        return []
    if isinstance(result, Tensor):
        return [result]
    try:
        outs = list(result)
    except TypeError:
        outs = None
    if outs is None or not all(isinstance(t, Tensor) for t in outs):
        raise ValueError(
            f"{qualname} must return None, a popxl Tensor or an iterable of Tensors to become a "
            f"graph; it returned {type(result).__name__}."
        )
    return outs
