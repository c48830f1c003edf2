"""The state a ``Module`` with a custom gradient (``build_grad``) carries between its forward
and gradient graphs: ``aux`` (forward tensors the gradient reads), ``var_grad`` (the gradient
of each named variable) and the graphs being built.

Note [aux stitching]
    ``self.aux["x"] = x`` in ``build`` only records the forward tensor. Reading
    ``self.aux["x"]`` in ``build_grad`` makes a grad-graph input of the same spec (once per
    key) and remembers which forward tensor feeds it; ``create_grad_graph`` then makes every
    tensor kept in ``aux`` an output of the forward graph, in the order it was kept (as
    popxl-addons does, forward inputs and unread entries included; every existing call site
    gains the outputs), and connects the read ones as ``Fwd`` inputs in the ``GradGraphInfo``,
    as ``popxl`` autodiff does for the tensors it saves.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import given
from ..ir.tensor import Tensor, graph_input
from .utils import OrderedDict

__all__ = ["Aux", "VarGrads", "build_context", "build_grad_context", "current_build",
           "current_build_grad", "mark_build_grad_graph", "build_grad_module_of"]  # fmt: skip

_BUILD: list[Any] = []
_BUILD_GRAD: list[Any] = []


@contextlib.contextmanager
def build_context(module: Any) -> Iterator[None]:
    """``module.build`` is running for ``create_graph`` (not inlined into another module)."""
    _BUILD.append(module)
    try:
        yield
    finally:
        _BUILD.pop()


@contextlib.contextmanager
def build_grad_context(module: Any) -> Iterator[None]:
    """``module.build_grad`` is running for ``create_grad_graph``."""
    _BUILD_GRAD.append(module)
    try:
        yield
    finally:
        _BUILD_GRAD.pop()


# Graphs made by a module that implements build_grad, with the module's class name: their
# gradient must come from that build_grad (upstream marks them "unsafe to autodiff"
# recursively), so differentiating a caller needs their grad graph in called_graphs_grad_info.
_BUILD_GRAD_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mark_build_grad_graph(graph: Any, module_name: str) -> None:
    _BUILD_GRAD_GRAPHS[graph] = module_name


def build_grad_module_of(graph: Any) -> str | None:
    """The class name of the build_grad module that made ``graph``, or None."""
    return _BUILD_GRAD_GRAPHS.get(graph)


def current_build() -> Any:
    return _BUILD[-1] if _BUILD else None


def current_build_grad() -> Any:
    return _BUILD_GRAD[-1] if _BUILD_GRAD else None


class Aux:
    """Values ``build`` keeps for ``build_grad`` (see Note [aux stitching]); dict-like."""

    def __init__(self) -> None:
        self._dict: OrderedDict = OrderedDict()
        self._grad_to_fwd: OrderedDict = OrderedDict()  # grad-graph input -> forward tensor
        self._key_to_tensor: OrderedDict = OrderedDict()  # key -> grad-graph input

    def __setitem__(self, key: Any, value: Any) -> None:
        self._dict[key] = value

    def __getitem__(self, key: Any) -> Any:
        module = current_build_grad()
        if module is None or module.aux is not self:
            raise RuntimeError(
                f"aux[{key!r}] can only be read inside build_grad, which runs through "
                "Module.create_grad_graph or autodiff (GraphWithNamedArgs.autodiff). In build, "
                "keep the tensor in a local variable instead. (popxl-addons: you can only get "
                "items within the `build_graph` method.)"
            )
        if key not in self._dict:
            raise KeyError(
                f"aux has no entry {key!r}; build stored {list(self._dict)}. Set "
                f"self.aux[{key!r}] = tensor in build."
            )
        value = self._dict[key]
        if not isinstance(value, Tensor):
            return value
        if key not in self._key_to_tensor:
            t = graph_input(value.shape, value.dtype, str(key), meta_shape=value.meta_shape)
            self._key_to_tensor[key] = t
            self._grad_to_fwd[t] = value
        return self._key_to_tensor[key]

    def __contains__(self, key: Any) -> bool:
        return key in self._dict

    def __len__(self) -> int:
        return len(self._dict)

    def keys(self) -> list[Any]:
        return list(self._dict)

    def __repr__(self) -> str:
        return repr(self._dict)

    def copy(self) -> Aux:
        """A shallow copy (the tensors are shared)."""
        new = Aux()
        new._dict = self._dict.copy()
        new._grad_to_fwd = self._grad_to_fwd.copy()
        new._key_to_tensor = self._key_to_tensor.copy()
        return new


class VarGrads:
    """``var_grad[name] = tensor`` in ``build_grad``: the gradient of the forward graph's
    variable ``name`` (a key of the forward graph's ``args``)."""

    def __init__(self, variables: Mapping[str, Tensor] | None = None) -> None:
        self._dict: OrderedDict = OrderedDict()
        self._vars = None if variables is None else dict(variables)

    def _check_context(self) -> None:
        module = current_build_grad()
        if module is None or module.var_grad is not self or self._vars is None:
            raise RuntimeError(
                "var_grad can only be used inside build_grad, which runs through "
                "Module.create_grad_graph or autodiff (GraphWithNamedArgs.autodiff). "
                "(popxl-addons: you can only use `var_grad` within the `build_graph` method.)"
            )

    def __getitem__(self, key: str) -> Tensor:
        self._check_context()
        return self._dict[key]

    def __setitem__(self, key: str, tensor: Tensor) -> None:
        self._check_context()
        if not isinstance(tensor, Tensor):
            raise TypeError(
                f"Not a tensor: var_grad[{key!r}] must be a popxl Tensor; got {given(tensor)}."
            )
        assert self._vars is not None
        if key not in self._vars:
            raise KeyError(
                f"Not a variable: {key!r} is not a variable of the forward graph; its "
                f"variables are {list(self._vars)}."
            )
        var = self._vars[key]
        if tuple(var.shape) != tuple(tensor.shape) or tuple(var.meta_shape) != tuple(
            tensor.meta_shape
        ):
            raise ValueError(
                "Shape or meta-shape of Tensor does not match variable. "
                f"var_grad[{key!r}]: shape {tuple(tensor.shape)} (meta-shape "
                f"{tuple(tensor.meta_shape)}) does not match the variable's shape "
                f"{tuple(var.shape)} (meta-shape {tuple(var.meta_shape)})."
            )
        self._dict[key] = tensor

    def __contains__(self, key: str) -> bool:
        return key in self._dict

    def __repr__(self) -> str:
        return repr(self._dict)


class CalledGraphsGradInfo:
    """``{forward graph: GradGraphInfo}`` of the graphs a module calls with ``call_module``.

    Held by reference: a parent keeps its children's maps (``submaps``) so graphs the children
    create later are seen when the parent's graph is differentiated.
    """

    def __init__(self, mapping: Mapping | None = None) -> None:
        self.map: dict = normalise_grad_info(mapping or {})
        self.submaps: list[CalledGraphsGradInfo] = []

    def add(self, fwd_graph: Any, grad_graph: Any) -> None:
        self.map.update(normalise_grad_info({fwd_graph: grad_graph}))

    def add_submap(self, other: CalledGraphsGradInfo | Mapping) -> None:
        if not isinstance(other, CalledGraphsGradInfo):
            other = CalledGraphsGradInfo(other)
        self.submaps.append(other)

    def consolidate(self) -> dict:
        """One ``{Graph: GradGraphInfo}``; this map's own entries win over the children's."""
        out: dict = {}
        for sub in self.submaps:
            out.update(sub.consolidate())
        out.update(self.map)
        return out

    def clear(self) -> None:
        for sub in self.submaps:
            sub.clear()
        self.map = {}
        self.submaps = []


def normalise_grad_info(mapping: Mapping) -> dict:
    """``{graph-like: grad-info-like}`` as ``{popxl Graph: GradGraphInfo}`` (a
    ``GraphWithNamedArgs`` or ``BoundGraph`` stands for its graph, a grad
    ``GraphWithNamedArgs`` for its ``grad_graph_info``)."""
    out = {}
    for fwd, grad in mapping.items():
        fwd = getattr(fwd, "graph", fwd)
        grad = getattr(grad, "grad_graph_info", grad)
        out[fwd] = grad
    return out
