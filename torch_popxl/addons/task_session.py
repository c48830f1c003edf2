"""``TaskSession``: a ``Session`` that knows its named input / output streams and its state
(weights and optimizer state as ``NamedTensors``), and saves and restores that state.

The API is popxl-addons 3.4's: ``TaskSession(inputs, outputs, state, max_checkpoints=1, *args,
**kwargs)`` (the rest goes to ``Session``), and a checkpoint is a *directory*::

    <checkpoint_dir>/model/<flat key>.npz    one per state tensor ("fc1.weight.npz"), holding
                                             one array under the key, exactly as the session
                                             holds it (dtype and replica layout included)
    <checkpoint_dir>/model/<name>.npy        instead, for a tensor held in an ``.npy`` memmap
                                             file: a copy of that file
    <checkpoint_dir>/session_info.json       ``session_state`` (``{"steps": <runs>}`` plus what
                                             ``add_session_state_info`` added)
    <checkpoint_dir>/dataloader.bin          the ``dataloader``'s state, when one is set

so a restored run continues bit for bit. Loading is all-or-nothing: every file is read and
every array checked against its variable before anything is written (upstream writes the
variables before it reads the session info). The older API (``model=``, one ``.npz`` file) is
still accepted: ``model=`` as a keyword, the ``Ir`` as the 4th positional argument
(``TaskSession(inputs, outputs, model, ir, device_desc)``), and ``load_checkpoint`` of an
``.npz`` file.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np

from ..errors import given
from ..ir.ir import Ir
from ..ir.tensor import Tensor, Variable
from ..runtime.session import Session
from .named_tensors import NamedTensorData, NamedTensors
from .streams import InputStreams, OutputStreams
from .utils import timer

__all__ = ["TaskSession", "write_variables_pb", "initialise_memmap_dir_from_checkpoint"]

ReportMissingMethods = Literal["none", "warn", "error"]
_REPORT = ("none", "warn", "error")
_SESSION_FILE = "session_info.json"
_DATALOADER_FILE = "dataloader.bin"
_MODEL_DIR = "model"


def write_variables_pb(session: Session, weights: Mapping[Variable, np.ndarray]) -> None:
    """Write ``{variable: data}`` into ``session`` (upstream's workaround name for
    ``Session.write_variables_data``; the same here)."""
    session.write_variables_data(weights)


class TaskSession(Session):
    """``Session`` plus ``inputs`` (``InputStreams``), ``outputs`` (``OutputStreams``), ``state``
    (the ``NamedTensors`` a checkpoint holds) and ``session_state`` (``{"steps": N}``: ``run``
    counts itself; a checkpoint stores it).

    ``max_checkpoints``: how many checkpoint directories saved by this session are kept; saving
    one more removes the oldest one's checkpoint files.
    """

    def __init__(self, inputs: InputStreams | Iterable, outputs: OutputStreams | Iterable,
                 state: NamedTensors | None = None, max_checkpoints: int = 1, *args,
                 model: NamedTensors | None = None, **kwargs):  # fmt: skip
        if model is not None:  # the pre-3.4 keyword
            if state is not None:
                raise TypeError("TaskSession: give state= (popxl-addons 3.4) or model=, not both.")
            state = model
        if not isinstance(state, NamedTensors):
            raise TypeError(
                f"TaskSession: state must be NamedTensors (the variables a checkpoint holds), "
                f"got {given(state)}."
            )
        if isinstance(max_checkpoints, Ir):
            # The pre-3.4 signature TaskSession(inputs, outputs, model, *session_args): the 4th
            # positional is the Session's ir (BERT's squad_inference.py). An Ir is never a
            # checkpoint count, so the two signatures cannot be confused.
            args = (max_checkpoints, *args)
            max_checkpoints = 1
        if isinstance(max_checkpoints, bool) or not isinstance(max_checkpoints, int):
            raise TypeError(
                f"TaskSession: max_checkpoints must be an int, got "
                f"{type(max_checkpoints).__name__}."
            )
        if max_checkpoints < 1:
            raise ValueError(f"TaskSession: max_checkpoints must be >= 1, got {max_checkpoints}.")
        with timer("PopXL compilation"):
            super().__init__(*args, **kwargs)
        self.inputs = (
            inputs if isinstance(inputs, InputStreams) else InputStreams.from_streams(inputs)
        )
        self.outputs = (
            outputs if isinstance(outputs, OutputStreams) else OutputStreams.from_streams(outputs)
        )
        self.state = state
        self.session_state: dict[str, Any] = {"steps": 0}
        self._dataloader: Any = None
        self._checkpoints: deque[tuple[str, list[str]]] = deque()
        self._max_checkpoints = max_checkpoints

    @property
    def model(self) -> NamedTensors:
        """``state`` under its pre-3.4 name."""
        return self.state

    # ---- session state -----------------------------------------------------------------------

    @property
    def dataloader(self):
        """An object with ``save(filename)`` and ``resume(filename=...)`` whose position a
        checkpoint stores (None: no dataloader state is saved)."""
        return self._dataloader

    @dataloader.setter
    def dataloader(self, dl) -> None:
        if not (callable(getattr(dl, "save", None)) and callable(getattr(dl, "resume", None))):
            raise ValueError(
                f"Dataloader must implement save and resume methods; {type(dl).__name__} does not."
            )
        self._dataloader = dl

    def add_session_state_info(self, info: Mapping[str, Any]) -> None:
        """Add entries (JSON-serialisable) to ``session_state``, which checkpoints store."""
        json.dumps(dict(info))  # fail now, not at the next save_checkpoint
        self.session_state.update(info)

    def run(self, inputs: Mapping | None = None, downcast_inputs: bool = True):
        """``Session.run``, counting the runs in ``session_state["steps"]``."""
        outputs = super().run(inputs, downcast_inputs)
        self.session_state["steps"] += 1
        return outputs

    def get_named_tensors_data(self) -> NamedTensorData:
        """The state's current values by flat key (read from the device when attached)."""
        data = self.get_tensors_data(self.state.tensors)
        return NamedTensorData.from_dict({k: data[t] for k, t in self.state.to_dict().items()})

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Save ``state``, ``session_state`` and the dataloader's state to ``checkpoint_dir``
        (created if needed; see the module docstring for the layout). When this session has
        saved ``max_checkpoints`` other directories, the oldest one's files are removed."""
        _no_wandb(checkpoint_dir, "save_checkpoint")
        with timer("Get tensor data from IPU ... "):
            state = self.get_named_tensors_data().to_dict()
        checkpoint_dir = os.path.expanduser(checkpoint_dir)
        with timer(f"Saving checkpoint {checkpoint_dir} ... "):
            os.makedirs(os.path.join(checkpoint_dir, _MODEL_DIR), exist_ok=True)
            written = self._write_checkpoint(checkpoint_dir, state)
            here = os.path.realpath(checkpoint_dir)
            # Saving to the same directory again replaces it; it is not a second checkpoint.
            self._checkpoints = deque(c for c in self._checkpoints if c[0] != here)
            self._checkpoints.append((here, written))
            while len(self._checkpoints) > self._max_checkpoints:
                _remove_checkpoint(*self._checkpoints.popleft())

    def _write_checkpoint(self, checkpoint_dir: str, state: Mapping[str, np.ndarray]) -> list[str]:
        written = []
        for name, value in state.items():
            source = _npy_memmap_file(value)
            if source is not None:  # upstream copies the memmap's file rather than re-encoding
                mm = _memmap_of(value)
                assert mm is not None  # _npy_memmap_file found one
                mm.flush()
                path = os.path.join(checkpoint_dir, _MODEL_DIR, os.path.basename(source))
                if os.path.realpath(path) != os.path.realpath(source):
                    shutil.copyfile(source, path)
            else:
                path = os.path.join(checkpoint_dir, _MODEL_DIR, f"{name}.npz")
                arrays: dict[str, Any] = {name: np.asarray(value)}
                np.savez(path, **arrays)
            written.append(path)
        if self._dataloader is not None:
            logging.info("\t Saving dataloader state...")
            path = os.path.join(checkpoint_dir, _DATALOADER_FILE)
            self._dataloader.save(path)
            written.append(path)
        path = os.path.join(checkpoint_dir, _SESSION_FILE)
        with open(path, "w") as f:
            json.dump(self.session_state, f)
        written.append(path)
        return written

    def load_checkpoint(self, checkpoint_dir: str, report_missing: ReportMissingMethods = "warn",
                        skip_memmap: bool = False, *, allow_pickle: bool = False) -> None:  # fmt: skip
        """Restore ``state``, ``session_state`` and the dataloader from ``checkpoint_dir``.

        Keys present on one side only are reported (``report_missing``: 'none', 'warn' or
        'error', which raises ValueError) and skipped. ``skip_memmap=True`` leaves variables
        held in np.memmap files as they are (restore those files with
        ``initialise_memmap_dir_from_checkpoint`` before building the session). Nothing is
        written unless every array fits its variable. An ``.npz`` file (the pre-3.4 format)
        is loaded as one; ``allow_pickle``: see ``load_checkpoint_from_file``.
        """
        _check_report(report_missing)
        _no_wandb(checkpoint_dir, "load_checkpoint")
        checkpoint_dir = os.path.expanduser(checkpoint_dir)
        if os.path.isfile(checkpoint_dir):
            self.load_checkpoint_from_file(
                checkpoint_dir, report_missing, allow_pickle=allow_pickle
            )
            return
        if not os.path.isdir(checkpoint_dir):
            raise FileNotFoundError(
                f"TaskSession.load_checkpoint: {checkpoint_dir!r} is not a checkpoint directory "
                f"(one written by save_checkpoint holds {_MODEL_DIR}/ and {_SESSION_FILE})."
            )
        with timer(f"Loading checkpoint {checkpoint_dir} ... "):
            variables: dict[str, Variable] = dict(self.state.to_dict())
            skipped: set[str] = set()
            if skip_memmap:
                data = self.get_tensors_data(self.state.tensors)
                skipped = {k for k, t in variables.items() if _is_memmap(data[t])}
                variables = {k: t for k, t in variables.items() if k not in skipped}
            ckpt = _read_model_dir(checkpoint_dir, self, variables)
            ckpt = {k: v for k, v in ckpt.items() if k not in skipped}
            self._report_missing(ckpt.keys(), variables.keys(), report_missing)
            session_state = self._read_session_state(checkpoint_dir, report_missing)
            loader_file = os.path.join(checkpoint_dir, _DATALOADER_FILE)
            resume = self._dataloader is not None and os.path.exists(loader_file)
            if self._dataloader is not None and not resume:
                self._report(f"{_DATALOADER_FILE} not in checkpoint {checkpoint_dir!r}",
                             report_missing)  # fmt: skip
            # Every read succeeded; write_variables_data checks every array before it writes.
            self.write_variables_data({variables[k]: ckpt[k] for k in variables.keys() & ckpt})
            if resume:
                self._dataloader.resume(filename=loader_file)
            self.session_state = session_state

    def _read_session_state(self, checkpoint_dir: str, report_missing) -> dict:
        path = os.path.join(checkpoint_dir, _SESSION_FILE)
        if not os.path.exists(path):
            # popxl-addons opens this file unconditionally, whatever report_missing says; we
            # raise as it does, but before any variable is written.
            raise FileNotFoundError(
                f"TaskSession.load_checkpoint: {checkpoint_dir!r} has no {_SESSION_FILE} (the "
                f"session state save_checkpoint writes beside {_MODEL_DIR}/); nothing was loaded. "
                f"To restore the weights alone, write one holding the step count, e.g. "
                f'{{"steps": 0}}, into that directory.'
            )
        with open(path) as f:
            loaded = json.load(f)
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a JSON object, got {given(loaded)}.")
        self._report_missing(loaded.keys(), self.session_state.keys(), report_missing)
        return loaded

    def load_checkpoint_from_file(self, file_path: str, report_missing: ReportMissingMethods = "warn",
                                  *, allow_pickle: bool = False) -> None:  # fmt: skip
        """Restore ``state`` from one ``.npz`` file keyed by flat key (the pre-3.4 format).
        All-or-nothing, as ``load_checkpoint``.

        popxl-addons' own files hold one pickled ``ckpt`` dict. Unpickling runs whatever code
        the file names, so it happens only with ``allow_pickle=True`` (for files you trust; as
        ``torch.load(weights_only=True)`` is torch's default); otherwise such a file raises
        ``ValueError`` before anything is read from it.
        """
        _check_report(report_missing)
        ckpt = _read_npz(file_path, allow_pickle)
        variables = self.state.to_dict()
        self._report_missing(ckpt.keys(), variables.keys(), report_missing)
        self.write_variables_data({variables[k]: ckpt[k] for k in variables.keys() & ckpt.keys()})

    def load_from_session(
        self, src: TaskSession, report_missing: ReportMissingMethods = "none"
    ) -> None:
        """Copy the values of ``src.state`` into the tensors of ``self.state`` with the same keys."""
        self.load_from_tensors(src.state, src.get_tensors_data(src.state.tensors), report_missing)

    def load_from_tensors(self, src: NamedTensors, loaded: Mapping[Tensor, np.ndarray],
                          report_missing: ReportMissingMethods = "none") -> None:  # fmt: skip
        """Write ``loaded`` (data of ``src``'s tensors) into the tensors of ``state`` that share
        ``src``'s keys."""
        _check_report(report_missing)
        self._report_missing(src.to_dict().keys(), self.state.to_dict().keys(), report_missing)
        src_to_dst = src.to_mapping(self.state)
        self.write_variables_data({src_to_dst[t]: v for t, v in loaded.items() if t in src_to_dst})

    def _report_missing(self, ckpt_keys: Iterable[str], state_keys: Iterable[str],
                        method: ReportMissingMethods) -> None:  # fmt: skip
        ckpt_keys, state_keys = set(ckpt_keys), set(state_keys)
        lines = []
        if ckpt_keys - state_keys:
            lines.append(f"Checkpoint keys not in state: {sorted(ckpt_keys - state_keys)}")
        if state_keys - ckpt_keys:
            lines.append(f"state keys not in checkpoint: {sorted(state_keys - ckpt_keys)}")
        if lines:
            self._report("\n".join(lines), method)

    @staticmethod
    def _report(message: str, method: ReportMissingMethods) -> None:
        if method == "error":
            raise ValueError(message)
        if method == "warn":
            logging.warning(message)


