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


def _transfer(kind: OpKind, effects: Effect, rules: dict) -> OpDef:
    return register(OpDef(kind.value, effects, rules), kind)


remote_load_p = _transfer(
    OpKind.REMOTE_LOAD,
    Effect.REMOTE,
    {"traffic": _remote("remote_load"), "reference": reference.remote_load},
)
remote_load_inplace_p = _transfer(
    OpKind.REMOTE_LOAD_INPLACE,
    Effect.REMOTE | Effect.INPLACE,
    {"traffic": _remote("remote_load"), "reference": reference.remote_load},
)
remote_store_p = _transfer(
    OpKind.REMOTE_STORE,
    Effect.REMOTE,
    {"traffic": _remote("remote_store"), "reference": reference.remote_store},
)
host_load_p = _transfer(OpKind.HOST_LOAD, Effect.HOST_IO, {"traffic": _host_load_traffic})
host_store_p = _transfer(OpKind.HOST_STORE, Effect.HOST_IO, {"traffic": _host_store_traffic})
