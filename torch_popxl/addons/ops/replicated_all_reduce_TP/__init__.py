"""``addons.ops.replicated_all_reduce_TP``: the tensor-parallel all-reduces."""

from .replicated_all_reduce_TP import (
    replicated_all_reduce,
    replicated_all_reduce_identical_grad_inputs,
    replicated_all_reduce_identical_inputs,
)

__all__ = [
    "replicated_all_reduce",
    "replicated_all_reduce_identical_grad_inputs",
    "replicated_all_reduce_identical_inputs",
]
