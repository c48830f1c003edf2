"""Elementwise ops: arithmetic, comparisons, logic, activations, rounding and classification,
and their in-place variants.

Each is a thin wrapper: it checks its PopXL-specific arguments, then runs the torch function
on the handles; the capture layer records the aten ops, so shapes and dtypes come from torch.
Integer arithmetic goes through ``int_safe`` (ops/_intsafe.py) for the unsigned dtypes torch's
CPU kernels lack. In-place variants (trailing ``_``) modify their first input and return it
(an alias), as upstream's in-place ops do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from ..ir.tensor import Tensor
from ._common import _check_tensor, _coerce, _TensorLike, call_op
from ._intsafe import int_safe, int_safe_inplace

__all__ = [
    "add", "sub", "mul", "div", "neg", "negate", "abs", "exp", "log", "sqrt", "pow", "fmod",
    "relu", "gelu", "tanh", "sigmoid", "swish", "softmax", "log_softmax", "cos", "sin",
    "logical_and", "logical_or", "logical_not", "equal", "greater", "less", "where", "max",
    "min", "maximum", "minimum", "increment_mod", "clip", "identity", "io_tile_copy", "ceil",
    "floor", "sign", "isfinite", "isinf", "isnan", "geluerf", "add_", "relu_", "gelu_", "exp_",
    "increment_mod_"
]  # fmt: skip


def _binary(fn, lhs, rhs, op):
    if not isinstance(lhs, Tensor) and isinstance(rhs, Tensor):
        lhs = _coerce(rhs, lhs)
    lhs = _check_tensor(lhs, op)
    return call_op(int_safe(fn), (lhs, _coerce(lhs, rhs)), {})


def _unary(fn, t, op, **kwargs):
    return call_op(int_safe(fn), (_check_tensor(t, op),), kwargs)


# ---- arithmetic ---------------------------------------------------------------------------


def add(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.add, lhs, rhs, "add")


def sub(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.sub, lhs, rhs, "sub")


def _div(a, b):
    # PopXL `/` on integer tensors is integer division (truncating), as in C++.
    if not a.dtype.is_floating_point and not a.dtype.is_complex:
        return torch.div(a, b, rounding_mode="trunc")
    return torch.div(a, b)


def mul(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.mul, lhs, rhs, "mul")


def div(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(_div, lhs, rhs, "div")


def fmod(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.fmod, lhs, rhs, "fmod")


def pow(t: Tensor, e) -> Tensor:
    return _binary(torch.pow, t, e, "pow")


def neg(t: Tensor) -> Tensor:
    return _unary(torch.neg, t, "neg")


negate = neg


def abs(t: Tensor) -> Tensor:
    return _unary(torch.abs, t, "abs")


def exp(t: Tensor) -> Tensor:
    return _unary(torch.exp, t, "exp")


def log(t: Tensor) -> Tensor:
    return _unary(torch.log, t, "log")


def sqrt(t: Tensor) -> Tensor:
    return _unary(torch.sqrt, t, "sqrt")


def cos(t: Tensor) -> Tensor:
    return _unary(torch.cos, t, "cos")


def sin(t: Tensor) -> Tensor:
    return _unary(torch.sin, t, "sin")


def maximum(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.maximum, lhs, rhs, "maximum")


def minimum(lhs: _TensorLike, rhs: _TensorLike) -> Tensor:
    return _binary(torch.minimum, lhs, rhs, "minimum")


def max(ts: Iterable[Tensor]) -> Tensor:
    """Elementwise maximum of several tensors."""
    ts = list(ts)
    out = ts[0]
    for t in ts[1:]:
        out = maximum(out, t)
    return out


def min(ts: Iterable[Tensor]) -> Tensor:
    """Elementwise minimum of several tensors."""
    ts = list(ts)
    out = ts[0]
    for t in ts[1:]:
        out = minimum(out, t)
    return out


def clip(t: Tensor, min: float = -math.inf, max: float = math.inf) -> Tensor:
    return _unary(torch.clamp, t, "clip", min=min, max=max)


def increment_mod(t: Tensor, increment: float, modulus: float) -> Tensor:
    return fmod(add(t, increment), modulus)


# ---- activations --------------------------------------------------------------------------


def relu(t: Tensor) -> Tensor:
    return _unary(torch.relu, t, "relu")


def gelu(t: Tensor) -> Tensor:
    # PopLibs' GELU is the tanh approximation.
    return _unary(torch.nn.functional.gelu, t, "gelu", approximate="tanh")


def geluerf(t: Tensor) -> Tensor:
    """GELU with the exact erf formula (``ops.gelu`` is the tanh approximation)."""
    return call_op(F.gelu, (_check_tensor(t, "geluerf"),), {})


def tanh(t: Tensor) -> Tensor:
    return _unary(torch.tanh, t, "tanh")


def sigmoid(t: Tensor) -> Tensor:
    return _unary(torch.sigmoid, t, "sigmoid")


def swish(t: Tensor) -> Tensor:
    return _unary(torch.nn.functional.silu, t, "swish")


def softmax(t: Tensor, axis: int) -> Tensor:
    return _unary(torch.softmax, t, "softmax", dim=axis)


def log_softmax(t: Tensor, axis: int) -> Tensor:
    return _unary(torch.log_softmax, t, "log_softmax", dim=axis)


# ---- logic and comparisons ----------------------------------------------------------------


def logical_and(lhs: Tensor, rhs: Tensor) -> Tensor:
    return _binary(torch.logical_and, lhs, rhs, "logical_and")


def logical_or(lhs: Tensor, rhs: Tensor) -> Tensor:
    return _binary(torch.logical_or, lhs, rhs, "logical_or")


def logical_not(t: Tensor) -> Tensor:
    return _unary(torch.logical_not, t, "logical_not")


def equal(lhs: Tensor, rhs: Tensor) -> Tensor:
    return _binary(torch.eq, lhs, rhs, "equal")


def greater(input: Tensor, other: Tensor) -> Tensor:
    return _binary(torch.gt, input, other, "greater")


def less(input: Tensor, other: Tensor) -> Tensor:
    return _binary(torch.lt, input, other, "less")


def where(condition: Tensor, lhs, rhs) -> Tensor:
    condition = _check_tensor(condition, "where")
    ref = lhs if isinstance(lhs, Tensor) else rhs
    if not isinstance(ref, Tensor):
        raise TypeError("ops.where needs at least one of lhs / rhs to be a popxl Tensor.")
    return call_op(torch.where, (condition, _coerce(ref, lhs), _coerce(ref, rhs)), {})


def isfinite(t: Tensor) -> Tensor:
    return call_op(torch.isfinite, (_check_tensor(t, "isfinite"),), {})


def isinf(t: Tensor) -> Tensor:
    return call_op(torch.isinf, (_check_tensor(t, "isinf"),), {})


def isnan(t: Tensor) -> Tensor:
    return call_op(torch.isnan, (_check_tensor(t, "isnan"),), {})


# ---- rounding and copies ------------------------------------------------------------------


def ceil(t: Tensor) -> Tensor:
    return call_op(torch.ceil, (_check_tensor(t, "ceil"),), {})


def floor(t: Tensor) -> Tensor:
    return call_op(torch.floor, (_check_tensor(t, "floor"),), {})


def sign(t: Tensor) -> Tensor:
    return call_op(int_safe(torch.sign), (_check_tensor(t, "sign"),), {})


def identity(t: Tensor) -> Tensor:
    """A copy of ``t``."""
    return call_op(torch.clone, (_check_tensor(t, "identity"),), {})


def io_tile_copy(t: Tensor) -> Tensor:
    """Copy between compute and IO tiles: a copy on the simulator, which has one tile set."""
    return call_op(torch.clone, (_check_tensor(t, "io_tile_copy"),), {})


# ---- in-place variants --------------------------------------------------------------------


def add_(lhs: Tensor, rhs) -> Tensor:
    """``lhs += rhs`` in place; returns ``lhs`` (an alias). Differentiable."""
    lhs = _check_tensor(lhs, "add_")
    return call_op(int_safe_inplace(torch.Tensor.add_), (lhs, _coerce(lhs, rhs)), {})


def _copy_into(t: Tensor, fn, op: str, *args, **kwargs) -> Tensor:
    def run(x, *a):
        return x.copy_(fn(x, *a, **kwargs))

    return call_op(run, (_check_tensor(t, op), *args), {})


def relu_(t: Tensor) -> Tensor:
    """ReLU of ``t`` in place; returns ``t``."""
    return call_op(torch.Tensor.relu_, (_check_tensor(t, "relu_"),), {})


def gelu_(t: Tensor) -> Tensor:
    """GELU (tanh approximation, as ``ops.gelu``) of ``t`` in place; returns ``t``."""
    return _copy_into(t, F.gelu, "gelu_", approximate="tanh")


def exp_(t: Tensor) -> Tensor:
    """``exp(t)`` in place; returns ``t``."""
    return call_op(torch.Tensor.exp_, (_check_tensor(t, "exp_"),), {})


def increment_mod_(t: Tensor, increment: float, modulus: float) -> Tensor:
    """``t = (t + increment) % modulus`` in place (fmod semantics); returns ``t``."""
    if modulus == 0:
        raise ValueError("increment_mod_: modulus must be non-zero; got 0.")

    def run(x):
        return x.copy_(int_safe(torch.fmod)(int_safe(torch.add)(x, increment), modulus))

    return call_op(run, (_check_tensor(t, "increment_mod_"),), {})
