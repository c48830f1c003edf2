"""The step cache: large CPU blocks a simulated step frees are kept for its next run.

While a session runs a fragment, a caching CPU allocator from the C++ extension is the
process's CPU allocator (Note [step cache] in ``csrc/step_cache.cpp``): the same activations and
gradients come back every step, and taking them from a free list saves the page faults and
zero fills of fresh memory (over 2,000 per step for the seed MNIST step). Between fragments
torch's own allocator is back, so user code never allocates through the cache.

The cache holds at most ``limit`` bytes (2 GiB unless changed with ``set_limit``); ``empty``
gives every cached block back to the system, and ``stats`` says what it holds.
"""

from __future__ import annotations

import contextlib

from ..opdefs._common import ops

__all__ = ["empty", "running", "set_limit", "stats"]

_STAT_NAMES = ("cached_bytes", "live_bytes", "hits", "misses", "limit")


class _Running:
    """The context of ``running()``: a plain class, not a generator (entered every step)."""

    __slots__ = ()

    def __enter__(self) -> None:
        ops.step_cache_begin()

    def __exit__(self, *exc: object) -> None:
        ops.step_cache_end()


_RUNNING = _Running()


def running() -> contextlib.AbstractContextManager[None]:
    """Install the caching allocator for the enclosed code (nests across threads)."""
    return _RUNNING


def empty() -> None:
    """Give every cached block back to the system (blocks still in use are kept by their
    tensors and cached again when freed, up to the limit)."""
    ops.step_cache_empty()


def set_limit(nbytes: int) -> None:
    """Cache at most ``nbytes`` bytes of freed blocks (0: free every block at once)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"set_limit expects a byte count (int), got {type(nbytes).__name__}.")
    if nbytes < 0:
        raise ValueError(f"set_limit expects a byte count >= 0, got {nbytes}.")
    ops.step_cache_set_limit(nbytes)


def stats() -> dict[str, int]:
    """``cached_bytes`` (free blocks held), ``live_bytes`` (blocks in use), ``hits`` and
    ``misses`` (allocations served from the cache or from the system), ``limit``."""
    return dict(zip(_STAT_NAMES, ops.step_cache_stats(), strict=True))
