"""Optimizers of popxl-addons."""

from .adam import AdamOptimizerStep

__all__ = ["AdamOptimizerStep"]
