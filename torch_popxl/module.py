"""``popxl.module``, upstream's module path for the Module base class; defined in ``ir/module.py``."""

from .ir.module import Module

__all__ = ["Module"]
