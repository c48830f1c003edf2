"""Where this process sits among PopXL instances (popxl.md §10), from ``torch.distributed``.

Under ``torchrun`` (or any initialised process group) each process is one PopXL instance that
holds ``R / W`` of the R global replicas. This module reads that layout and starts the process
group when needed; it knows nothing of programs, so the IR (``Ir(replication="popdist")``) and
the runtime's collective backend (``runtime/distributed.py``) can both use it.
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "ENV_BACKEND",
    "ENV_REPLICATION_FACTOR",
    "ENV_TIMEOUT",
    "DistributedError",
    "InstanceLayout",
    "init_process_group",
    "instance_batch",
    "instance_layout",
    "launched",
    "layout_for",
    "local_replicas",
    "num_instances",
    "timeout_s",
]

ENV_REPLICATION_FACTOR = "TORCH_POPXL_REPLICATION_FACTOR"
ENV_TIMEOUT = "TORCH_POPXL_DIST_TIMEOUT_S"
ENV_BACKEND = "TORCH_POPXL_DIST_BACKEND"
DEFAULT_TIMEOUT_S = 60.0


class DistributedError(RuntimeError):
    """Instances could not communicate: a peer exited, crashed, or ran a different program."""


# ---- the process group and the instance layout --------------------------------------------


@dataclass(frozen=True)
class InstanceLayout:
    """This process's place among the instances (popxl.md §10)."""

    num_instances: int
    instance_index: int
    instance_replication_factor: int

    @property
    def replication_factor(self) -> int:
        return self.num_instances * self.instance_replication_factor

    @property
    def replica_offset(self) -> int:
        return self.instance_index * self.instance_replication_factor


def timeout_s() -> float:
    """``$TORCH_POPXL_DIST_TIMEOUT_S`` (seconds), 60 when unset."""
    raw = os.environ.get(ENV_TIMEOUT)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{ENV_TIMEOUT} must be a positive number of seconds; got {raw!r}.")
    return value


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s())


def _torchrun_env() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def launched() -> bool:
    """Whether this process is one of several instances: a process group is initialised, or
    the ``torchrun`` environment is there to start one."""
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    return _torchrun_env() and int(os.environ["WORLD_SIZE"]) > 1


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def init_process_group() -> None:
    """Start the default process group from the ``torchrun`` environment, unless one exists.

    The backend is ``$TORCH_POPXL_DIST_BACKEND`` or ``gloo`` (``cpu:gloo,cuda:nccl`` with
    CUDA); the start waits at most ``$TORCH_POPXL_DIST_TIMEOUT_S`` for the other processes.
    """
    if dist.is_initialized():
        return
    if not (dist.is_available() and _torchrun_env()):
        raise ImportError(
            "Ir(replication='popdist') needs torch.distributed: launch the script with torchrun "
            "(`torchrun --nproc_per_node=N script.py`), or call "
            "torch.distributed.init_process_group() before building the Ir."
        )
    cuda = torch.cuda.is_available()
    backend = os.environ.get(ENV_BACKEND) or ("cpu:gloo,cuda:nccl" if cuda else "gloo")
    if cuda and "nccl" in backend and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    try:
        dist.init_process_group(backend, timeout=_timeout())
        # We started it, so we end it: tearing gloo's threads down explicitly at exit avoids
        # an abort ("terminate called without an active exception") in interpreter shutdown.
        atexit.register(_destroy_at_exit)
    except RuntimeError as error:
        raise DistributedError(
            f"torch_popxl: starting the {backend} process group failed (rank "
            f"{os.environ['RANK']} of {os.environ['WORLD_SIZE']}, master "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, timeout "
            f"{timeout_s():g} s from {ENV_TIMEOUT}): {error}"
        ) from error


