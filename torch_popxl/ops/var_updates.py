"""``popxl.ops.var_updates``: in-place variable updates with PopXL's exact formulas (spec §9).

Each update is written as torch in-place ops on the handle, so the capture layer records the
arithmetic at aten level and the executor performs it in place on the runtime value.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import dtypes as _dtypes
from ..errors import PopXLError
from ..ir.context import gcg
from ..ir.tensor import Tensor, constant
from ._common import call_op
from ._intsafe import int_safe, int_safe_inplace

__all__ = [
    "accumulate_",
    "accumulate_square_",
    "accumulate_mean_",
    "accumulate_moving_average_",
    "accumulate_moving_average_square_",
    "accumulator_scale_",
    "accumulator_zero_",
    "copy_var_update_",
    "sparse_accumulate_",
    "scaled_add",
    "scaled_add_",
    "adam_updater",
    "lamb_updater",
    "adamax_updater",
    "adam_var_update",
    "lamb_square",
]


def _in_graph(*ts) -> None:
    graph = gcg()
    for t in ts:
        if isinstance(t, Tensor) and t._graph is not graph:
            raise ValueError(
                f"Tensor {t.id!r} is in graph {t._graph.id!r}, not in the current graph "
                f"{graph.id!r}. Var-update ops need all tensors in the current graph."
            )


def _same_shape(t: Tensor, X: Tensor, op: str) -> None:
    if tuple(t.shape) != tuple(X.shape):
        raise ValueError(
            f"{op}: the updated tensor {t.id!r} has shape {t.shape} but the update {X.id!r} has "
            f"shape {X.shape}; var updates do not broadcast."
        )


def _as_tensor(x, dtype) -> Tensor:
    return x if isinstance(x, Tensor) else constant(x, dtype)


def _cast(x: Tensor, like: Tensor) -> Tensor:
    if x.dtype == like.dtype:
        return x
    return call_op(torch.Tensor.to, (x, like.dtype.as_torch()), {})


def _t(fn, *args, **kwargs):
    # uint16/32/64 accumulators (step counters) run through int64: see ops/_intsafe.py.
    safe = int_safe_inplace(fn) if fn.__name__.endswith("_") else int_safe(fn)
    return call_op(safe, args, kwargs)


def accumulate_(t: Tensor, X: Tensor, f: float | Tensor | None = None) -> Tensor:
    """``t += X`` (``f`` is None) or ``t += f * X``."""
    _in_graph(t, X, f)
    _same_shape(t, X, "accumulate_")
    X = _cast(X, t)
    if f is None:
        return _t(torch.Tensor.add_, t, X)
    if isinstance(f, Tensor):
        return _t(torch.Tensor.add_, t, _t(torch.mul, X, _cast(f, t)))
    if float(f) == 0.0:
        raise PopXLError("accumulate_: a constant factor of 0 is not allowed.")
    return _t(torch.Tensor.add_, t, X, alpha=float(f))


def accumulate_square_(t: Tensor, X: Tensor, f: float | Tensor = 1.0) -> Tensor:
    """``t += f * X**2``."""
    _in_graph(t, X, f)
    _same_shape(t, X, "accumulate_square_")
    X = _cast(X, t)
    sq = _t(torch.mul, X, X)
    if isinstance(f, Tensor):
        sq = _t(torch.mul, sq, _cast(f, t))
        return _t(torch.Tensor.add_, t, sq)
    return _t(torch.Tensor.add_, t, sq, alpha=float(f))


def accumulate_mean_(t: Tensor, X: Tensor, step: float | Tensor) -> Tensor:
    """Running mean: ``t = step/(step+1) * t + 1/(step+1) * X``."""
    _in_graph(t, X, step)
    _same_shape(t, X, "accumulate_mean_")
    step = _as_tensor(float(step) if not isinstance(step, Tensor) else step, _dtypes.float32)
    step = _cast(step, t)
    b = _t(torch.reciprocal, _t(torch.add, step, 1.0))
    a = _t(torch.rsub, b, 1.0)
    _t(torch.Tensor.mul_, t, a)
    return _t(torch.Tensor.add_, t, _t(torch.mul, _cast(X, t), b))


def _moving_average(t: Tensor, X: Tensor, f, op: str) -> Tensor:
    if isinstance(f, Tensor):
        f = _cast(f, t)
        _t(torch.Tensor.mul_, t, f)
        return _t(torch.Tensor.add_, t, _t(torch.mul, X, _t(torch.rsub, f, 1.0)))
    _t(torch.Tensor.mul_, t, float(f))
    # The device forms 1 - f in float32 (documented: v = 9.9998715e-06 for g = 0.1, f = 0.999).
    return _t(torch.Tensor.add_, t, X, alpha=float(np.float32(1.0) - np.float32(f)))


def accumulate_moving_average_(t: Tensor, X: Tensor, f: float | Tensor) -> Tensor:
    """``t = f * t + (1 - f) * X``."""
    _in_graph(t, X, f)
    _same_shape(t, X, "accumulate_moving_average_")
    return _moving_average(t, _cast(X, t), f, "accumulate_moving_average_")


def accumulate_moving_average_square_(t: Tensor, X: Tensor, f: float | Tensor) -> Tensor:
    """``t = f * t + (1 - f) * X**2``."""
    _in_graph(t, X, f)
    _same_shape(t, X, "accumulate_moving_average_square_")
    X = _cast(X, t)
    return _moving_average(t, _t(torch.mul, X, X), f, "accumulate_moving_average_square_")


def accumulator_scale_(t: Tensor, f: float | Tensor) -> Tensor:
    """``t *= f``; a constant 0 zeroes ``t`` (so NaN/Inf become 0, unlike a multiply)."""
    _in_graph(t, f)
    if isinstance(f, Tensor):
        return _t(torch.Tensor.mul_, t, _cast(f, t))
    if float(f) == 0.0:
        return _t(torch.Tensor.zero_, t)
    return _t(torch.Tensor.mul_, t, float(f))


def accumulator_zero_(t: Tensor) -> Tensor:
    """``t = 0``."""
    return accumulator_scale_(t, 0.0)


def copy_var_update_(t: Tensor, X: Tensor) -> Tensor:
    """``t[...] = X``."""
    _in_graph(t, X)
    X = X if isinstance(X, Tensor) else constant(X, t.dtype)
    _same_shape(t, X, "copy_var_update_")
    return _t(torch.Tensor.copy_, t, X)


def sparse_accumulate_(t: Tensor, X: Tensor, indices: Tensor, axis: int = 0,
                       f: float | Tensor | None = None, W: Tensor | None = None) -> Tensor:  # fmt: skip
    """Scatter-add the rows of ``X`` into ``t`` at ``indices`` along ``axis``, scaled by ``f``."""
    _in_graph(t, X, indices, f)
    X = _cast(X, t)
    if f is not None:
        X = _t(torch.mul, X, _cast(f, t) if isinstance(f, Tensor) else float(f))
    idx = _t(torch.Tensor.to, _t(torch.reshape, indices, (-1,)), torch.int64)
    return _t(torch.Tensor.index_add_, t, axis, idx, X)


def scaled_add(X: Tensor, Y: Tensor, a: float | Tensor = 1.0, b: float | Tensor = 1.0) -> Tensor:
    """``a * X + b * Y`` as a new tensor."""
    _in_graph(X, Y, a, b)
    _check_scales(a, b)
    return _t(torch.add, _scaled(X, a), _scaled(_cast(Y, X), b))


def scaled_add_(X: Tensor, Y: Tensor, a: float | Tensor = 1.0, b: float | Tensor = 1.0) -> Tensor:
    """``X = a * X + b * Y`` in place."""
    _in_graph(X, Y, a, b)
    _check_scales(a, b)
    Y = _cast(Y, X)
    if isinstance(a, Tensor) or float(a) != 1.0:
        _t(torch.Tensor.mul_, X, _cast(a, X) if isinstance(a, Tensor) else _number(a, X))
    if isinstance(b, Tensor):
        return _t(torch.Tensor.add_, X, _t(torch.mul, Y, _cast(b, X)))
    if float(b) == 1.0:
        return _t(torch.Tensor.add_, X, Y)
    return _t(torch.Tensor.add_, X, Y, alpha=_number(b, X))


def _scaled(x: Tensor, s) -> Tensor:
    if isinstance(s, Tensor):
        return _t(torch.mul, x, _cast(s, x))
    return x if float(s) == 1.0 else _t(torch.mul, x, _number(s, x))


def _number(s, like: Tensor) -> float | int:
    """A Python scale for ``like``'s dtype: an integral scale of an integer tensor is an int,
    so the result keeps the integer dtype as upstream's (torch would promote it to float, or
    refuse a float ``alpha``)."""
    value = float(s)
    if not like.dtype.is_floating_point and not like.dtype.is_complex and value.is_integer():
        return int(value)
    return value


def _check_scales(a, b) -> None:
    if isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise PopXLError("scaled_add: unsupported tensor scale0 with non-tensor scale1.")
    if isinstance(b, Tensor) and not isinstance(a, Tensor) and float(a) != 1.0:
        raise PopXLError("scaled_add: a float scale0 must be 1.0 when scale1 is a tensor.")


def _updater(mode: str, m: Tensor, v: Tensor, weight, time_step, weight_decay, beta1, beta2,
             epsilon) -> Tensor:  # fmt: skip
    """The update term shared by Adam, LAMB (``mode`` "adam") and AdaMax (``mode`` "adamax")."""
    _in_graph(m, v, weight, time_step, weight_decay, beta1, beta2, epsilon)
    decay = isinstance(weight_decay, Tensor) or (
        weight_decay is not None and float(weight_decay) != 0.0
    )
    # Upstream's messages, checked in this order before anything is recorded.
    if decay and weight is None:
        raise ValueError("Weight decay requires weight to be not None.")
    if mode == "adamax" and time_step is None:
        raise ValueError("AdaMax requires time_step not None.")
    if mode == "adam" and time_step is not None and (beta1 is None or beta2 is None):
        raise ValueError("Bias correction requires both beta1 and beta2 not None.")
    out_like = weight if (decay and weight is not None) else m
    # The update is computed in the second moment's precision (float32 in mixed-precision
    # Adam, where m is float16): v is tiny (~(1-b2) g^2) and underflows in float16, which
    # would turn m / (sqrt(v) + eps) into m / eps. Only the result is cast (spec addons §8).
    calc = v

    def scalar(x):
        return _cast(x, calc) if isinstance(x, Tensor) else _as_tensor(x, calc.dtype)

    def corrected(acc, beta, t):
        return _t(torch.div, _cast(acc, calc), _t(torch.rsub, _t(torch.pow, scalar(beta), t), 1.0))

    if time_step is not None:
        _t(torch.Tensor.add_, time_step, 1)
        t = _cast(time_step, calc)
        mc = corrected(m, beta1, t)
        # AdaMax's v is an infinity norm and is not bias-corrected.
        vc = v if mode == "adamax" else corrected(v, beta2, t)
    else:
        mc, vc = _cast(m, calc), v
    eps = _cast(epsilon, calc) if isinstance(epsilon, Tensor) else float(epsilon)
    denom = vc if mode == "adamax" else _t(torch.sqrt, vc)
    x = _t(torch.div, mc, _t(torch.add, denom, eps))
    if decay:
        # `decay` implies both (checked above); the type checker cannot follow the bool.
        assert weight is not None and weight_decay is not None
        wd = _cast(weight_decay, calc) if isinstance(weight_decay, Tensor) else float(weight_decay)
        x = _t(torch.add, x, _t(torch.mul, _cast(weight, calc), wd))
    return _cast(x, out_like)


def adam_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Tensor | None = None,
                 time_step: Tensor | None = None, weight_decay: float | Tensor | None = None,
                 beta1: float | Tensor | None = None, beta2: float | Tensor | None = None,
                 epsilon: float | Tensor = 1e-07) -> Tensor:  # fmt: skip
    """The Adam/AdamNoBias update term ``mc / (sqrt(vc) + eps) (+ wd * w)``; see spec §9.

    With ``time_step`` (bias correction: ``mc = m / (1 - b1**t)``, ``vc = v / (1 - b2**t)``)
    it is incremented in place first and the new value is used.

    Raises:
        ValueError: weight decay without ``weight``; ``time_step`` without beta1 and beta2.
    """
    return _updater("adam", acc_first_order, acc_second_order, weight, time_step,
                    weight_decay, beta1, beta2, epsilon)  # fmt: skip


def lamb_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Tensor | None = None,
                 time_step: Tensor | None = None, weight_decay: float | Tensor | None = None,
                 beta1: float | Tensor | None = None, beta2: float | Tensor | None = None,
                 epsilon: float | Tensor = 1e-07) -> Tensor:  # fmt: skip
    """The LAMB update term: Adam's term (LAMB scales it by the trust ratio afterwards, in
    ``adam_var_update`` with ``r1``/``r2``). Same arguments and errors as ``adam_updater``."""
    return _updater("adam", acc_first_order, acc_second_order, weight, time_step,
                    weight_decay, beta1, beta2, epsilon)  # fmt: skip


def adamax_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Tensor | None = None,
                   time_step: Tensor | None = None, weight_decay: float | Tensor | None = None,
                   beta1: float | Tensor = 0.9, epsilon: float | Tensor = 1e-07) -> Tensor:  # fmt: skip
    """The AdaMax update term ``m / (1 - b1**t) / (v + eps) (+ wd * w)``; ``v`` is the
    infinity-norm accumulator. ``time_step`` is required and incremented in place first.

    Raises:
        ValueError: weight decay without ``weight``; ``time_step`` None.
    """
    return _updater("adamax", acc_first_order, acc_second_order, weight, time_step,
                    weight_decay, beta1, None, epsilon)  # fmt: skip


def adam_var_update(t: Tensor, x: Tensor, r1: Tensor | None = None, r2: Tensor | None = None,
                    learning_rate: float | Tensor | None = None,
                    max_weight_norm: float | Tensor | None = None) -> Tensor:  # fmt: skip
    """``t -= lr * ratio * x``; ``ratio`` is the LAMB trust ratio ``min(sqrt r1, mwn) / sqrt r2``
    (1 when r1, r2 or mwn is 0 or not given)."""
    _in_graph(t, x, r1, r2, learning_rate, max_weight_norm)
    step = _cast(x, t)
    if learning_rate is not None:
        lr = _cast(learning_rate, t) if isinstance(learning_rate, Tensor) else float(learning_rate)
        step = _t(torch.mul, step, lr)
    if r1 is not None and r2 is not None:
        s1 = _t(torch.sqrt, _cast(r1, t))
        s2 = _t(torch.sqrt, _cast(r2, t))
        if max_weight_norm is not None:
            mwn = (
                _cast(max_weight_norm, t)
                if isinstance(max_weight_norm, Tensor)
                else float(max_weight_norm)
            )
            s1 = (
                _t(torch.clamp, s1, max=mwn)
                if not isinstance(mwn, Tensor)
                else _t(torch.minimum, s1, mwn)
            )
        zero = _t(torch.logical_or, _t(torch.eq, s1, 0.0), _t(torch.eq, s2, 0.0))
        ratio = _t(torch.where, zero, _t(torch.ones_like, s1), _t(torch.div, s1, s2))
        step = _t(torch.mul, step, ratio)
    return _t(torch.Tensor.sub_, t, step)


def lamb_square(t: Tensor) -> Tensor:
    """Sum of squares of ``t`` as a float32 scalar."""
    _in_graph(t)
    t32 = _t(torch.Tensor.to, t, torch.float32)
    return _t(torch.sum, _t(torch.mul, t32, t32))
