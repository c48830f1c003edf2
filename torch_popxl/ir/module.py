"""``popxl.Module``: a reusable graph builder."""

from __future__ import annotations

from typing import Any

from .context import gir

__all__ = ["Module"]


class Module:
    """Base class for graph builders: override ``build``; ``ir.create_graph(module, ...)``.

    ``__call__`` forwards to ``build``. The usual pattern stores ``popxl.graph_input`` tensors
    on ``self`` (for example ``self.W``) and connects them at the call site with
    ``inputs_dict={module.W: W}``.
    """

    def build(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.build is not implemented.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.build(*args, **kwargs)

    def create_graph(self, *args: Any, **kwargs: Any):
        return gir().create_graph(self, *args, **kwargs)
