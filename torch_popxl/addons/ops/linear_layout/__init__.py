"""``addons.ops.linear_layout``."""

from .linear_layout import linear_layout

__all__ = ["linear_layout"]
