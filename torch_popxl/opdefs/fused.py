"""Ops the fast compiler makes by fusing captured ones (they never appear in a program's IR):

* ``mm_all_reduce(a, b, op)``: ``replicated_all_reduce(a @ b, op)`` over all replicas, with the
  replicas folded into one matmul (Note [fold replicas into the matmul] in runtime/lower.py);
  its C++ kernel is ``mm_all_reduce_stacked``;
* ``replica_sum(x)`` and ``mm_replica_sum(a, b)``: the sum over replicas of a value or of a
  matmul, as one value (Note [replica-sum accumulators] in runtime/lower.py). Not collectives:
  they move nothing and count nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import ops, stacked
from .all_reduce import all_reduce_bytes
from .backends import InstanceTransport, collectives
from .reduce_ops import finish

__all__ = ["mm_all_reduce", "mm_replica_sum", "replica_sum"]


# ---- mm_all_reduce ---------------------------------------------------------------------------


@torch.library.custom_op("torch_popxl::mm_all_reduce", mutates_args=())
def mm_all_reduce(a: Tensor, b: Tensor, op: str) -> Tensor:
    """``replicated_all_reduce(a @ b, op)`` over all replicas; on one replica just ``a @ b``."""
    if op not in ("add", "mean"):
        raise ValueError(f"mm_all_reduce: op must be 'add' or 'mean'; got {op!r}.")
    return a @ b


@mm_all_reduce.register_fake
def _(a, b, op):
    return a.new_empty((a.shape[0], b.shape[1]))


@mm_all_reduce.register_vmap
def _(info, in_dims, a, b, op):
    backend = collectives()
    R = backend.num_replicas(info.batch_size)
    a = stacked(a, in_dims[0], info.batch_size)  # [R, M, K]
    b = stacked(b, in_dims[1], info.batch_size)  # [R, K, N]
    if backend.spans_instances(R, 1):
        return _distributed(backend, a, b, op), None
    return ops.mm_all_reduce_stacked(a, b, op), None


@torch.library.register_fake("torch_popxl::mm_all_reduce_stacked")
def _(a, b, op):
    return a.new_empty((a.shape[1], b.shape[2]))


def _distributed(backend: InstanceTransport, a: Tensor, b: Tensor, op: str) -> Tensor:
    """The local replicas' partial sum (one fused matmul, which counts its local share), then
    one all-reduce of the partials across instances."""
    part = ops.mm_all_reduce_stacked(a, b, "add").contiguous()
    row = part.numel() * part.element_size()
    backend.count(
        all_reduce_bytes(backend.R, backend.R, row),
        counted=all_reduce_bytes(backend.local, backend.local, row),
    )
    total = backend.all_reduce_partial(part, "sum")
    return finish(total, op, backend.R, total.dtype)


# ---- replica sums ----------------------------------------------------------------------------


@torch.library.custom_op("torch_popxl::replica_sum", mutates_args=())
def replica_sum(x: Tensor) -> Tensor:
    """The sum of ``x`` over all replicas, as one value (not a collective: no traffic)."""
    return x.clone()


@replica_sum.register_fake
def _(x):
    return torch.empty_like(x)


@replica_sum.register_vmap
def _(info, in_dims, x):
    if in_dims[0] is None:
        return x * info.batch_size, None
    return x.sum(in_dims[0]), None


@torch.library.custom_op("torch_popxl::mm_replica_sum", mutates_args=())
def mm_replica_sum(a: Tensor, b: Tensor) -> Tensor:
    """``sum_r a_r @ b_r`` as one value; on one replica ``a @ b``."""
    return a @ b


@mm_replica_sum.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


@mm_replica_sum.register_vmap
def _(info, in_dims, a, b):
    R = info.batch_size
    a, b = stacked(a, in_dims[0], R), stacked(b, in_dims[1], R)  # [R, M, K], [R, K, N]
    M, K, N = a.shape[1], a.shape[2], b.shape[2]
    # Fold the replicas into the contraction: one [M, R*K] @ [R*K, N] matmul.
    return a.permute(1, 0, 2).reshape(M, R * K) @ b.reshape(R * K, N), None
