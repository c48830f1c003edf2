"""``addons.ops.fp8_mse_scale``."""

from .fp8_mse_scale import fp8_mse_scale

__all__ = ["fp8_mse_scale"]
