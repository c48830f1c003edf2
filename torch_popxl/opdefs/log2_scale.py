"""The run-time range check of a power-of-two scaled op's ``log2_scale``.

Note [log2 scale range check]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
PopXL's float8 ops that take their scale as a tensor (``pow2scale_then_cast``,
``cast_then_pow2scale`` and their later names, ``matmul_pow2scaled``, ``conv_pow2scaled``,
``conv_transpose_pow2scaled``) read ``log2_scale`` while the program runs, so its value cannot
be checked when the op is built. Upstream compiles a check into each of them: a scale outside
``[-32, 32)`` stops the run with Poplar's ``application_runtime_error``
(``popart.poplar_application_runtime_error``), unless the program turned the session option
``throwIfLog2ScaleTensorNotInRange`` off (it is on by default). A scale that large is almost
always a bug upstream of the op (an amax of zero or of infinity), and the float8 formats hold
no value it could scale to.

Here the ops read their scale through ``checked_log2_scale``, an identity that raises
``ApplicationRuntimeError`` (which ``popart.poplar_application_runtime_error`` names) when any
replica's scale is out of range. The option is read when a ``Session`` is built, as upstream
compiles it in; the session holds the check on or off for the length of each of its runs
(``checking``). Outside a session's run (a graph traced on fake tensors, a test calling the op
directly) the check is on, upstream's default.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

from ..errors import ApplicationRuntimeError

__all__ = ["LOWER", "UPPER", "checked_log2_scale", "checking"]

# The range upstream's ops accept: LOWER inclusive, UPPER exclusive.
LOWER, UPPER = -32, 32

_state = threading.local()


@contextlib.contextmanager
def checking(enabled: bool) -> Iterator[None]:
    """Turn the check on or off in this thread for the block (a session's run)."""
    before = getattr(_state, "enabled", True)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = before


@torch.library.custom_op("torch_popxl::checked_log2_scale", mutates_args=())
def checked_log2_scale(log2_scale: Tensor) -> Tensor:
    """``log2_scale`` itself, after checking every element is in ``[LOWER, UPPER)``."""
    if getattr(_state, "enabled", True):
        bad = (log2_scale < LOWER) | (log2_scale >= UPPER)
        if bool(bad.any()):
            values = sorted({int(v) for v in log2_scale[bad].reshape(-1).tolist()})
            raise ApplicationRuntimeError(
                f"Log2 scale is not in the range [{LOWER}, {UPPER}): a float8 op's log2_scale "
                f"tensor held {values} when the program ran. Compute a scale in range (clip "
                "it), or set ir._pb_ir.getSessionOptions().throwIfLog2ScaleTensorNotInRange "
                "= False before building the Session to run without this check."
            )
    return log2_scale.clone()


@checked_log2_scale.register_fake
def _(log2_scale):
    return torch.empty_like(log2_scale)


@checked_log2_scale.register_vmap
def _(info, in_dims, log2_scale):
    # Elementwise: the stacked replicas' scales are checked in one call.
    return checked_log2_scale(log2_scale), in_dims[0]
