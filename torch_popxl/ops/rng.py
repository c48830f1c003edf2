"""Random numbers and seeds: ``random_uniform``, ``random_normal`` and the (2,) uint32 seed ops.
Samples are a function of the seed tensor, as upstream's (Note [samples come from the seed]):
replicas given different seeds (``popxl.create_seeds(..., replicas=R)``) draw different samples.
``dropout`` is in ``nn.py`` and draws its mask the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import dtypes as _dtypes
from ..ir.tensor import Tensor, constant
from ._common import call_op

__all__ = ["random_uniform", "random_normal", "split_random_seed", "create_random_seed"]


# Note [samples come from the seed]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Upstream's random ops draw from their (2,) uint32 seed tensor: the same seed gives the same
# samples (and dropout the same mask) wherever the op runs; replicas differ when their seeds do. Programs rely on it: ``recompute_graph`` replays a forward
# that holds dropout inside the gradient graph, and the gradient must use the forward's mask;
# tensor-parallel applications give every replica of a tensor-parallel group the same seed
# (``addons.seed_variable(seed, tp_group)``) so the dropout of their "identical computation"
# drops the same elements on every shard. Drawing from torch's generator breaks both (the
# replay draws a new mask; vmap randomness gives each replica its own). So a seeded mask is a
# counter-based hash of (seed, element index): ``_mix32`` (a 32-bit integer finaliser, its
# products split in 16-bit halves so they stay exact in int64) applied to the index keyed by
# the seed words; the top 24 bits make a float32 in [0, 1). Replicas whose seeds differ draw
# different masks. Normal samples take two such uniforms per element (Box-Muller).

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_uniform(seed: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """float32 samples in [0, 1) of ``shape``, a function of the (2,) uint32 ``seed`` only
    (Note [samples come from the seed]). Torch code: call it inside a captured function."""
    words = seed.to(torch.int64) & _MASK32
    key = _mix32(words[0] ^ _mix32(words[1] ^ 0x9E3779B9))
    n = 1
    for d in shape:
        n *= int(d)
    index = torch.arange(n, dtype=torch.int64, device=seed.device)
    bits = _mix32(_mix32(index ^ key) ^ words[1])
    return ((bits >> 8).to(torch.float32) * (1.0 / (1 << 24))).reshape(tuple(shape))


def seeded_normal(seed: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Standard normal float32 samples of ``shape`` from ``seed`` alone (Box-Muller)."""
    u = seeded_uniform(seed, (2, *shape))
    radius = torch.sqrt(-2.0 * torch.log1p(-u[0]))  # 1 - u in (0, 1]
    return radius * torch.cos((2.0 * math.pi) * u[1])


def _check_seed(seed: Tensor, op: str) -> None:
    if not isinstance(seed, Tensor) or tuple(seed.shape) != (2,) or seed.dtype != _dtypes.uint32:
        raise ValueError(f"seed Tensor must be shape=(2,) dtype=uint32. Provided {seed}")


def random_uniform(seed_tensor: Tensor, shape: Sequence[int], low: float = 0.0,
                   high: float = 1.0, dtype=_dtypes.float32) -> Tensor:  # fmt: skip
    """Uniform samples in ``[low, high)`` drawn from ``seed_tensor`` (Note [samples come from
    the seed])."""
    _check_seed(seed_tensor, "random_uniform")
    dt = _dtypes.dtype.as_dtype(dtype)
    if not dt.is_floating_point:
        raise ValueError(f"random_uniform: dtype must be a float type; got {dt}.")

    def run(seed):
        u = seeded_uniform(seed, shape)
        return (u * (high - low) + low).to(dt.as_torch())

    return call_op(run, (seed_tensor,), {})


def random_normal(seed_tensor: Tensor, shape: Sequence[int], mean: float = 0.0,
                  std: float = 1.0, dtype=_dtypes.float32) -> Tensor:  # fmt: skip
    """Normal samples with ``mean`` and ``std`` drawn from ``seed_tensor`` (Note [samples come
    from the seed])."""
    _check_seed(seed_tensor, "random_normal")
    dt = _dtypes.dtype.as_dtype(dtype)
    if not dt.is_floating_point:
        raise ValueError(f"random_normal: dtype must be a float type; got {dt}.")

    def run(seed):
        return (seeded_normal(seed, shape) * std + mean).to(dt.as_torch())

    return call_op(run, (seed_tensor,), {})


def create_random_seed(seed: Tensor, modifier: Tensor) -> Tensor:
    """A new (2,) uint32 seed derived from ``seed`` and a scalar ``modifier``."""
    _check_seed(seed, "create_random_seed")

    def run(s, m):
        # An affine mix modulo 2**32 (a bijection of the low word for each modifier) so
        # different modifiers give different seeds; computed in int64 (see ops/_intsafe.py).
        w = s.to(torch.int64)
        m = m.to(torch.int64)
        hi = (w[0] * 69069 + m * 2654435761 + 1) % (1 << 32)
        lo = (w[1] * 1664525 + m * 40503 + 1013904223) % (1 << 32)
        return torch.stack([hi, lo]).to(torch.uint32)

    return call_op(run, (seed, modifier), {})


def split_random_seed(seed: Tensor, n: int = 2) -> tuple[Tensor, ...]:
    """``n`` new seeds from ``seed``: ``seed, s1 = ops.split_random_seed(seed)``."""
    _check_seed(seed, "split_random_seed")
    return tuple(create_random_seed(seed, constant(i, _dtypes.uint32)) for i in range(n))
