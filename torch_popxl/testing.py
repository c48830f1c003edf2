"""``popxl.testing``: the dtype lists upstream's test suites parametrize over."""

from __future__ import annotations

from . import dtypes as _dtypes

__all__ = ["get_all_dtypes", "get_all_int_dtypes"]


def get_all_int_dtypes(include_signed: bool = True, include_unsigned: bool = True) -> list:
    """The integer dtypes: signed (int8 .. int64) then unsigned (uint8 .. uint64)."""
    signed = [_dtypes.int8, _dtypes.int16, _dtypes.int32, _dtypes.int64]
    unsigned = [_dtypes.uint8, _dtypes.uint16, _dtypes.uint32, _dtypes.uint64]
    return (signed if include_signed else []) + (unsigned if include_unsigned else [])


def get_all_dtypes() -> list:
    """Every integer, floating-point (float16 .. float64) and complex dtype; not bool, float8
    or this package's bfloat16 extension."""
    floats = [_dtypes.float16, _dtypes.float32, _dtypes.float64]
    return get_all_int_dtypes() + floats + [_dtypes.complex64, _dtypes.complex128]
