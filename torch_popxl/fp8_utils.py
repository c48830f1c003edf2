"""``popxl.fp8_utils``: the float8 host conversions under their newer upstream names.

``host_pow2scale_cast_to_fp8`` / ``host_pow2scale_cast_from_fp8`` are
``utils.host_pow2scale_then_cast`` / ``utils.host_cast_then_pow2scale`` that also take or give
float16. ``host_fp8_mse_scale`` is upstream's search for the scaling bias that loses least when
casting to float8 (Note [float8 MSE scale]); popxl-addons' ``ops.fp8_mse_scale`` runs the same
search in a graph.

Note [float8 MSE scale]
    A value ``F * 2**(p + b - e)`` of a float8 format has exponent ``p - e`` in a fixed range
    (``find_exponential_range``: [-10, 7] for float8_143, [-17, 15] for float8_152, denormals
    included) and a scaling bias ``b`` in [-31, 31]. The search builds a histogram of the source's
    binary exponents over float32's range (bin 0: below 2**-126; the last bin: above 2**125),
    normalises it, and for each of the 63 biases prices the data the shifted window of
    ``format_span`` exponents would lose: values below the window cost their square, values in it
    their square times the relative quantisation error ``2**(-2 * (src mantissa bits - float8
    mantissa bits))``, values above it the square of their distance to the window's top (upstream
    indexes that top by the bias's position, not the window's start; kept as upstream). Each
    cost is summed in float64 in upstream's order (a constant ``(2**-126 / 2)**2``, then one term
    per histogram bin), so equal costs are exactly equal. The lowest cost wins; among equal ones
    the middle bias (upstream's ``sorted(ties)[len(ties) // 2]``), and the scale is its negation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from . import dtypes as _dtypes
from .utils import host_cast_then_pow2scale, host_pow2scale_then_cast

__all__ = ["host_pow2scale_cast_to_fp8", "host_pow2scale_cast_from_fp8", "host_fp8_mse_scale",
           "FpDef", "ieee_fp32_no_denorms", "ieee_fp16_denorms", "float8_143_def",
           "float8_152_def", "find_exponential_range", "mse_scale_search"]  # fmt: skip


class FpDef(NamedTuple):
    """A floating-point format as upstream's popxl.fp8_utils describes it."""

    num_exp_bits: int
    num_mantissa_bits: int
    fix_exponent_bias: int  # added to the exponent
    include_denorm: bool
    has_nans: bool  # a whole exponent code is NaN


ieee_fp32_no_denorms = FpDef(8, 23, 127, False, True)
ieee_fp16_denorms = FpDef(5, 10, 15, True, True)
float8_152_def = FpDef(5, 2, 16, True, False)
float8_143_def = FpDef(4, 3, 8, True, False)

_MAX_SCALING_BIAS = 31
_MIN_SCALING_BIAS = -31


def find_exponential_range(fp_def: FpDef) -> tuple[int, int]:
    """The (min, max) exponent ``p - e`` the format represents without a scaling bias."""
    low = 1 - fp_def.fix_exponent_bias - (fp_def.num_mantissa_bits if fp_def.include_denorm else 0)
    high = (1 << fp_def.num_exp_bits) - 1 - int(fp_def.has_nans) - fp_def.fix_exponent_bias
    return low, high


