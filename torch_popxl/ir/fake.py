"""The process-wide ``FakeTensorMode`` that gives every IR tensor its shape and dtype.

Every handle carries a fake tensor (metadata without storage). Graphs, capture and autodiff
create them under this one mode so fakes from different places can be combined.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["fake_like", "fake_mode"]

aten = torch.ops.aten

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


# Note [ctc_loss shapes]
#     torch tags ``aten._ctc_loss`` as having data-dependent output shapes, so its fake tensors
#     refuse it: its ``log_alpha`` output is ``[N, T, 2 * max(target_lengths) + 1]``. With
#     the lengths given as Python ints (the ``int[]`` overload, ``F.ctc_loss(..., (T,) * N,
#     (S,) * N)``) that maximum is known when the graph is captured, so the shapes are static;
#     this rule gives them (as the CPU and CUDA kernels make them), ahead of torch's refusal.
#     Lengths given as tensors (the ``.Tensor`` overload) stay data-dependent and refused.
def _ctc_loss_fake(mode, func, log_probs, targets, input_lengths, target_lengths, blank=0,
                   zero_infinity=False):  # fmt: skip
    if log_probs.dim() != 3:  # the kernel takes [T, N, C] only: torch's refusal stands
        return NotImplemented
    steps, n, _ = log_probs.shape
    with mode:
        alpha = log_probs.new_empty((n, steps, 2 * max(target_lengths, default=0) + 1))
        return log_probs.new_empty((n,)), alpha


if not any(impl is _ctc_loss_fake for _, impl in fake_impls.op_implementations_checks):
    fake_impls.op_implementations_checks.insert(
        0, (lambda func: func is aten._ctc_loss.default, _ctc_loss_fake)
    )
