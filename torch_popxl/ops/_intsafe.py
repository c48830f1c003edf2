"""Arithmetic on the unsigned integer dtypes torch's CPU kernels lack.

torch stores uint16 / uint32 / uint64 but implements few kernels for them (``add`` on uint32
raises "add_stub not implemented for 'UInt32'"). PopXL programs use uint32 for seeds and
counters, so the ops run such calls in int64 and cast the results back: the cast wraps modulo
``2**bits``, which is the C++ unsigned arithmetic the IPU performs. uint64 values above
``2**63`` pass through int64 as their two's-complement bit pattern, so add, sub and mul still
wrap correctly; comparisons of such values do not (noted where used).
"""

from __future__ import annotations

import functools

import torch

# The unsigned dtypes whose CPU kernels are missing; uint8 has full kernel coverage.
NARROW_UNSIGNED = frozenset({torch.uint16, torch.uint32, torch.uint64})


def _narrow_dtype(args) -> torch.dtype | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dtype in NARROW_UNSIGNED:
            return a.dtype
        if isinstance(a, list | tuple):
            found = _narrow_dtype(a)
            if found is not None:
                return found
    return None


def _widen(x):
    if isinstance(x, torch.Tensor) and x.dtype in NARROW_UNSIGNED:
        return x.to(torch.int64)
    if isinstance(x, list | tuple):
        return type(x)(_widen(v) for v in x)
    return x


def int_safe(fn):
    """``fn`` made to work on uint16/32/64 tensors: computed in int64, results cast back.

    Results that came out as int64 are cast back to the unsigned input dtype; other results
    (bools of comparisons, floats of true division) are returned as they are.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):
        narrow = _narrow_dtype(args)
        if narrow is None:
            return fn(*args, **kwargs)
        out = fn(*_widen(args), **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.int64:
            return out.to(narrow)
        return out

    return run


def int_safe_inplace(fn):
    """An in-place ``fn(t, *rest)`` (``torch.Tensor.add_``) made to work on uint16/32/64 ``t``.

    The out-of-place result is computed in int64 and copied into ``t`` (the copy wraps), so the
    recorded op still writes ``t`` and returns it.
    """

    @functools.wraps(fn)
    def run(t, *args, **kwargs):
        if _narrow_dtype((t, *args)) is None:
            return fn(t, *args, **kwargs)
        if t.dtype not in NARROW_UNSIGNED:
            return fn(t, *_widen(args), **kwargs)
        wide = t.to(torch.int64)
        fn(wide, *_widen(args), **kwargs)
        return t.copy_(wide)

    return run
