"""Collective op definitions: byte formulas, traffic and reference rules.

Note [traffic formulas]
~~~~~~~~~~~~~~~~~~~~~~~
Collectives are costed with the bandwidth-optimal ring algorithm. Bytes are summed over the R
replicas that run the op; with n = bytes of one replica's input and G = group size:

* all_reduce      R * 2 * (G - 1) * n / G
* all_gather      R * (G - 1) * n
* reduce_scatter  R * (G - 1) * ceil(elements / G) * itemsize (the zero-padded chunk)
* local slices    0 (``take_own``, the ``'local'`` reduce-scatter: PopXL's grad of all_gather)

A group of size 1 moves nothing but still counts as one call. These functions are the only
statement of the formulas in Python: the report, the cost model and the torch.distributed
backend call them; the C++ counters (csrc/collective_common.h) implement the same formulas and
the tests compare the two.
"""

from __future__ import annotations

import math

from ..dtypes import itemsize, nbytes
from ..ir.graph import Op
from ..ir.tensor import Tensor
from . import kernels, reference  # kernels registers the per-replica custom ops
from .registry import Effect, OpDef, Traffic, register

__all__ = [
    "all_gather_bytes",
    "all_gather_p",
    "all_reduce_bytes",
    "all_reduce_p",
    "reduce_scatter_bytes",
    "reduce_scatter_p",
    "take_own_p",
]


def all_reduce_bytes(num_replicas: int, group_size: int, row_bytes: int) -> int:
    # R * ... // G rather than R // G * ...: under torch.distributed R may be one instance's
    # share of the replicas, which a group can exceed.
    return num_replicas * 2 * (group_size - 1) * row_bytes // group_size


def all_gather_bytes(num_replicas: int, group_size: int, row_bytes: int) -> int:
    return num_replicas * (group_size - 1) * row_bytes


def reduce_scatter_bytes(
    num_replicas: int, group_size: int, num_elements: int, itemsize: int, op: str
) -> int:
    if op == "local":
        return 0
    chunk = -(-num_elements // group_size)
    return num_replicas * (group_size - 1) * chunk * itemsize


# ---- rules over IR ops ----------------------------------------------------------------------


def _row_bytes(t: Tensor) -> int:
    return nbytes(t.shape, t.dtype)


def _all_reduce_traffic(op: Op, num_replicas: int) -> Traffic:
    group_size = op.attrs.argument("group_size")
    nbytes = all_reduce_bytes(num_replicas, group_size, _row_bytes(op.tensor_arg(0)))
    return Traffic("all_reduce", nbytes, group_size)


def _all_gather_traffic(op: Op, num_replicas: int) -> Traffic:
    group_size = op.attrs.argument("group_size")
    nbytes = all_gather_bytes(num_replicas, group_size, _row_bytes(op.tensor_arg(0)))
    return Traffic("all_gather", nbytes, group_size)


def _reduce_scatter_traffic(op: Op, num_replicas: int) -> Traffic:
    x, reduce_op, group_size = (
        op.tensor_arg(0),
        op.attrs.argument("op"),
        op.attrs.argument("group_size"),
    )
    if reduce_op == "local":
        return Traffic("local_slice", 0, group_size)
    nbytes = reduce_scatter_bytes(
        num_replicas, group_size, math.prod(x.shape), itemsize(x.dtype), reduce_op
    )
    return Traffic("reduce_scatter", nbytes, group_size)


def _take_own_traffic(op: Op, num_replicas: int) -> Traffic:
    return Traffic("local_slice", 0, op.attrs.argument("group_size"))


# ---- the stanzas ----------------------------------------------------------------------------


def _collective(name: str, traffic, semantics) -> OpDef:
    """The definition of the per-replica custom op ``torch_popxl::<name>``."""
    opdef = OpDef(name, Effect.COLLECTIVE, {"traffic": traffic, "reference": semantics})
    return register(opdef, getattr(kernels._ops, name).default)


all_reduce_p = _collective("replicated_all_reduce", _all_reduce_traffic, reference.all_reduce)
all_gather_p = _collective("replicated_all_gather", _all_gather_traffic, reference.all_gather)
reduce_scatter_p = _collective(
    "replicated_reduce_scatter", _reduce_scatter_traffic, reference.reduce_scatter
)
take_own_p = _collective("replicated_take_own", _take_own_traffic, reference.take_own)