def initialise_memmap_dir_from_checkpoint(checkpoint_dir: str, memmap_dir: str) -> None:
    """Copy the memmap files (``model/*.npy``) of a checkpoint into ``memmap_dir``, so that
    variables created with ``init(memmap_dir=memmap_dir)`` start from the checkpoint."""
    files = sorted(glob.glob(os.path.join(checkpoint_dir, _MODEL_DIR, "*.npy")))
    os.makedirs(memmap_dir, exist_ok=True)
    for f in files:
        shutil.copyfile(f, os.path.join(memmap_dir, os.path.basename(f)))


# ---- helpers -----------------------------------------------------------------------------------


def _no_wandb(path: str, what: str) -> None:
    if path.startswith("wandb://"):
        raise NotImplementedError(
            f"TaskSession.{what}: wandb:// checkpoints need Weights & Biases, which torch_popxl "
            "does not use; give a directory path instead."
        )


def _check_report(method: str) -> None:
    if method not in _REPORT:
        raise ValueError(f"report_missing must be one of {_REPORT}, got {method!r}")


def _is_memmap(value) -> bool:
    return _memmap_of(value) is not None


def _memmap_of(value) -> np.memmap | None:
    mm = value if isinstance(value, np.memmap) else getattr(value, "base", None)
    return mm if isinstance(mm, np.memmap) else None


