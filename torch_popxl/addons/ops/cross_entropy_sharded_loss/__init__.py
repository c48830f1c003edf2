"""``addons.ops.cross_entropy_sharded_loss``."""

from .cross_entropy_sharded_loss import cross_entropy_sharded_loss

__all__ = ["cross_entropy_sharded_loss"]