def instance_layout(replication_factor: int | None = None) -> InstanceLayout:
    """The layout of ``Ir(replication="popdist")``; starts the process group if needed.

    ``replication_factor`` is the global R; ``None`` reads ``$TORCH_POPXL_REPLICATION_FACTOR``
    and falls back to the world size.
    """
    init_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    source = "replication_factor"
    if replication_factor is None:
        raw = os.environ.get(ENV_REPLICATION_FACTOR)
        source = ENV_REPLICATION_FACTOR
        try:
            replication_factor = int(raw) if raw else world
        except ValueError:
            replication_factor = -1
    if isinstance(replication_factor, bool) or replication_factor < 1 or replication_factor % world:
        raise ValueError(
            f"Ir(replication='popdist'): the global replication factor {replication_factor!r} "
            f"(from {source}) must be a positive multiple of the number of processes, "
            f"{world}, so every instance holds the same number of replicas. Set "
            f"{ENV_REPLICATION_FACTOR} to a multiple of {world} (e.g. {2 * world})."
        )
    return InstanceLayout(world, rank, replication_factor // world)


def _env_replication_factor() -> int | None:
    raw = os.environ.get(ENV_REPLICATION_FACTOR)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{ENV_REPLICATION_FACTOR} must be a positive int (the global replication factor); "
            f"got {raw!r}."
        )
    return value


def layout_for(replication: int | str) -> InstanceLayout:
    """The instance layout of ``Ir(replication=...)`` in this process.

    Both spellings work with and without ``torchrun`` (Note [one program, any launch] in
    runtime/distributed.py):

    * ``"popdist"`` under torchrun: :func:`instance_layout` (R from
      ``$TORCH_POPXL_REPLICATION_FACTOR`` or the world size). Without it, one instance holding
      every replica, R from ``$TORCH_POPXL_REPLICATION_FACTOR`` or 1: popdist outside poprun
      reports one instance (index 0) and the replica count it was given.
    * an int R under torchrun with W processes: W instances of R / W replicas each, as
      ``"popdist"`` with R would give. R = 1 stays one independent instance per process
      (nothing to split); any other R that W does not divide is an error.
    """
    if replication == "popdist":
        if launched():
            return instance_layout()
        return InstanceLayout(1, 0, _env_replication_factor() or 1)
    R = int(replication)
    if R == 1 or not launched():
        return InstanceLayout(1, 0, R)
    init_process_group()
    world = dist.get_world_size()
    if R % world:
        raise ValueError(
            f"Ir(replication={R}) under torchrun with {world} processes: every process is one "
            f"PopXL instance and must hold the same number of replicas, but {R} replicas do not "
            f"split over {world} processes. Use a replication factor that is a multiple of "
            f"{world} (e.g. {world * max(1, R // world)}), or launch {R} processes or a divisor "
            "of it."
        )
    return InstanceLayout(world, dist.get_rank(), R // world)


def num_instances() -> int:
    """The number of instances this process is one of (1 without torchrun)."""
    if not launched():
        return 1
    init_process_group()
    return dist.get_world_size()


def local_replicas(replication_factor: int) -> int:
    """This instance's share of ``replication_factor`` global replicas.

    The layout of ``Ir(replication=replication_factor)`` (:func:`layout_for`): under torchrun
    with W processes R / W, except R = 1, which every process runs alone.
    """
    return layout_for(replication_factor).instance_replication_factor


def instance_batch(batch, replication_factor: int, gradient_accumulation: int = 1):
    """This instance's share of a global batch, laid out as ``popxl.compile`` splits it.

    The single-process Trainer gives replica r of micro-batch step a the rows
    ``[(a * R + r) * micro, (a * R + r + 1) * micro)``; passing every instance the rows of its
    own replicas makes a torchrun job compute exactly what one process does with the global
    batch. Without torchrun the batch is returned unchanged.
    """
    layout = layout_for(replication_factor)
    if layout.num_instances == 1:
        return batch
    R, GA = replication_factor, gradient_accumulation
    if len(batch) % (R * GA):
        raise ValueError(
            f"instance_batch: a global batch of {len(batch)} samples does not split into "
            f"replication_factor * gradient_accumulation = {R} * {GA} equal micro-batches."
        )
    local, offset = layout.instance_replication_factor, layout.replica_offset
    micro = len(batch) // (R * GA)
    rows = batch.reshape(GA, R, micro, *batch.shape[1:])[:, offset : offset + local]
    return rows.reshape(GA * local * micro, *batch.shape[1:])
