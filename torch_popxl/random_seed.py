"""``popxl.random_seed``: host-side seed tensors for the random ops."""

from __future__ import annotations

import numpy as np

__all__ = ["create_seeds", "uint64_to_two_uint32", "two_uint32_to_uint64"]

MAX_UINT64 = 2**64 - 1


def create_seeds(seed: int, offset: int = 0, batches_per_step: int = 1,
                 gradient_accumulation_factor: int = 1, replicas: int = 1) -> np.ndarray:  # fmt: skip
    """Seed tensors (uint64 values as two uint32 words) derived from ``seed + offset``.

    Returns a uint32 array of shape ``[batches_per_step, gradient_accumulation_factor,
    replicas, 2]`` with the unit axes squeezed (a single seed has shape ``(2,)``).
    """
    count = batches_per_step * gradient_accumulation_factor * replicas
    values = np.random.default_rng(seed + offset).integers(
        0, MAX_UINT64, endpoint=True, dtype=np.uint64, size=count
    )
    words = np.stack([np.array(uint64_to_two_uint32(int(v)), np.uint32) for v in values])
    return np.squeeze(words.reshape(batches_per_step, gradient_accumulation_factor, replicas, 2))


def uint64_to_two_uint32(num: int) -> tuple[int, int]:
    """``num`` as (most significant 32 bits, least significant 32 bits)."""
    if not 0 <= num <= MAX_UINT64:
        raise ValueError(f"Number is negative or cannot be represented as a uint64: {num}")
    return num >> 32, num & 0xFFFFFFFF


def two_uint32_to_uint64(a: int, b: int) -> int:
    """The uint64 whose high word is ``a`` and low word is ``b``."""
    if not (0 <= a < 2**32 and 0 <= b < 2**32):
        raise ValueError(
            f"Either `a` or `b` are negative or cannot be represented as a uint32: {a}, {b}"
        )
    return (a << 32) | b
