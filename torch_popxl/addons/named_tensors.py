"""``NamedTensors`` (a DotTree of popxl tensors) and ``NamedTensorData`` (of host arrays)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .. import ops
from ..ir.tensor import Tensor
from .dot_tree import DotTree
from .utils import OrderedDict

__all__ = ["NamedTensors", "NamedTensorData", "print_named_tensors"]


class NamedTensors(DotTree[Tensor]):
    """Tensors addressed by dotted keys (``vars.fc1.weight``)."""

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """Every leaf, sorted by the tensor's ``name`` (not by key).

        Programs pair variables with gradients by zipping two ``.tensors`` tuples, so this
        order is load-bearing (spec addons §16).
        """
        return tuple(sorted(self.values_flat(), key=lambda t: t.name))

    @property
    def named_tensors(self) -> OrderedDict:
        """Flat ``{key: tensor}`` in insertion order (same as ``to_dict``)."""
        return self.to_dict()

    def remap(self, mapping: Mapping[Tensor, Tensor]) -> NamedTensors:
        """A copy with every leaf ``t`` replaced by ``mapping[t]``."""
        return self.map(lambda t: mapping[t])


class NamedTensorData(DotTree[np.ndarray]):
    """Host arrays addressed by dotted keys."""


def print_named_tensors(named: NamedTensors) -> NamedTensors:
    """A ``print_tensor`` op per leaf, titled with its key; returns the printed aliases."""
    return NamedTensors.from_dict(
        {k: ops.print_tensor(t, title=k) for k, t in named.to_dict().items()}
    )
