"""``popxl.transforms.merge_exchange`` / ``io_tile_exchange``: scheduling hints.

Upstream merges the host and remote transfers recorded inside these contexts into one
exchange so they overlap with compute. The simulator has no exchange phase to schedule, so
the contexts keep the program's ops (and their order) unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..ir.context import gcg

__all__ = ["merge_exchange", "io_tile_exchange"]


@contextlib.contextmanager
def merge_exchange() -> Iterator[None]:
    """Merge the transfers recorded inside into one exchange (a no-op on the simulator)."""
    gcg()  # upstream needs a current graph too; this raises the same error without one
    yield


@contextlib.contextmanager
def io_tile_exchange(verify_overlap: bool = True) -> Iterator[None]:
    """Record transfers on the IO tiles, merged into one exchange (``io_tiles`` + ``merge_exchange``).

    ``verify_overlap`` is accepted for upstream's signature; the simulator has one tile set.
    """
    gcg()
    yield
