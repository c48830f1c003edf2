"""``addons.ops.fp8_utils``: the floating-point formats popxl-addons' float8 scale ops use.

popxl-addons' ``FpDef`` adds to popxl's (``popxl.fp8_utils.FpDef``) each format's largest finite
value and its range of normal exponents; the float8 rows are Graphcore's formats, not the OCP
ones the simulator stores float8 data in (Note [float8 encoding] in dtypes.py).
"""

from __future__ import annotations

from typing import NamedTuple

from ... import fp8_utils as _core

__all__ = ["FpDef", "ieee_fp32_no_denorms", "ieee_fp16_denorms", "float8_152_def", "float8_143_def"]


class FpDef(NamedTuple):
    """popxl's ``FpDef`` fields, then the largest finite value and the normal exponent range."""

    num_exp_bits: int
    num_mantissa_bits: int
    fix_exponent_bias: int
    include_denorm: bool
    has_nans: bool
    max_value: float
    max_exp: int
    min_exp: int


def _extend(core: _core.FpDef, max_value: float, max_exp: int, min_exp: int) -> FpDef:
    return FpDef(*core, max_value=max_value, max_exp=max_exp, min_exp=min_exp)


ieee_fp32_no_denorms = _extend(_core.ieee_fp32_no_denorms, 3.4028235e38, 127, -126)
ieee_fp16_denorms = _extend(_core.ieee_fp16_denorms, 65504, 15, -14)
float8_152_def = _extend(_core.float8_152_def, 57344, 15, -17)
float8_143_def = _extend(_core.float8_143_def, 240, 7, -10)
