"""``addons.ops.layer_norm_distributed``."""

from .layer_norm_distributed import layer_norm_distributed

__all__ = ["layer_norm_distributed"]
