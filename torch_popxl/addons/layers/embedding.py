"""``Embedding``: a table lookup, optionally sharded over the vocabulary between replica groups."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch

from ...capture import call_torch
from ...ir.replica_grouping import ReplicaGrouping
from ...ir.tensor import Tensor
from ..module import Module
from ..utils import WeightsDict
from ._common import host_array
from .linear import truncated_normal

__all__ = ["Embedding"]

# Upstream rounds each vocabulary shard up to a multiple of 16 (the IPU's multi-slice likes it);
# kept so that shard sizes, offsets and host layouts match popxl-addons programs.
MULTISLICE_MAGIC_NUMBER = 16


def _masked_lookup(weight: torch.Tensor, indices: torch.Tensor, axis: int, zero_oor: bool):
    idx = indices.to(torch.int64)
    n = weight.shape[axis]
    if zero_oor:
        # Indices outside this shard read row 0 and are then zeroed (so are their gradients).
        inside = (idx >= 0) & (idx < n)
        idx = torch.where(inside, idx, torch.zeros_like(idx))
    out = torch.index_select(weight, axis, idx.reshape(-1))
    out = out.reshape(*weight.shape[:axis], *indices.shape, *weight.shape[axis + 1 :])
    if zero_oor:
        mask = inside.to(out.dtype).reshape(
            *([1] * axis), *indices.shape, *([1] * (weight.dim() - axis - 1))
        )
        out = out * mask
    return out


class Embedding(Module):
    """Embedding table ``weight`` of shape ``(vocab_shard_size, hidden_size)`` (truncated normal,
    std 0.02).

    With a ``replica_grouping`` of more than one group the table is sharded over the vocabulary:
    group ``g`` holds rows ``[offsets[g], offsets[g] + vocab_shard_size)``, callers pass indices
    already shifted by their group's offset (``get_offsets``), and indices outside the local
    shard give zero rows; summing the groups' outputs (an all-reduce) gives the full lookup.
    """

    def __init__(self, dtype, vocab_size: int, hidden_size: int, axis: int = 0,
                 replica_grouping: ReplicaGrouping | None = None):  # fmt: skip
        super().__init__()
        if axis not in (0, 1):
            raise ValueError(
                f"Embedding: axis must be 0 (vocab rows) or 1 (vocab columns), got {axis}"
            )
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.axis = axis
        self.replica_grouping = replica_grouping
        self.n_shards = replica_grouping.num_groups if replica_grouping is not None else 1
        self.vocab_shard_size = self.get_vocab_shard_size(vocab_size, self.n_shards)
        self.offsets = self.get_offsets(vocab_size, self.n_shards)

    @staticmethod
    def get_vocab_shard_size(vocab_size: int, n_shards: int) -> int:
        """Rows per shard: ``ceil(vocab_size / n_shards)`` rounded up to a multiple of 16."""
        per_shard = math.ceil(vocab_size / n_shards)
        return MULTISLICE_MAGIC_NUMBER * math.ceil(per_shard / MULTISLICE_MAGIC_NUMBER)

    @staticmethod
    def get_offsets(vocab_size: int, n_shards: int) -> np.ndarray:
        """First vocabulary index of each shard."""
        size = Embedding.get_vocab_shard_size(vocab_size, n_shards)
        return np.arange(n_shards * size, step=size)

    def build(self, indices: Tensor) -> Tensor:
        """Rows of ``weight`` selected by ``indices``: shape ``(*indices.shape, hidden_size)``."""
        shape = (self.vocab_shard_size, self.hidden_size)
        if self.axis == 1:
            shape = shape[::-1]
        self.weight = self.add_variable_input("weight", partial(truncated_normal, shape), self.dtype,
                                              replica_grouping=self.replica_grouping)  # fmt: skip
        return call_torch(_masked_lookup, (self.weight, indices, self.axis, self.n_shards > 1), {})

    @staticmethod
    def torch_mapping(variables, nn_layer, dtype=None) -> WeightsDict:
        """``{weight: nn.Embedding.weight}`` (unsharded; rows beyond the vocabulary are zero)."""
        w = variables.weight
        data = host_array(nn_layer.weight, dtype or w.dtype)
        padded = np.zeros(w.shape, data.dtype)
        padded[: data.shape[0], : data.shape[1]] = data
        return WeightsDict({w: padded})
