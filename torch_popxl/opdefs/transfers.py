"""Remote-memory and host-stream op definitions: their traffic (slot or entry bytes times the
replicas that run them)."""

from __future__ import annotations

import math

from ..ir.graph import Op, OpKind
from ..ir.remote_buffer import RemoteBuffer
from ..ir.tensor import Tensor
from . import reference
from .registry import Effect, OpDef, Traffic, register

__all__ = [
    "host_load_p",
    "host_store_p",
    "remote_load_inplace_p",
    "remote_load_p",
    "remote_store_p",
    "slot_bytes",
]


def _itemsize(dtype) -> int:
    tdt = dtype.as_torch()
    return tdt.itemsize if tdt is not None else 1


def slot_bytes(rb: RemoteBuffer) -> int:
    """Bytes of one entry of ``rb`` on one replica."""
    return math.prod(rb.tensor_shape) * _itemsize(rb.tensor_dtype)


def _entry_bytes(t: Tensor) -> int:
    return math.prod(t.shape) * _itemsize(t.dtype)


def _remote(kind: str):
    def traffic(op: Op, num_replicas: int) -> Traffic:
        return Traffic(kind, num_replicas * slot_bytes(op.attrs.buffer))

    return traffic


def _host_load_traffic(op: Op, num_replicas: int) -> Traffic:
    return Traffic("host_to_device", num_replicas * _entry_bytes(op.outputs[0]))


def _host_store_traffic(op: Op, num_replicas: int) -> Traffic:
    return Traffic("device_to_host", num_replicas * _entry_bytes(op.inputs[0]))


remote_load_p = register(
    OpDef(
        "remote_load",
        Effect.REMOTE,
        {"traffic": _remote("remote_load"), "reference": reference.remote_load},
    ),
    OpKind.REMOTE_LOAD,
)
remote_load_inplace_p = register(
    OpDef(
        "remote_load_",
        Effect.REMOTE | Effect.INPLACE,
        {"traffic": _remote("remote_load"), "reference": reference.remote_load},
    ),
    OpKind.REMOTE_LOAD_INPLACE,
)
remote_store_p = register(
    OpDef(
        "remote_store",
        Effect.REMOTE,
        {"traffic": _remote("remote_store"), "reference": reference.remote_store},
    ),
    OpKind.REMOTE_STORE,
)
host_load_p = register(
    OpDef("host_load", Effect.HOST_IO, {"traffic": _host_load_traffic}), OpKind.HOST_LOAD
)
host_store_p = register(
    OpDef("host_store", Effect.HOST_IO, {"traffic": _host_store_traffic}), OpKind.HOST_STORE
)
