"""``Session``: runs an Ir on the simulator (spec §6).

The session owns the device state (replica-stacked variables and remote buffers) and one
host copy per variable. ``weights_from_host`` / ``weights_to_host`` move data between them
exactly as PopXL does, including the documented hazards (stale host copies, re-upload of
every variable on write).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np
import torch

from .. import dtypes as _dtypes
from ..ir.inplace import check_inplace_ambiguity
from ..ir.ir import Ir
from ..ir.streams import DeviceToHostStream, HostToDeviceStream
from ..ir.tensor import Constant, Tensor, Variable
from ..opdefs import backends, log2_scale
from . import distributed, grouped_values, remote_io, step_cache
from .executor import FastExecutor, ReferenceExecutor, SessionState
from .report import build_report

__all__ = ["DEVICE_ENV", "Session", "resolve_device"]

# The torch device a Session or popxl.compile uses when its ``device`` argument is left out, so
# an unchanged PopXL program (which never names a torch device) can run on a GPU.
DEVICE_ENV = "TORCH_POPXL_DEVICE"

_DEVICES = ("ipu_hw", "ipu_model", "cpu")


# Note [Session.device attach and detach]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Upstream's ``session.device`` is the popart ``DeviceInfo`` the session runs on, and programs
# and popxl-addons' own tests end with ``session.device.detach()`` or check
# ``session.device.isAttached``. Its ``detach()`` and ``attach()`` change the attachment only:
# no weights move. The session's context manager does the rest as upstream: entering a detached
# session attaches and writes the weights from the host, and leaving the context that attached
# it writes them back and detaches. Here the simulator is the device, so attachment is the
# session's flag; the handle also stands for the torch device the replicas live on.


class SessionDevice:
    """``Session.device``: the torch device of the replicas and upstream's ``DeviceInfo`` calls."""

    def __init__(self, session: Session):
        self._session = session

    @property
    def isAttached(self) -> bool:  # noqa: N802  (upstream's name)
        return self._session._attached

    def attach(self) -> None:
        """Attach without moving weights (upstream's ``DeviceInfo.attach``)."""
        self._session._attached = True

    def detach(self) -> None:
        """Detach without moving weights (upstream's ``DeviceInfo.detach``)."""
        self._session._attached = False

    @property
    def torch_device(self) -> torch.device:
        return self._session._torch_device

    def __getattr__(self, name: str) -> Any:  # type, index: the torch device's
        return getattr(self._session._torch_device, name)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SessionDevice):
            return self.torch_device == other.torch_device
        if isinstance(other, (str, torch.device)):
            return self.torch_device == torch.device(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.torch_device)

    def __str__(self) -> str:
        return str(self.torch_device)

    def __repr__(self) -> str:
        return f"SessionDevice({self.torch_device!s}, attached={self.isAttached})"


