"""Ops of popxl-addons: cross entropy (with its gradient), host IO helpers and the float8
scaling helper. Sub-packages keep upstream's paths (``ops.rotary_pos_embed``, ...)."""

from .cross_entropy import cross_entropy, cross_entropy_with_grad
from .fp8_amax_scale import fp8_amax_scale
from .streams import host_load, host_store

__all__ = ["cross_entropy", "cross_entropy_with_grad", "fp8_amax_scale", "host_load", "host_store"]