def _npy_memmap_file(value) -> str | None:
    """The ``.npy`` file whose memmap holds exactly ``value`` (not a view of part of it); a
    raw memmap (no ``.npy`` header, which ``np.load`` could not read back) gives None."""
    mm = _memmap_of(value)
    if mm is None or not isinstance(mm.filename, str) or not mm.filename.endswith(".npy"):
        return None
    if mm.shape != value.shape or mm.dtype != value.dtype or mm.offset == 0:
        return None
    with open(mm.filename, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            return None
    return mm.filename


def _read_model_dir(checkpoint_dir: str, session: TaskSession,
                    variables: Mapping[str, Variable]) -> dict[str, np.ndarray]:  # fmt: skip
    """``{flat key: array}`` from ``model/*.npz`` plus, for variables held in ``.npy`` memmap
    files, the checkpoint's copy of that file."""
    model_dir = os.path.join(checkpoint_dir, _MODEL_DIR)
    ckpt: dict[str, np.ndarray] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.npz"))):
        with np.load(path, allow_pickle=False) as f:
            ckpt.update({k: f[k] for k in f.files})
    data = session.get_tensors_data(variables.values()) if variables else {}
    for key, t in variables.items():
        source = _npy_memmap_file(data[t])
        if key in ckpt or source is None:
            continue
        path = os.path.join(model_dir, os.path.basename(source))
        if os.path.exists(path):
            ckpt[key] = np.load(path, allow_pickle=False)
    return ckpt


def _remove_checkpoint(folder: str, files: list[str]) -> None:
    """Remove the files a save wrote (not the folder's other contents), then the folders if
    they are left empty."""
    logging.info(f"\t Deleting old checkpoint {folder} ... ")
    for path in files:
        try:
            os.remove(path)
        except OSError as e:
            logging.warning(f"\t Failed to remove {path}: {e}")
    for sub in (os.path.join(folder, _MODEL_DIR), folder):
        try:
            os.rmdir(sub)
        except OSError:
            pass  # not empty: it holds files this session did not write


def _read_npz(file_path: str, allow_pickle: bool) -> dict[str, np.ndarray]:
    """``{key: array}`` of an ``.npz`` file; popxl-addons' pickled ``{"ckpt": dict}`` only with
    ``allow_pickle`` (Note [safe loading])."""
    with np.load(file_path, allow_pickle=False) as f:
        pickled = [k for k in f.files if _holds_pickle(f, k)]
        if not pickled:
            return {k: f[k] for k in f.files}
    if not allow_pickle:
        raise ValueError(
            f"TaskSession: {file_path!r} holds pickled Python objects under {pickled} "
            "(popxl-addons' pickled checkpoint format). Unpickling runs whatever code the file "
            "names, so it is not loaded by default. If you trust the file, pass "
            "allow_pickle=True to load_checkpoint / load_checkpoint_from_file; then save it "
            "again with save_checkpoint, whose files hold plain arrays."
        )
    with np.load(file_path, allow_pickle=True) as legacy:
        if legacy.files != ["ckpt"]:
            raise ValueError(
                f"TaskSession: {file_path!r} holds pickled objects under {legacy.files}; "
                "expected popxl-addons' format, one dict of arrays under 'ckpt'."
            )
        ckpt = legacy["ckpt"].item()
    if not isinstance(ckpt, dict):
        raise ValueError(
            f"TaskSession: {file_path!r}: 'ckpt' holds a {type(ckpt).__name__}; expected a dict "
            "{flat key: array} (popxl-addons' format)."
        )
    return {k: np.asarray(v) for k, v in ckpt.items()}


# Note [safe loading]
# ~~~~~~~~~~~~~~~~~~~
# ``np.load(..., allow_pickle=True)`` unpickles object arrays, and unpickling calls whatever
# callables the file names: a crafted checkpoint runs code. Every read here uses
# allow_pickle=False; an object array shows as numpy's ValueError when its member is read,
# which only tells us that it is pickled (nothing is unpickled by that read). Only an explicit
# ``allow_pickle=True`` from the caller reopens the file with unpickling.


def _holds_pickle(f, key: str) -> bool:
    try:
        f[key]
    except ValueError:  # numpy: "Object arrays cannot be loaded when allow_pickle=False"
        return True
    return False
