"""``popxl.transforms``: graph transforms (autodiff, decompose_sum) and exchange scheduling
contexts."""

from . import functions as _functions  # noqa: F401  (registers the capture hook)
from .autodiff import ExpectedConnection, ExpectedConnectionType, GradGraphInfo, autodiff
from .decompose_sum import decompose_sum
from .merge_exchange import io_tile_exchange, merge_exchange

__all__ = [
    "autodiff",
    "decompose_sum",
    "GradGraphInfo",
    "ExpectedConnection",
    "ExpectedConnectionType",
    "merge_exchange",
    "io_tile_exchange",
]
