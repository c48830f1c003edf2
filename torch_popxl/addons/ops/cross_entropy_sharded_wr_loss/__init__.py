"""``addons.ops.cross_entropy_sharded_wr_loss``."""

from .cross_entropy_sharded_wr_loss import cross_entropy_sharded_wr_loss

__all__ = ["cross_entropy_sharded_wr_loss"]
