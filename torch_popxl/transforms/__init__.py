"""``popxl.transforms``: graph transforms (autodiff)."""

from .autodiff import ExpectedConnection, ExpectedConnectionType, GradGraphInfo, autodiff

__all__ = ["autodiff", "GradGraphInfo", "ExpectedConnection", "ExpectedConnectionType"]
