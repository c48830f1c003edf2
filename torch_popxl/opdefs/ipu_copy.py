"""``ops.ipu_copy`` (``Tensor.copy_to_ipu``): copy a tensor from one IPU to another.

PopXL places ops on IPUs with ``popxl.ipu(n)`` (a virtual graph id on every tensor); a value
made on one IPU is read on another only through an ``IpuCopy``, which moves its bytes over the
IPU-Links between the two chips. The simulator holds every IPU in one process, so the copy is
a clone of the value, recorded as its own op: the report counts its bytes as IPU-link traffic
(``Traffic("ipu_copy", ...)``) and the cost model prices them over the IPU-Links. Each replica
copies its own value, so the bytes are summed over replicas like the other transfers.

Upstream checks kept: the source IPU is the tensor's own unless given, and a tensor created
outside any ``popxl.ipu`` context needs an explicit ``source``. The simulator also refuses a
copy to the IPU the tensor is already on and a ``source`` that contradicts the tensor's IPU,
which upstream leaves to the backend to reject.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..capture import call_torch
from ..dtypes import nbytes
from ..errors import UndefinedValue
from ..ir.context import gcg
from ..ir.graph import Op
from ..ir.tensor import Tensor as Handle
from ._common import ops
from .registry import Effect, OpDef, Traffic, register

__all__ = ["ipu_copy", "ipu_copy_bytes", "opdef"]

NAME = "ipu_copy"


# ---- the op -----------------------------------------------------------------------------------


@torch.library.custom_op("torch_popxl::ipu_copy", mutates_args=())
def per_replica(x: Tensor, source: int, destination: int) -> Tensor:
    """One replica's copy of ``x`` from IPU ``source`` to IPU ``destination``."""
    return x.clone()


@per_replica.register_fake
def _(x, source, destination):
    return x.new_empty(x.shape)


@per_replica.register_vmap
def _(info, in_dims, x, source, destination):
    # A copy is elementwise: every replica (row of the stacked value) copies its own.
    return x.clone(), in_dims[0]


def _setup(ctx, inputs, output):
    ctx.source, ctx.destination = inputs[1:]


def _backward(ctx, grad):
    # PopXL's gradient of an IpuCopy is the copy back: the gradient lives where the input did.
    return ops.ipu_copy(grad, ctx.destination, ctx.source), None, None


per_replica.register_autograd(_backward, setup_context=_setup)


def reference(xs: list[Tensor], source: int, destination: int) -> list[Tensor]:
    """Per-replica semantics: each replica's value, copied."""
    return [x.clone() for x in xs]


# ---- traffic and the compiler facts -----------------------------------------------------------


def ipu_copy_bytes(shape, dtype, num_replicas: int) -> int:
    """Bytes one execution moves over the IPU-Links, summed over ``num_replicas``."""
    return num_replicas * nbytes(shape, dtype)


def _traffic(op: Op, num_replicas: int) -> Traffic:
    x = op.inputs[0]
    return Traffic("ipu_copy", ipu_copy_bytes(x.shape, x.dtype, num_replicas))


def _explicit(op: Op, batched, num_replicas: int):
    # Stacked or not, a copy is a clone of what it is given.
    return lambda x, source, destination: x.clone()


# ---- the public wrapper -----------------------------------------------------------------------


def _check_ipu(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"ipu_copy: {what} must be a non-negative int (an IPU index); got {value!r}."
        )
    return value


def ipu_copy(t: Handle, destination: int, source: int | None = None) -> Handle:
    """Copy ``t`` to IPU ``destination``; returns the copy, placed on ``destination``.

    ``source`` defaults to ``t.ipu``: the IPU ``t`` was created on (``popxl.ipu(n)``), or 0 for
    an op's output made outside any ``popxl.ipu``; give it for a variable, constant or graph
    input made outside one. The copy is named ``<t.name>_c<destination>``.
    """
    if not isinstance(t, Handle):
        raise TypeError(f"ipu_copy expects a popxl Tensor; got {type(t).__name__}.")
    graph = gcg()
    if t._graph is not graph:
        raise ValueError(f"ipu_copy: tensor {t.id!r} is not in the current graph {graph.id!r}.")
    destination = _check_ipu(destination, "destination")
    if source is None:
        try:
            source = t.ipu
        except UndefinedValue:
            raise ValueError(
                f"ipu_copy: could not infer the IPU of tensor {t.id!r}: it is not an op's "
                "output and was created outside any popxl.ipu(n) context. Pass "
                "source=<its IPU> or create it inside `with popxl.ipu(n):`."
            ) from None
    source = _check_ipu(source, "source")
    if t._ipu is not None and t._ipu != source:
        raise ValueError(
            f"ipu_copy: source={source} but tensor {t.id!r} is on IPU {t._ipu}. Leave source "
            "out (it defaults to the tensor's IPU) or pass the IPU the tensor is on."
        )
    if destination == source:
        raise ValueError(
            f"ipu_copy: tensor {t.id!r} is already on IPU {source}; a copy needs a destination "
            "other than its source IPU. Use the tensor directly on that IPU."
        )
    out = call_torch(ops.ipu_copy, (t, source, destination), {})
    graph._rename_tensor(out, f"{t.name}_c{destination}")
    out._ipu = destination
    out._meta_shape = t.meta_shape
    return out


opdef = register(
    OpDef(
        NAME,
        Effect.NONE,
        {
            "traffic": _traffic,
            "reference": reference,
            "explicit": _explicit,
            "wrapper": ipu_copy,
            # pipelining (addons/transforms/pipelining.py) asks for it: the op moves a value
            # between the IPUs of one replica, so it belongs to the region's copy unit
            "ipu_transfer": lambda op: True,
        },
        popart_type="IpuCopy",
    ),
    ops.ipu_copy.default,
)
