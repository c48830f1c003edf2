"""Layers of popxl-addons."""

from .linear import Linear

__all__ = ["Linear"]
