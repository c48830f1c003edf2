"""``cross_entropy_sharded_wr_loss``: cross entropy of logits sharded over the class axis between
IPUs *within* one replica (the logits are a list of tensors, one per IPU)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ....capture import call_torch
from ....ir.tensor import Tensor

__all__ = ["cross_entropy_sharded_wr_loss"]


def _loss(logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    full = torch.cat([x.to(torch.float32) for x in logits], dim=1)
    picked = torch.gather(full, 1, labels.to(torch.int64).unsqueeze(1)).squeeze(1)
    return torch.logsumexp(full, dim=1) - picked


def cross_entropy_sharded_wr_loss(logits: Sequence[Tensor], indices: Sequence[Tensor],
                                  ipus: Iterable[int] | None = None) -> Tensor:  # fmt: skip
    """Unreduced loss ``(n_samples,)`` of the class-sharded ``logits`` (``(n_samples,
    classes_i)`` each, shards in class order) for the unshifted labels ``indices`` (the same
    labels per shard; the op shifts them itself). ``ipus`` (one per shard) is checked for
    length only: placement changes no value here."""
    logits, indices = list(logits), list(indices)
    if not logits or len(logits) != len(indices):
        raise ValueError(
            "cross_entropy_sharded_wr_loss: give one indices tensor per logits shard; got "
            f"{len(logits)} logits and {len(indices)} indices"
        )
    if ipus is not None and len(list(ipus)) != len(logits):
        raise ValueError(
            f"cross_entropy_sharded_wr_loss: {len(logits)} shards but {len(list(ipus))} IPUs were given"
        )
    n = logits[0].shape[0]
    for x in logits:
        if len(x.shape) != 2 or x.shape[0] != n:
            raise ValueError(
                "cross_entropy_sharded_wr_loss: every logits shard must be (n_samples, classes_i) with "
                f"the same n_samples; got {[tuple(t.shape) for t in logits]}"
            )
    return call_torch(_loss, (logits, indices[0]), {})
