"""The process-wide ``FakeTensorMode`` that gives every IR tensor its shape and dtype.

Every handle carries a fake tensor (metadata without storage). Graphs, capture and autodiff
create them under this one mode so fakes from different places can be combined.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["fake_like", "fake_mode", "trace_fake"]

# Note [a meta kernel stricter than the kernel]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Fake tensors take each result's shape and dtype from torch's meta kernels. A few refuse
# what the device's kernel runs: ``_grouped_mm``'s meta takes only bfloat16 / float16 /
# float8 (the CUDA kernel's dtypes) while the CPU kernel multiplies float32, which is how
# Hugging Face's mixture-of-experts layers (Mixtral, Qwen3-MoE, ...) run in eager torch on a
# CPU. So where a meta kernel raises for CPU arguments, the CPU kernel says: it runs once on
# zero-filled tensors of the arguments' shapes, dtypes and strides, and its results' metadata
# make the fakes (cached per op and argument metadata). An op that fails there too raises
# the meta kernel's error; so do arguments on another device, and ops whose result shapes
# depend on values (nonzero, unique: a zero-filled stand-in would fix a wrong shape).
# ``nonzero_static`` has no meta kernel (its decomposition reads a value), but its result's
# shape is its ``size`` argument's: the kernel's word is right for it.
_SHAPE_FROM_ARGUMENTS = frozenset({torch.ops.aten.nonzero_static.default})


_inside = [0]  # dispatches of _Mode under way: torch's log of a refusing meta kernel is ours


def _not_ours(record: logging.LogRecord) -> bool:
    """Drops torch's report of a meta kernel that raised inside :class:`_Mode` (its error is
    handled there, or raised to the caller)."""
    return not (
        _inside[0] and record.getMessage().startswith("failed while attempting to run meta")
    )


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_not_ours)


class _Mode(FakeTensorMode):
    """Torch's FakeTensorMode, with the CPU kernel's word where a meta kernel refuses (Note
    [a meta kernel stricter than the kernel])."""

    _from_kernel: dict = {}

    def dispatch(self, func, types, args=(), kwargs=None):
        _inside[0] += 1
        try:
            return super().dispatch(func, types, args, kwargs)
        except RuntimeError as error:
            if func in _SHAPE_FROM_ARGUMENTS:
                error = RuntimeError(str(error))
            metas = self._kernel_metas(func, args, kwargs or {}, error)
        finally:
            _inside[0] -= 1
        return pytree.tree_map(
            lambda m: (
                FakeTensor(self, m, torch.device("cpu")) if isinstance(m, torch.Tensor) else m
            ),
            metas,
        )

    def _kernel_metas(self, func, args, kwargs, error: RuntimeError):
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if (type(error) is not RuntimeError or not tensors  # (not a shape that data decide)
                or any(x.device.type != "cpu" for x in tensors)
                or ({torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
                    & set(getattr(func, "tags", ())) and func not in _SHAPE_FROM_ARGUMENTS)):  # fmt: skip
            raise error
        key = (func, *((tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor)
                       else repr(x) for x in leaves))  # fmt: skip
        if key not in self._from_kernel:
            with _disable_current_modes():
                zeros = pytree.tree_map(
                    lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).zero_()
                    if isinstance(x, torch.Tensor) else x, (args, kwargs))  # fmt: skip
                try:
                    out = func(*zeros[0], **zeros[1])
                except Exception:
                    raise error from None
                self._from_kernel[key] = pytree.tree_map(
                    lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype,
                                                  device="meta")
                    if isinstance(r, torch.Tensor) else r, out)  # fmt: skip
        return self._from_kernel[key]


_FAKE_MODE = _Mode(allow_non_fake_inputs=True)
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


def trace_fake(fn, *args):
    """``fn`` traced into an FX graph on fakes of ``args`` in the process-wide mode (its
    kernels' word where a meta kernel refuses: Note [a meta kernel stricter than the
    kernel]); the graph then runs on real tensors laid out as ``args``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fakes = [_FAKE_MODE.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*fakes)
