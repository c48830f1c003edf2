"""Remote-memory and host-stream op definitions: their traffic (slot or entry bytes times the
replicas that run them)."""

from __future__ import annotations

from ..dtypes import nbytes
from ..ir.graph import Op, OpKind
from ..ir.remote_buffer import RemoteBuffer
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


def slot_bytes(rb: RemoteBuffer) -> int:
    """Bytes of one entry of ``rb`` on one replica."""
    return nbytes(rb.tensor_shape, rb.tensor_dtype)


def _remote(kind: str):
    def traffic(op: Op, num_replicas: int) -> Traffic:
        return Traffic(kind, num_replicas * slot_bytes(op.attrs.buffer))

    return traffic


def _host_load_traffic(op: Op, num_replicas: int) -> Traffic:
    return Traffic(
        "host_to_device", num_replicas * nbytes(op.outputs[0].shape, op.outputs[0].dtype)
    )


def _host_store_traffic(op: Op, num_replicas: int) -> Traffic:
    return Traffic("device_to_host", num_replicas * nbytes(op.inputs[0].shape, op.inputs[0].dtype))


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
