"""``LayerNormDistributed``: ``LayerNorm`` of a tensor whose hidden axis is sharded over a replica
group; each member keeps its slice of ``weight`` and ``bias``."""

from __future__ import annotations

from functools import partial

import numpy as np

from ...ir.replica_grouping import ReplicaGrouping
from ...ir.tensor import Tensor
from ..module import Module
from ..ops.layer_norm_distributed import layer_norm_distributed

__all__ = ["LayerNormDistributed"]


class LayerNormDistributed(Module):
    """Layer norm over a hidden axis sharded across ``replica_grouping`` (all replicas when None).

    The variables use the transposed grouping, so the members of one sharding group hold
    different slices (ones / zeros initially).
    """

    def __init__(self, replica_grouping: ReplicaGrouping | None = None):
        super().__init__()
        self.replica_grouping = replica_grouping

    def build(self, x: Tensor, eps: float = 1e-5) -> Tensor:
        group = x.ir._check_grouping(self.replica_grouping)
        shards = group.transpose()
        w = self.add_variable_input(
            "weight", partial(np.ones, x.shape[-1]), x.dtype, replica_grouping=shards
        )
        b = self.add_variable_input(
            "bias", partial(np.zeros, x.shape[-1]), x.dtype, replica_grouping=shards
        )
        return layer_norm_distributed(x, w, b, epsilon=eps, group=group)
