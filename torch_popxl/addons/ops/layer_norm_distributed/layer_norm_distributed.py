"""``layer_norm_distributed``: layer norm of a tensor whose hidden axis is sharded over the
members of a replica group (tensor parallel)."""

from __future__ import annotations

from typing import Any

import torch

from ....ir.replica_grouping import ReplicaGrouping
from ....ir.tensor import Tensor
from ....opdefs.all_reduce_tp import replicated_all_reduce_TP

__all__ = ["layer_norm_distributed"]


def _group_sum(x, group):
    # Each member's statistics feed every member's output, so the gradient of the sum is the
    # sum of the members' gradients: the all-reduce whose gradient is an all-reduce.
    return replicated_all_reduce_TP(x, "add", group, mode="plain")


def layer_norm_distributed(t: Tensor, w: Tensor, b: Tensor, epsilon: float = 1e-5,
                           group: ReplicaGrouping | None = None) -> Tensor:  # fmt: skip
    """Normalise ``t`` ``(N, H_shard)`` over the whole hidden axis, whose shards live on the
    members of ``group`` (all replicas when None), then scale by ``w`` and shift by ``b``
    (``(H_shard,)``, this member's slice). Mean and (biased) variance are over all members."""
    if len(t.shape) != 2 or len(w.shape) != 1 or len(b.shape) != 1:
        raise ValueError(
            f"layer_norm_distributed: t must be (N, H_shard) and w, b (H_shard,); got {tuple(t.shape)}, "
            f"{tuple(w.shape)}, {tuple(b.shape)}"
        )
    rg = t.ir._check_grouping(group)
    hidden = t.shape[-1] * rg.group_size
    x: Any = t
    mean: Any = _group_sum(x.sum(-1, keepdim=True), group) / hidden
    centred: Any = x - mean
    var: Any = _group_sum((centred * centred).sum(-1, keepdim=True), group) / hidden
    return centred * torch.rsqrt(var + epsilon) * w + b
