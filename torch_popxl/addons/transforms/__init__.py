"""Graph transforms of popxl-addons: autodiff with and without gradient accumulation."""

from .autodiff import autodiff, autodiff_with_accumulation

__all__ = ["autodiff", "autodiff_with_accumulation"]
