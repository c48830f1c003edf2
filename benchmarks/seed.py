"""The seed MNIST configuration the benchmarks share: the MLP of examples/mnist_compile.py
(784-512-512-512-10, GELU) trained with Adam on R=4 replicas x micro-batch 8, gradient
accumulation 8 (256 samples per step), on chip or with sharded, off-chip optimizer state."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch_popxl as popxl  # noqa: E402
from mnist_compile import make_model  # noqa: E402

__all__ = ["GA", "LAYOUTS", "MICRO", "R", "batch", "make_model", "trainer"]

R, GA, MICRO = 4, 8, 8
LAYOUTS = {
    "on-chip": {},
    "remote+RTS": {"rts_threshold": 512, "optimizer_state": "remote"},
}


def batch(replicas: int = R) -> tuple[np.ndarray, np.ndarray]:
    """One step's random images and labels (the same every call)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(replicas * GA * MICRO, 784)).astype(np.float32)
    return x, rng.integers(0, 10, replicas * GA * MICRO)


def trainer(layout: dict | None = None, replicas: int = R,
            optimizer: Callable = lambda ps: torch.optim.Adam(ps, 1e-3), **kw):  # fmt: skip
    """The seed model compiled with ``layout`` (one of ``LAYOUTS``) and ``popxl.compile``'s
    other keywords."""
    model = make_model()
    return popxl.compile(model, torch.nn.functional.cross_entropy, optimizer(model.parameters()),
                         replication_factor=replicas, gradient_accumulation=GA,
                         **(layout or {}), **kw)  # fmt: skip
