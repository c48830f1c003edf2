"""``popxl.session``, upstream's module path for ``Session``; defined in ``runtime/session.py``."""

from .runtime.session import Session

__all__ = ["Session"]
