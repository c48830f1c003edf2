"""Timing helpers: interleaved medians so the ratio survives a noisy shared machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int = 30, warmup: int = 3
) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}
