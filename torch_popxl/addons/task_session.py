"""``TaskSession``: a ``Session`` that knows its named input / output streams and its model
state (weights and optimizer state as ``NamedTensors``), and saves and restores that state.

A checkpoint is one ``.npz`` file with one array per flat key of ``model`` (``"fc1.weight"``,
``"optim.fc1.weight.first_order"``, ...), written exactly as the session holds it (dtype and
replica layout included) so a restored run continues bit for bit. Files written by popxl-addons
(a single pickled ``ckpt`` dict) are read as well.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np

from ..ir.tensor import Tensor, Variable
from ..runtime.session import Session
from .named_tensors import NamedTensors
from .streams import InputStreams, OutputStreams
from .utils import timer

__all__ = ["TaskSession", "write_variables_pb"]

ReportMissingMethods = Literal["none", "warn", "error"]
_REPORT = ("none", "warn", "error")


def write_variables_pb(session: Session, weights: Mapping[Variable, np.ndarray]) -> None:
    """Write ``{variable: data}`` into ``session`` (upstream's workaround name for
    ``Session.write_variables_data``; the same here)."""
    session.write_variables_data(weights)


class TaskSession(Session):
    """``Session(ir, device_desc, ...)`` plus ``inputs`` (``InputStreams``), ``outputs``
    (``OutputStreams``) and ``model`` (the ``NamedTensors`` a checkpoint holds)."""

    def __init__(self, inputs: InputStreams | Iterable, outputs: OutputStreams | Iterable,
                 model: NamedTensors, *args, **kwargs):  # fmt: skip
        if not isinstance(model, NamedTensors):
            raise TypeError(f"TaskSession: model must be NamedTensors, got {type(model).__name__}")
        with timer("PopXL compilation"):
            super().__init__(*args, **kwargs)
        self.inputs = (
            inputs if isinstance(inputs, InputStreams) else InputStreams.from_streams(inputs)
        )
        self.outputs = (
            outputs if isinstance(outputs, OutputStreams) else OutputStreams.from_streams(outputs)
        )
        self.model = model

    # ---- checkpoints -------------------------------------------------------------------------

    def _checkpoint_arrays(self) -> dict[str, np.ndarray]:
        data = self.get_tensors_data(self.model.tensors)
        return {name: data[t] for name, t in self.model.to_dict().items()}

    def save_checkpoint(self, file_path: str) -> None:
        """Save ``model``'s current values to ``file_path`` (``.npz``; parent folders created)."""
        if file_path.startswith("wandb://"):
            raise NotImplementedError(
                "TaskSession.save_checkpoint: wandb:// checkpoints need Weights & Biases; save to a "
                "file path instead"
            )
        self.save_checkpoint_to_file(file_path, self._checkpoint_arrays())

    def save_checkpoint_to_file(self, file_path: str, ckpt: Mapping[str, np.ndarray]) -> None:
        """Write ``{flat key: array}`` as one ``.npz`` entry per key."""
        folder = os.path.dirname(file_path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        arrays: dict[str, Any] = dict(ckpt)
        np.savez(file_path, **arrays)

    def load_checkpoint(
        self, file_path: str, report_missing: ReportMissingMethods = "warn"
    ) -> None:
        """Restore ``model``'s values from ``file_path``; keys present on one side only are
        reported (``report_missing``: 'none', 'warn' or 'error') and skipped."""
        if file_path.startswith("wandb://"):
            raise NotImplementedError(
                "TaskSession.load_checkpoint: wandb:// checkpoints need Weights & Biases; load a file"
            )
        self.load_checkpoint_from_file(file_path, report_missing)

    def load_checkpoint_from_file(
        self, file_path: str, report_missing: ReportMissingMethods = "warn"
    ) -> None:
        """As ``load_checkpoint``. Nothing is written unless every matching array fits its
        variable (shape and dtype are checked first)."""
        _check_report(report_missing)
        ckpt = _read_npz(file_path)
        variables = self.model.to_dict()
        self._report_missing(ckpt.keys(), variables.keys(), report_missing)
        self.write_variables_data({variables[k]: ckpt[k] for k in variables.keys() & ckpt.keys()})

    def load_from_session(
        self, src: TaskSession, report_missing: ReportMissingMethods = "none"
    ) -> None:
        """Copy the values of ``src.model`` into the tensors of ``self.model`` with the same keys."""
        self.load_from_tensors(src.model, src.get_tensors_data(src.model.tensors), report_missing)

    def load_from_tensors(self, src: NamedTensors, loaded: Mapping[Tensor, np.ndarray],
                          report_missing: ReportMissingMethods = "none") -> None:  # fmt: skip
        """Write ``loaded`` (data of ``src``'s tensors) into the tensors of ``model`` that share
        ``src``'s keys."""
        _check_report(report_missing)
        self._report_missing(src.to_dict().keys(), self.model.to_dict().keys(), report_missing)
        src_to_dst = src.to_mapping(self.model)
        self.write_variables_data({src_to_dst[t]: v for t, v in loaded.items() if t in src_to_dst})

    def load_from_session_pb(self, src: TaskSession, loaded: Mapping[Tensor, np.ndarray],
                             report_missing: ReportMissingMethods = "none") -> None:  # fmt: skip
        """Upstream's workaround name for ``load_from_tensors(src.model, loaded, ...)``."""
        self.load_from_tensors(src.model, loaded, report_missing)

    def _report_missing(self, ckpt_keys: Iterable[str], model_keys: Iterable[str],
                        method: ReportMissingMethods) -> None:  # fmt: skip
        if method == "none":
            return
        ckpt_keys, model_keys = set(ckpt_keys), set(model_keys)
        lines = []
        if ckpt_keys - model_keys:
            lines.append(f"Checkpoint Tensors not in model: {sorted(ckpt_keys - model_keys)}")
        if model_keys - ckpt_keys:
            lines.append(f"Model Tensors not in checkpoint: {sorted(model_keys - ckpt_keys)}")
        if lines:
            if method == "error":
                raise ValueError("\n".join(lines))
            logging.warning("\n".join(lines))


def _check_report(method: str) -> None:
    if method not in _REPORT:
        raise ValueError(f"report_missing must be one of {_REPORT}, got {method!r}")


def _read_npz(file_path: str) -> dict[str, np.ndarray]:
    with np.load(file_path, allow_pickle=False) as f:
        if f.files == ["ckpt"]:
            try:
                f["ckpt"]
            except ValueError:
                # popxl-addons' format: one pickled dict under "ckpt" (only files you trust).
                with np.load(file_path, allow_pickle=True) as legacy:
                    return {k: np.asarray(v) for k, v in legacy["ckpt"].item().items()}
        return {k: f[k] for k in f.files}