def mse_scale_search(src: torch.Tensor, dest: FpDef, src_mantissa_bits: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(lowest cost as float64, scaling bias as int32) of Note [float8 MSE scale] for the values
    of ``src`` (any shape). Written with torch ops of fixed shapes, so a graph can record it."""
    min_exp, max_exp = find_exponential_range(ieee_fp32_no_denorms)  # the histogram's range
    n_limits = max_exp - min_exp
    lo_dest, hi_dest = find_exponential_range(dest)
    span = hi_dest - lo_dest + 1
    first = max(lo_dest + _MIN_SCALING_BIAS - min_exp, 0)
    last = min(lo_dest + _MAX_SCALING_BIAS - min_exp, max_exp - min_exp)
    q = 2.0 ** (-2.0 * (src_mantissa_bits - dest.num_mantissa_bits))

    x = src.reshape(-1).to(torch.float64).abs()
    _, e = torch.frexp(x)
    bins = (e.to(torch.int64) - min_exp).clamp(1, n_limits)
    bins = torch.where(x < 2.0**min_exp, 0, bins)
    bins = torch.where(x > 2.0 ** (max_exp - 1), n_limits, bins)
    hist = torch.zeros(n_limits + 1, dtype=torch.float64, device=x.device)
    hist = hist.scatter_add(0, bins, torch.ones_like(x))
    h = (hist / hist.sum())[1:]  # the bins that the limits 2**min_exp .. 2**(max_exp-1) start

    limits = 2.0 ** torch.arange(min_exp, max_exp, dtype=torch.float64, device=x.device)
    i = torch.arange(n_limits, device=x.device)
    k = torch.arange(last - first + 1, device=x.device)
    start = (first + k)[:, None]
    under = limits**2 * h
    inside = limits**2 * h * q
    top = limits[k + span - 1][:, None]
    over = (top - limits) ** 2 * h
    terms = torch.where(i < start, under, torch.where(i < start + span, inside, over))
    lead = torch.full((len(k), 1), (2.0**min_exp / 2) ** 2, dtype=torch.float64, device=x.device)
    cost = torch.cumsum(torch.cat([lead, terms], dim=1), dim=1)[:, -1]  # sequential, in order
    lowest = cost.min()
    ties = cost == lowest
    rank = torch.cumsum(ties.to(torch.int64), 0)
    middle = ties & (rank == ties.sum() // 2 + 1)
    bias = torch.argmax(middle.to(torch.int64)) + _MIN_SCALING_BIAS  # as upstream, from -31
    return lowest, (-bias).to(torch.int32)


def host_fp8_mse_scale(src: Any, dtype: Any = None) -> tuple[float, int]:
    """Upstream's scale search on the host: ``(lowest cost, scale)`` such that
    ``cast(src * 2**scale, dtype)`` loses least (Note [float8 MSE scale]). ``src`` is float16 or
    float32 data; ``dtype`` float8_143 (also when None) or float8_152.

    Raises:
        RuntimeError: ``src`` is not float16 / float32 data.
    """
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    src = np.asarray(src)
    if src.dtype not in (np.float16, np.float32):
        raise RuntimeError(
            f"host_fp8_mse_scale: src must be float16 or float32 data; got {src.dtype}."
        )
    dest = float8_152_def if dtype == _dtypes.float8_152 else float8_143_def
    mantissa = (
        ieee_fp32_no_denorms if src.dtype == np.float32 else ieee_fp16_denorms
    ).num_mantissa_bits
    cost, scale = mse_scale_search(torch.from_numpy(src.astype(np.float32)), dest, mantissa)
    return float(cost), int(scale)


def host_pow2scale_cast_to_fp8(src: Any, dtype: Any = None, log2_scale: int = 0,
                               nan_on_overflow: bool = True) -> np.ndarray:  # fmt: skip
    """``cast(src * 2**log2_scale, dtype)`` on the host: float16/32/64 data (numpy or torch)
    to PopXL's numpy float8 representation (``dtype`` float8_143 or float8_152).

    Raises:
        RuntimeError: ``src`` is not float16/32/64 or ``dtype`` is not a float8 type.
    """
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    src = np.asarray(src, order="C")
    if src.dtype == np.float16:
        src = src.astype(np.float32)  # exact: every float16 is a float32
    return host_pow2scale_then_cast(src, dtype, log2_scale, nan_on_overflow)


def host_pow2scale_cast_from_fp8(src: np.ndarray, dtype: Any = None, log2_scale: int = 0) -> np.ndarray:  # fmt: skip
    """``cast(src, dtype) * 2**log2_scale`` on the host: PopXL float8 data to ``dtype``
    float16, float32 or float64.

    Raises:
        RuntimeError: ``src`` is not float8 data or ``dtype`` is not float16/32/64.
    """
    if dtype == _dtypes.float16:
        return host_cast_then_pow2scale(src, _dtypes.float64, log2_scale).astype(np.float16)
    return host_cast_then_pow2scale(src, dtype, log2_scale)
