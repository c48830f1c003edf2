"""``addons.ops.grad_reduce_square_add``."""

from .grad_reduce_square_add import grad_reduce_square_add

__all__ = ["grad_reduce_square_add"]
