"""Graph transforms of popxl-addons: autodiff with and without gradient accumulation, and the
available-memory-proportion settings (recorded only)."""

from .autodiff import autodiff, autodiff_with_accumulation
from .available_memory_proportion import (
    set_available_memory_proportion_by_ipu,
    set_graph_available_memory_proportion_by_ipu,
)

__all__ = [
    "autodiff",
    "autodiff_with_accumulation",
    "set_available_memory_proportion_by_ipu",
    "set_graph_available_memory_proportion_by_ipu",
]
