"""``cross_entropy_sharded_loss``: softmax cross entropy of logits sharded over the class axis
between the members of a tensor-parallel replica group.

Each member holds ``logits[:, shard]`` and the labels shifted by its shard's first class (labels
outside the shard pick nothing locally). The loss is the same on every member:
``log(sum_all exp(l - m)) + m - l[label]`` with ``m`` the global row maximum. The sums over the
group are all-reduces whose gradient passes through (the loss and its gradient seed are
identical on every member), so each member's logit gradient is its own slice of
``softmax - onehot``; the maximum is a constant shift and carries no gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from .... import dtypes as _dtypes
from ....ir.replica_grouping import ReplicaGrouping
from ....ir.tensor import Tensor
from ....opdefs.all_reduce import replicated_all_reduce
from ....opdefs.all_reduce_tp import replicated_all_reduce_TP

__all__ = ["cross_entropy_sharded_loss"]

_REDUCTIONS = ("mean", "sum", "none")
_Traced = Any  # torch code on popxl handles returns popxl Tensors


def _traced(t: Tensor) -> _Traced:
    return t


def cross_entropy_sharded_loss(logits: Tensor, indices: Tensor, ignore_index: Tensor | int | None = None,
                               replica_grouping: ReplicaGrouping | None = None,
                               reduction: str = "mean",
                               available_memory_proportion: float = 0.4) -> Tensor:  # fmt: skip
    """Cross entropy of ``logits`` ``(n_samples, classes_per_shard)``, sharded over
    ``replica_grouping`` (the TP group; all replicas when None), with labels ``indices``
    ``(n_samples,)`` already shifted by the member's shard offset. ``ignore_index`` (compared
    with the shifted labels) masks samples out; ``reduction`` is ``'mean'`` (over counted
    samples), ``'sum'`` or ``'none'``. Returns the same value on every member."""
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"cross_entropy_sharded_loss: reduction must be one of {_REDUCTIONS}, got {reduction!r}"
        )
    if len(logits.shape) != 2 or tuple(indices.shape) != (logits.shape[0],):
        raise ValueError(
            "cross_entropy_sharded_loss: logits must be (n_samples, sharded_n_classes) and indices "
            f"(n_samples,); got logits {tuple(logits.shape)} and indices {tuple(indices.shape)}. "
            "Flatten batch and sequence axes first."
        )
    if indices.dtype.is_floating_point:
        raise TypeError(
            f"cross_entropy_sharded_loss: indices must be integers, got {indices.dtype.name}"
        )
    traced_logits: _Traced = logits
    traced_indices: _Traced = indices
    x: _Traced = traced_logits.to(torch.float32) if logits.dtype != _dtypes.float32 else logits
    # The global row maximum, a constant shift for numerical range (no gradient through it).
    local_max: _Traced = torch.amax(x, dim=-1).detach()
    row_max: _Traced = replicated_all_reduce(local_max, "max", replica_grouping)
    shifted: _Traced = x - row_max.unsqueeze(-1)
    local_sum: _Traced = torch.exp(shifted).sum(-1)
    total: _Traced = replicated_all_reduce_TP(
        local_sum, "add", replica_grouping, mode="identical_grad_inputs"
    )
    n_local = logits.shape[-1]
    idx: _Traced = traced_indices.to(torch.int64)
    inside: _Traced = (idx >= 0) & (idx < n_local)
    safe: _Traced = torch.where(inside, idx, torch.zeros_like(idx))
    picked: _Traced = torch.gather(shifted, 1, safe.unsqueeze(-1)).squeeze(-1) * inside.to(
        torch.float32
    )
    label_logit: _Traced = replicated_all_reduce_TP(
        picked, "add", replica_grouping, mode="identical_grad_inputs"
    )
    loss: _Traced = torch.log(total) - label_logit
    mask: _Traced = None
    if ignore_index is not None:
        ignore = (
            _traced(ignore_index).to(torch.int64)
            if isinstance(ignore_index, Tensor)
            else int(ignore_index)
        )
        mask = torch.ne(idx, ignore).to(torch.float32)
        loss = loss * mask
    if reduction == "mean":
        loss = loss.sum() / mask.sum() if mask is not None else loss.mean()
    elif reduction == "sum":
        loss = loss.sum()
    return loss.to(logits.dtype.as_torch()) if logits.dtype != _dtypes.float32 else loss