class Session:
    """Compile ``ir`` and run it on the simulator.

    ``device_desc`` is ``"ipu_hw"``, ``"ipu_model"`` or ``"cpu"`` (all mean the simulator).
    ``device`` picks the torch device that holds the replicas: ``"cpu"`` or ``"cuda"``
    (``"cuda:N"``); left out, ``$TORCH_POPXL_DEVICE`` or ``"cpu"``. ``executor="reference"`` runs the plain reference executor.
    ``backend="inductor"`` runs the fast executor's generated step functions through
    ``torch.compile`` (CPU; Note [inductor backend]); ``"default"`` runs them as generated.
    """

    def __init__(self, ir, device_desc: str = "cpu", weights_to_host_on_exit: bool = True, *,
                 device: str | torch.device | None = None, executor: str = "fast",
                 backend: str = "default"):  # fmt: skip
        if not isinstance(ir, Ir):
            raise TypeError(f"Session expects a popxl Ir; got {type(ir).__name__}.")
        ir.verify()
        # Upstream builds every Ir with enableInplaceAmbiguityChecking (Note [in-place ambiguity]);
        # a program may turn it off through the session options, as upstream.
        options = ir._pb_ir.getSessionOptions()
        if options.enableInplaceAmbiguityChecking:
            check_inplace_ambiguity(ir)
        # Read when the session is built, as upstream compiles the check in (Note [log2 scale
        # range check] in opdefs/log2_scale.py).
        self._check_log2_scale = bool(options.throwIfLog2ScaleTensorNotInRange)
        if device_desc not in _DEVICES:
            raise ValueError(
                f"Incorrect device type provided {device_desc!r}: expected one of {_DEVICES} (all "
                "run the simulator)."
            )
        if executor not in ("fast", "reference"):
            raise ValueError(f"executor must be 'fast' or 'reference'; got {executor!r}.")
        check_backend(backend, executor)
        self._ir = ir
        self._device_desc = device_desc
        self.weights_to_host_on_exit = weights_to_host_on_exit
        self._torch_device = resolve_device(device)
        self._device_info: object = None  # Note [Session.device assignment]
        R = ir.instance_replication_factor
        self._state = SessionState(R, self._torch_device)
        self._attached = False
        self._attach_stack: list[bool] = []
        self._in_sync = True
        # Host copies: one_per_group data (shape_on_host); all_replicas reads go to _host_all.
        self._host: dict[str, np.ndarray] = {}
        self._host_all: dict[str, np.ndarray] = {}
        for v, data in ir._variables.values():
            # Note [memmap variables] (ir/tensor.py): a memmap stays the host storage.
            self._host[v.id] = data if isinstance(data, np.memmap) else np.array(data, copy=True)
        self._read_only_memmaps = sorted(
            v.id
            for v, data in ir._variables.values()
            if isinstance(data, np.memmap) and not data.flags.writeable
        )
        if self._read_only_memmaps:
            # PopXL turns weights_to_host on exit off: it would write into read-only files.
            self.weights_to_host_on_exit = False
        self._last_run_counters: dict[str, int] | None = None  # traffic of the last run
        ir._sessions += 1
        # The Ir is frozen from here on: its stream sets are fixed, so compute them once.
        self._inputs_expected = frozenset(ir.get_all_h2d_streams())
        self._outputs_expected = frozenset(ir.get_all_d2h_streams())
        self._outputs_in_order = sorted(self._outputs_expected, key=lambda s: s._index)
        self._executor = (
            FastExecutor(ir, self._torch_device, backend)
            if executor == "fast"
            else ReferenceExecutor(ir, self._torch_device)
        )
        # One PopXL instance per process under torch.distributed (runtime/distributed.py): this
        # session holds the local replicas [offset, offset + R) of the global ones.
        self._replica_offset = ir._instance_index * R
        self._collectives = None
        if ir._num_instances > 1:
            self._collectives = distributed.collectives_for(ir, self._torch_device)
        self._allocate()

    # ---- properties -----------------------------------------------------------------------

    @property
    def ir(self):
        return self._ir

    @property
    def device(self) -> SessionDevice:
        """Where the replicas live (equal to that ``torch.device``, with its ``type`` and
        ``index``), answering upstream's ``DeviceInfo`` calls: ``attach()``, ``detach()``,
        ``isAttached`` (Note [Session.device attach and detach])."""
        return SessionDevice(self)

    @device.setter
    def device(self, device) -> None:
        # Note [Session.device assignment]: upstream's setter stores a popart.DeviceInfo that
        # the session attaches to later (apps hand it one from popdist or a device manager).
        # The simulator is the device here, so such an object is kept, unused; a torch device
        # names where the replicas live, which is fixed when the session is built.
        if not isinstance(device, (str, torch.device)):
            self._device_info = device
            return
        dev = resolve_device(device)
        if dev != self._torch_device:
            raise ValueError(
                f"Session.device = {str(device)!r}: this session holds its replicas on "
                f"{self._torch_device} and cannot move them; build it with "
                f"Session(..., device={str(device)!r}) instead."
            )

    @property
    def _pb_session(self) -> PbSession:
        """Upstream's handle on the PopART session, as far as Graphcore's applications use it
        (their ``write_variables_pb``): ``writeWeights`` and ``weightsFromHost``."""
        return PbSession(self)

    @property
    def is_attached(self) -> bool:
        return self._attached

    @property
    def _extra_input_dims(self) -> tuple[int, ...]:
        nht, irf = self._ir.num_host_transfers, self._ir.instance_replication_factor
        return (nht,) * (nht > 1) + (irf,) * (irf > 1)

    def _full_input_shape(self, shape) -> tuple[int, ...]:
        return self._extra_input_dims + tuple(shape)

    def expected_inputs(self) -> set[HostToDeviceStream]:
        return set(self._inputs_expected)

    # ---- attach / detach ------------------------------------------------------------------

    def __enter__(self) -> Session:
        was = self._attached
        self._attach_stack.append(was)
        if not was:
            self._attached = True
            self.weights_from_host()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        was = self._attach_stack.pop()
        if was:
            return
        try:
            if exc_type is None and self.weights_to_host_on_exit:
                self.weights_to_host()
        finally:
            self._attached = False

    def _require_attached(self, what: str) -> None:
        if not self._attached:
            raise ValueError(
                f"Must be attached to device before calling a runtime function ({what}). Use "
                "`with session:` around it."
            )

    # ---- device state ---------------------------------------------------------------------

    def _allocate(self) -> None:
        R, dev = self._state.num_replicas, self._torch_device
        for v in self._executor.on_chip:
            self._state.vars[v.id] = self._executor.allocate(self._state, v)
        for rb in self._ir._remote_buffers:
            shape = (R, rb.entries, *rb.tensor_shape)
            self._state.buffers[rb.remote_buffer_id] = torch.zeros(
                shape, dtype=rb.tensor_dtype.as_torch(), device=dev
            )

    def _replica_groups(self, v: Variable) -> list[int]:
        """Global group index of every local replica for ``v``'s grouping."""
        R = self._state.num_replicas
        return list(v.replica_grouping.assignment)[self._replica_offset : self._replica_offset + R]

    def _run_fragment(self, fragment: str, ins: list[torch.Tensor], nht: int):
        # Every fragment runs inside a traffic scope (they take turns across threads), so no
        # weights_from_host of one session is counted in another session's run. The scope's
        # counts are kept: the "normal" fragment's are the last run's figures. Large blocks the
        # fragment frees are kept for its next run (Note [step cache] in csrc/step_cache.cpp).
        with (
            backends.traffic_scope() as counted,
            step_cache.running(),
            log2_scale.checking(self._check_log2_scale),
        ):
            if self._collectives is None:  # (one process: no context to enter every step)
                result = self._executor.run(self._state, fragment, ins, nht)
            else:
                with backends.use_collectives(self._collectives):
                    result = self._executor.run(self._state, fragment, ins, nht)
        if fragment == "normal":
            self._last_run_counters = counted
        return result

    def _global_rows(self, rows: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """``[R_local, ...]`` -> ``[R, ...]`` in global replica order (gathered from every
        instance; ``invariant`` rows are the same everywhere and need no gather)."""
        if self._collectives is None:
            return rows
        return self._collectives.gather_rows(rows, invariant)

    def _local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, ...]`` -> this instance's ``[R_local, ...]``."""
        return rows[self._replica_offset : self._replica_offset + self._state.num_replicas]

    def weights_from_host(self) -> None:
        """Upload every variable's host copy to every replica (then run WeightsFromHost)."""
        self._require_attached("weights_from_host")
        for v in self._executor.on_chip:
            _write_rows(self._state.vars[v.id], self._per_replica(v, self._host[v.id]))

        remote_io.upload_remote_variables(self)
        self._run_fragment("weights_from_host", [], 1)

    def _per_replica(self, v: Variable, host: np.ndarray) -> torch.Tensor:
        # numpy_to_torch reads structured float8 / bfloat16 host arrays as their bits.
        data = _dtypes.numpy_to_torch(host, v.dtype).to(self._torch_device)
        return grouped_values.replica_values(v, data, self._replica_groups(v))

    def weights_to_host(self) -> None:
        """Read every variable back into its host copy (after running WeightsToHost)."""
        self._require_attached("weights_to_host")
        if self._read_only_memmaps:
            raise RuntimeError(
                f"weights_to_host cannot run: the variables {self._read_only_memmaps} are backed "
                "by read-only np.memmap arrays, which it would write. Open the memmaps with "
                "mode='r+' (or 'w+'), or read values with a d2h stream."
            )
        self._run_fragment("weights_to_host", [], 1)
        invariant: frozenset[str] = getattr(self._executor, "uniform", frozenset())
        for v in self._executor.on_chip:
            value = self._global_rows(self._state.vars[v.id], v.id in invariant)
            self._store_host(v, value)

        remote_io.download_remote_variables(self)
        self._in_sync = True

    def _store_host(self, v: Variable, value: torch.Tensor) -> None:
        """``value`` is ``[R, *shape]``: keep the first member of each group (and all rows)."""
        rows = value.detach().cpu()
        host = _dtypes.torch_to_numpy(rows[grouped_values.first_members(v)], v.dtype)
        self._set_host(v, grouped_values.from_groups(v, host))
        self._host_all[v.id] = _dtypes.torch_to_numpy(rows, v.dtype)

    def _set_host(self, v: Variable, host: np.ndarray) -> None:
        """Replace ``v``'s host value; a memmap is written in place and flushed."""
        current = self._host.get(v.id)
        if isinstance(current, np.memmap):
            current[...] = host
            current.flush()
        else:
            self._host[v.id] = host

    # ---- reading and writing tensors ------------------------------------------------------

    def get_tensor_data(self, tensor: Tensor) -> np.ndarray:
        return self.get_tensors_data([tensor])[tensor]

    def get_tensors_data(self, tensors) -> dict[Tensor, np.ndarray]:
        tensors = list(tensors)
        for t in tensors:
            if not isinstance(t, Variable | Constant):
                # Upstream's message beginning (programs match it), then the way out.
                raise TypeError(
                    f"{t} is not of type Constant or Variable. get_tensor_data is not supported "
                    "for this type. Read intermediate tensors through a d2h stream "
                    "(ops.host_store)."
                )
            if t.ir is not self._ir:
                raise ValueError(
                    f"Tensor {t.id!r} belongs to {t.ir!r}, not this session's {self._ir!r}."
                )
        if any(isinstance(t, Variable) for t in tensors) and self._attached and not self._in_sync:
            self.weights_to_host()
        out: dict[Tensor, np.ndarray] = {}
        for t in tensors:
            if isinstance(t, Constant):
                out[t] = _dtypes.torch_to_numpy(t._data, t.dtype)
            elif t.retrieval_mode == "all_replicas":
                out[t] = self._host_all.get(t.id, self._all_from_host(t))
            else:
                out[t] = self._host[t.id]
        return out

    def _all_from_host(self, v: Variable) -> np.ndarray:
        # every global replica's row (a copy: fancy indexing)
        return grouped_values.by_group(v, self._host[v.id])[v.replica_grouping.assignment]

    def write_variable_data(self, tensor: Variable, data) -> None:
        self.write_variables_data({tensor: data})

    def write_variables_data(self, tensors: Mapping[Variable, Any]) -> None:
        """Replace host copies (and the device values, when attached)."""
        staged: dict[str, np.ndarray] = {}
        for v, data in tensors.items():
            if not isinstance(v, Variable):
                name = getattr(v, "id", repr(v))
                raise TypeError(
                    f"Tensor {name} is not of type Variable. write_variable_data is not "
                    f"supported for this type. Got a {type(v).__name__}; only variables can be "
                    "written (constants are fixed when the Ir is built)."
                )
            if v.ir is not self._ir:
                raise ValueError(
                    f"Variable {v.id!r} belongs to {v.ir!r}, not this session's {self._ir!r}."
                )
            if isinstance(data, bool | int | float | np.number):
                if v.dtype.name.startswith("float8"):
                    raise TypeError(
                        f"Cannot write a Python number to the float8 variable {v.id!r}."
                    )
                data = np.array(data, dtype=v.dtype.as_numpy())
            data = check_host_data(v, data, "write_variables_data")
            if v.retrieval_mode == "all_replicas" and v.replica_grouping.group_size > 1:
                raise NotImplementedError(
                    f"Writing the all_replicas variable {v.id!r} (group size > 1) is not supported by "
                    "PopXL; create it with retrieval_mode='one_per_group' to write it."
                )
            if v.id in self._read_only_memmaps:
                raise ValueError(
                    f"Variable {v.id!r} is backed by a read-only np.memmap and cannot be "
                    "written. Open the memmap with mode='r+' to write it."
                )
            staged[v.id] = np.array(data, copy=True)
        # Every check passed: now write (all or nothing).
        by_id = {v.id: v for v in tensors}
        for vid, data in staged.items():
            self._set_host(by_id[vid], data)
        for vid in staged:
            self._host_all.pop(vid, None)
        if self._attached:
            self.weights_from_host()

    # ---- live device values (used by popxl.compile) --------------------------------------

    def _bind_variable(self, v: Variable, tensor: torch.Tensor) -> bool:
        """Make ``tensor`` the storage of the on-chip variable ``v`` on every local replica, so
        that runs update it in place and in-place edits of it are seen by the next run.

        Only possible where the replicas share one copy (a replica-invariant variable, or a
        single replica) and ``tensor`` matches the storage's shape, dtype and device; returns
        False otherwise (the caller then copies). ``tensor``'s value becomes the variable's.
        """
        storage = self._state.vars.get(v.id)
        R = self._state.num_replicas
        if (
            storage is None
            or tuple(tensor.shape) != tuple(v.shape)
            or tensor.dtype != storage.dtype
            or tensor.device != storage.device
            or not tensor.is_contiguous()
            or not (R == 1 or (storage.dim() > 0 and storage.stride(0) == 0))
        ):
            return False
        self._state.vars[v.id] = tensor.expand(R, *tensor.shape)
        self._in_sync = False  # the host copy no longer follows the device value
        return True

    def _device_rows(self, v: Variable) -> torch.Tensor:
        """The live ``[R_local, *shape]`` device value of the on-chip variable ``v``."""
        return self._state.vars[v.id]

    def _set_device_value(self, v: Variable, value: torch.Tensor) -> None:
        """Write ``value`` (one replica's value) to every local replica of the on-chip
        variable ``v``, without re-uploading the other variables."""
        storage = self._state.vars[v.id]
        _write_rows(storage, value.to(storage.device, storage.dtype).expand(storage.shape))
        self._in_sync = False

    # ---- running --------------------------------------------------------------------------

    def create_host_outputs(self) -> dict[DeviceToHostStream, np.ndarray]:
        return {
            s: np.empty(self._full_input_shape(s.shape), dtype=s.dtype.as_numpy())
            for s in self._outputs_in_order
        }

    def run(
        self, inputs: Mapping | None = None, downcast_inputs: bool = True
    ) -> dict[DeviceToHostStream, np.ndarray]:
        """Run the main program once; returns one array per d2h stream."""
        self._require_attached("run")
        outputs = self.create_host_outputs()
        self._run(inputs, outputs, downcast_inputs, verify_outputs=False)
        return outputs

    def run_with_outputs(self, inputs: Mapping | None = None, outputs: Mapping | None = None,
                         downcast_inputs: bool = True) -> None:  # fmt: skip
        """Run the main program once, filling the caller's ``outputs`` arrays in place."""
        self._require_attached("run_with_outputs")
        self._run(inputs, outputs, downcast_inputs, verify_outputs=True)

    def _run(self, inputs, outputs, downcast_inputs: bool, verify_outputs: bool) -> None:
        inputs = dict(inputs or {})
        outputs = dict(outputs or {})
        self._validate_run_io_streams(inputs, self._inputs_expected, shapes=False)
        if verify_outputs:  # arrays made by create_host_outputs are right by construction
            self._validate_run_outputs(outputs)
        stored = self._run_stacked(self._stream_inputs(inputs, downcast_inputs))
        self._fill_outputs(outputs, stored)

    def _stream_inputs(self, inputs: Mapping, downcast: bool) -> list[torch.Tensor]:
        """Every h2d stream's input (a zero slot for a stream without one) as ``Tensor[nht,
        R, *shape]`` on the session device, in stream order, each checked (``_input_tensor``)."""
        return [
            self._input_tensor(s, inputs[s], downcast, copy=self._input_written(s))
            if s in inputs
            else self._unused_input(s)
            for s in self._ir._h2d_streams  # in index order (appended as created)
        ]

    def _input_written(self, s: HostToDeviceStream) -> bool:
        """Whether the program updates the value it loads from ``s`` in place, so that its
        input must be a private copy (Note [inputs are never written]; True for an executor
        that cannot say)."""
        written = getattr(self._executor, "written_streams", None)
        return written is None or s._index in written

    def _run_stacked(self, ins: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Run the main program on inputs already in the stacked layout ``_stream_inputs``
        gives (the caller vouches for their shapes and dtypes); returns each d2h stream's
        stored values, ``[stores, R, *shape]`` or folded ``[1, stores * R, *shape]``, by
        stream index."""
        self._require_attached("run")
        stored = self._run_fragment("normal", ins, self._ir.num_host_transfers)
        self._in_sync = False  # (the run also recorded its traffic)
        return stored

    def _host_outputs(
        self, stored: dict[int, torch.Tensor]
    ) -> dict[DeviceToHostStream, np.ndarray]:
        """A run's stored values as ``run`` returns them: one array per d2h stream."""
        outputs = self.create_host_outputs()
        self._fill_outputs(outputs, stored)
        return outputs

    def _fill_outputs(self, outputs: Mapping, stored: dict[int, torch.Tensor]) -> None:
        """Write a run's stored values into the d2h streams' host arrays."""
        for s, arr in outputs.items():
            values = stored.get(s._index)
            if values is None:
                continue
            self._fill_output(s, arr, values)

    def _validate_run_inputs(self, inputs: Mapping) -> None:
        """Check ``inputs`` (h2d stream -> array) as ``run`` does: exactly the expected streams,
        each array of the full shape. Raises ValueError with upstream's messages."""
        self._validate_run_io_streams(inputs, self._inputs_expected)

    def _validate_run_outputs(self, outputs: Mapping) -> None:
        """Check ``outputs`` (d2h stream -> array) as ``run_with_outputs`` does."""
        self._validate_run_io_streams(outputs, self._outputs_expected)

    def _validate_run_io_streams(self, given: Mapping, expected: AbstractSet,
                                 shapes: bool = True) -> None:  # fmt: skip
        given_set = set(given)
        if given_set != set(expected):
            kind = "input"
            if any(isinstance(s, DeviceToHostStream) for s in (*given_set, *expected)):
                kind = "output"
            unexpected = {_describe_key(s, self._ir) for s in given_set - set(expected)}
            missing = {s.tensor_id for s in set(expected) - given_set}
            raise ValueError(
                f"Unexpected/Missing {kind}.\n  Unexpected: {unexpected or '{}'}\n  "
                f"Missing: {missing or '{}'}\n(Expected exactly the streams "
                f"{sorted(s.tensor_id for s in expected)}: one array for each stream the "
                "program loads or stores.)"
            )
        if shapes:
            for s, arr in given.items():
                kind = "input" if isinstance(s, HostToDeviceStream) else "output"
                self._verify_shape(s, np.asarray(arr), kind)

    def _verify_shape(self, s, arr: np.ndarray, kind: str) -> None:
        # Upstream's checks and message beginnings (Session._verify_io_shape).
        nht, irf = self._ir.num_host_transfers, self._ir.instance_replication_factor
        expected = self._full_input_shape(s.shape)
        idx = 0
        if nht > 1:
            if arr.ndim < 1 or arr.shape[0] < nht:
                got = arr.shape[0] if arr.ndim else "a scalar"
                raise ValueError(
                    f"Dimension 0 ({got}) for the array provided for {kind} stream "
                    f"{s.tensor_id} is not large enough.\nIt should be at least of size "
                    f"num_host_transfers = {nht} (full shape {expected}; got {arr.shape})."
                )
            idx += 1
        if irf > 1:
            if arr.ndim <= idx or arr.shape[idx] != irf:
                got = arr.shape[idx] if arr.ndim > idx else "missing"
                raise ValueError(
                    f"Dimension {idx} ({got}) for the array provided for {kind} stream "
                    f"{s.tensor_id} is the wrong size.\nIt should be of size replication_factor "
                    f"= {irf} (full shape {expected}; got {arr.shape})."
                )
            idx += 1
        if arr.squeeze().shape[idx:] == () and math.prod(s.shape) == 1:
            return
        if arr.squeeze().shape[idx:] == () and arr.size == math.prod(expected):
            return
        if tuple(arr.shape[idx:]) != tuple(s.shape):
            raise ValueError(
                f"Shape mismatch for {kind} stream {s.tensor_id}:\nStream shape = {s.shape}, "
                f"therefore expected full global batch shape {expected}. Got array shape = "
                f"{arr.shape} (num_host_transfers={nht}, replicas={irf})."
            )

    def _unused_input(self, s: HostToDeviceStream) -> torch.Tensor:
        # A stream without host_load is not an expected input; its slot is never read.
        nht, R = self._ir.num_host_transfers, self._ir.instance_replication_factor
        return torch.zeros((nht, R, *s.shape), dtype=s.dtype.as_torch(), device=self._torch_device)

    def _input_tensor(
        self, s: HostToDeviceStream, data, downcast: bool, copy: bool = True
    ) -> torch.Tensor:
        """Normalise an input to ``Tensor[nht, R, *shape]`` on the session device; ``copy``:
        never share memory with ``data`` (needed when the program writes the loaded value)."""
        if isinstance(data, torch.Tensor):
            data = data.detach().cpu()
            # numpy has no float8 / bf16: to_numpy keeps those as their bits (a copy); other
            # tensors are viewed, and copied below only if the program writes them.
            data = (
                _dtypes.to_numpy(data, downcast=False)
                if data.dtype in _dtypes.TORCH_BIT_DTYPES
                else data.numpy()
            )
        arr = np.asarray(data)
        if arr.dtype.kind not in "biufc" and arr.dtype.fields is None:
            raise TypeError(
                f"Input for stream {s.tensor_id!r} has dtype {arr.dtype}, which cannot be converted "
                f"to the stream dtype {s.dtype.name}; pass numbers (numpy, torch, lists, scalars)."
            )
        if downcast:
            arr = _downcast(arr)
        _check_stream_dtype(s, arr.dtype)
        self._verify_shape(s, arr, "input")
        nht, R = self._ir.num_host_transfers, self._ir.instance_replication_factor
        if nht > 1 and arr.shape[0] > nht:
            arr = arr[:nht]
        arr = arr.reshape(nht, R, *s.shape)
        if arr.dtype.fields is not None:  # float8 / bf16 host data: its bits (dtypes.py)
            arr = arr.view(np.uint8)
        t = torch.from_numpy(np.ascontiguousarray(arr))
        if t.dtype == torch.uint8 and s.dtype.as_numpy().fields is not None:
            t = t.view(s.dtype.as_torch())
        # Note [inputs are never written]: the program may update a loaded tensor in place
        # (``+=``, an in-place all-reduce); the caller's array must never change, so such
        # inputs are copied. The others may share the caller's memory: nothing writes them.
        return t.to(device=self._torch_device, dtype=s.dtype.as_torch(), copy=copy)

    def _fill_output(self, s: DeviceToHostStream, arr: np.ndarray, values: torch.Tensor) -> None:
        nht, R = self._ir.num_host_transfers, self._ir.instance_replication_factor
        full = self._full_input_shape(s.shape)
        if values.shape[0] == nht and arr.shape == full and values.dtype in _PLAIN_DTYPES:
            # The common case: every entry written once; one copy straight into the array.
            np.copyto(arr, values.detach().cpu().reshape(full).numpy(), casting="unsafe")
            return
        count = min(values.shape[0], nht)
        # dim 0 may exceed nht (accepted by the shape check); reshape may copy, so write back.
        target = arr[:nht] if nht > 1 else arr
        view = target.reshape(nht, R, *s.shape)
        copied = not np.may_share_memory(view, target)
        view[:count] = _dtypes.torch_to_numpy(values[:count].detach().cpu(), s.dtype, copy=False)
        if count < values.shape[0]:  # more stores than entries: later ones wrap around
            for i in range(count, values.shape[0]):
                view[i % nht] = _dtypes.torch_to_numpy(values[i].detach().cpu(), s.dtype)
        if copied:
            target[...] = view.reshape(target.shape)

    # ---- introspection --------------------------------------------------------------------

    def memory_report(self, cost_model=None):
        """Per-replica memory, per-run traffic (IR and runtime counters) and a step-time
        estimate; see ``torch_popxl.runtime.report.MemoryReport``. ``print()`` it for a table."""

        return build_report(self.ir, self._executor.facts, self._last_run_counters, cost_model)

    def explain(self) -> list[str]:
        """What of this program runs on a slow path, one line per fragment with the reason
        (the first op without a stacked rule, say); an empty list when everything runs on
        the fast path. Nothing is printed while a program runs: this is where to look."""
        return self._executor.explain()

    def generated_code(self) -> str:
        """The Python the fast executor generated for this Ir."""
        if not isinstance(self._executor, FastExecutor):
            raise ValueError("generated_code() is only available with executor='fast'.")
        return self._executor.source()


class PbSession:
    """``Session._pb_session``. Graphcore's applications write weights through PopART:
    ``session._pb_session.writeWeights(popart.PyWeightsIO({tensor id: array}))`` and then, when
    attached, ``weightsFromHost()``. ``writeWeights`` takes any mapping of variable ids to
    arrays and writes them with ``Session.write_variables_data`` (checked, all-or-nothing; the
    device values too when attached), so ``weightsFromHost`` has nothing left to do."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def writeWeights(self, weights: Mapping[str, Any]) -> None:  # noqa: N802 (PopART's name)
        by_id = {v.id: v for v in self._session.ir._all_variables}
        unknown = sorted(str(k) for k in weights if k not in by_id)
        if unknown:
            raise KeyError(
                f"Session._pb_session.writeWeights: no variable with id {unknown} in this "
                f"session's Ir; the keys are variable ids (tensor.id), e.g. {sorted(by_id)[:3]}."
            )
        self._session.write_variables_data({by_id[k]: v for k, v in weights.items()})

    def weightsFromHost(self) -> None:  # noqa: N802 (PopART's name)
        """A no-op: ``writeWeights`` already wrote the device values of an attached session."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device that holds the replicas: ``device``, or ``$TORCH_POPXL_DEVICE`` when it
    is None, or the CPU. Only CPU and CUDA devices run the simulator."""
    where = "device"
    if device is None:
        device, where = os.environ.get(DEVICE_ENV) or "cpu", f"${DEVICE_ENV}"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{where} must be 'cpu' or 'cuda'; got {device!r} ({e}).") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{where} must be 'cpu' or 'cuda'; got {device!r}.")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{where}={str(device)!r}: no CUDA GPU is available to this torch build. Use "
            "'cpu' (the default) to run the simulator on the CPU."
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"{where}={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA "
            "device(s); use 'cuda' or 'cuda:N' with N below that."
        )
    return dev


def check_backend(backend, executor) -> str:
    """``backend`` (Note [inductor backend]) if it is one, and usable with ``executor``."""
    if backend not in ("default", "inductor"):
        raise ValueError(f"backend must be 'default' or 'inductor'; got {backend!r}.")
    if backend != "default" and executor != "fast":
        raise ValueError(
            f"backend={backend!r} needs executor='fast' (the reference executor has no "
            "generated step function to compile)."
        )
    return backend


def check_host_data(v: Variable, data, who: str) -> np.ndarray:
    """``data`` as an array for ``v``: the exact numpy dtype (no implicit cast) and
    ``shape_on_host``, or a TypeError / ValueError naming the variable."""
    data = np.asarray(data)
    if data.dtype != v.dtype.as_numpy():
        raise TypeError(
            f"The dtype of the input array {data.dtype} must match the equivalent type of the "
            f"tensor {v.id} : {v.dtype} ({who}; convert the data first, there is no implicit "
            "cast)."
        )
    if tuple(data.shape) != tuple(v.shape_on_host):
        raise ValueError(
            f"The shape of the input array {tuple(data.shape)} must match the shape of the "
            f"tensor {v.id} : {tuple(v.shape_on_host)} ({who}; the shape on host, with the "
            "replica-group dimension when the variable has several groups)."
        )
    return data


def _check_stream_dtype(s: HostToDeviceStream, given: np.dtype) -> None:
    """Reject host data that the stream's dtype cannot hold without changing its kind: float
    into an integer stream would be silently truncated, complex would lose its imaginary
    part, anything but bool would become bool. PopXL raises a type-discrepancy error there.
    Conversions within or up the kind order (float16 -> float32, int -> float, a Python int
    scalar into a float stream) are accepted, as before. float8 streams also take raw uint8.
    """
    expected = s.dtype.as_numpy()
    if s.dtype.name.startswith("float8"):
        if given == expected or given == np.uint8 or given.kind == "f":
            return
    elif expected.fields is not None:  # bfloat16: its bits, or numbers converted by torch
        if given == expected or given.kind in "biuf":
            return
    elif np.can_cast(given, expected, casting="same_kind"):
        return
    raise TypeError(
        f"Type discrepancy for input stream {s.tensor_id!r}: the data has dtype {given}, the "
        f"stream has dtype {expected}, and {given} -> {expected} would change the values' kind "
        f"(e.g. truncate floats). Convert the data explicitly, e.g. `np.round(data).astype("
        f"np.{expected})`, or create the stream with dtype {given}."
    )


def _write_rows(storage: torch.Tensor, rows: torch.Tensor) -> None:
    """Copy ``rows`` ([R, *shape]) into a variable's storage; replica-invariant storage is an
    expanded view of one copy, so it takes the (identical) first row."""
    if storage.dim() > 0 and storage.stride(0) == 0 and storage.shape[0] > 1:
        storage[0].copy_(rows[0])
    else:
        storage.copy_(rows)


def _describe_key(s, ir) -> str:
    if not hasattr(s, "tensor_id"):
        return repr(s)
    return s.tensor_id if s._ir is ir else f"{s.tensor_id} (a stream of another Ir)"


def _downcast(arr: np.ndarray) -> np.ndarray:
    table = {
        np.dtype(np.float64): np.float32,
        np.dtype(np.int64): np.int32,
        np.dtype(np.uint64): np.uint32,
    }
    to = table.get(arr.dtype)
    return arr.astype(to) if to is not None else arr


_PLAIN_DTYPES = frozenset({torch.float32, torch.float16, torch.float64, torch.int32, torch.int64, torch.int8,
                           torch.int16, torch.uint8, torch.bool, torch.complex64, torch.complex128})  # fmt: skip
