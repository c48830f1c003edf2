"""``popxl.transforms``: graph transforms (autodiff) and exchange scheduling contexts."""

from .autodiff import ExpectedConnection, ExpectedConnectionType, GradGraphInfo, autodiff
from .merge_exchange import io_tile_exchange, merge_exchange

__all__ = [
    "autodiff",
    "GradGraphInfo",
    "ExpectedConnection",
    "ExpectedConnectionType",
    "merge_exchange",
    "io_tile_exchange",
]
