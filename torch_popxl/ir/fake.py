"""The process-wide ``FakeTensorMode`` that gives every IR tensor its shape and dtype.

Every handle carries a fake tensor (metadata without storage). Graphs, capture and autodiff
create them under this one mode so fakes from different places can be combined.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["fake_like", "fake_mode"]

_FAKE_MODE = FakeTensorMode(allow_non_fake_inputs=True)
_fake_depth = 0


@contextlib.contextmanager
def fake_mode() -> Iterator[FakeTensorMode]:
    """Enter the process-wide FakeTensorMode (re-entrant)."""
    global _fake_depth
    if _fake_depth:
        _fake_depth += 1
        try:
            yield _FAKE_MODE
        finally:
            _fake_depth -= 1
        return
    _fake_depth += 1
    try:
        with _FAKE_MODE:
            yield _FAKE_MODE
    finally:
        _fake_depth -= 1


def fake_like(shape, dtype: torch.dtype) -> torch.Tensor:
    """An empty fake tensor of ``shape`` and torch ``dtype``."""
    with fake_mode():
        return torch.empty(tuple(shape), dtype=dtype)
