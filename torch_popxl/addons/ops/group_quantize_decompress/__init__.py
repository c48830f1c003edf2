"""``addons.ops.group_quantize_decompress``: 4-bit group quantisation."""

from .group_quantize_decompress import (
    group_quantize_compress_numpy,
    group_quantize_decompress,
    group_quantize_decompress_numpy,
)

__all__ = [
    "group_quantize_compress_numpy",
    "group_quantize_decompress",
    "group_quantize_decompress_numpy",
]
