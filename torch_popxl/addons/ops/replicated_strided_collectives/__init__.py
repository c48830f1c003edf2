"""``addons.ops.replicated_strided_collectives``: collectives over strided replica groupings."""

from .replicated_all_gather_strided import replicated_all_gather_strided
from .replicated_all_reduce_strided import (
    replicated_all_reduce_strided,
    replicated_all_reduce_strided_graph,
    replicated_all_reduce_strided_identical_grad_inputs,
    replicated_all_reduce_strided_identical_inputs,
)
from .replicated_reduce_scatter_strided import replicated_reduce_scatter_strided

__all__ = [
    "replicated_all_gather_strided",
    "replicated_all_reduce_strided",
    "replicated_all_reduce_strided_graph",
    "replicated_all_reduce_strided_identical_grad_inputs",
    "replicated_all_reduce_strided_identical_inputs",
    "replicated_reduce_scatter_strided",
]
