"""Ops of popxl-addons: cross entropy (with its gradient) and host IO helpers."""

from .cross_entropy import cross_entropy, cross_entropy_with_grad
from .streams import host_load, host_store

__all__ = ["cross_entropy", "cross_entropy_with_grad", "host_load", "host_store"]
