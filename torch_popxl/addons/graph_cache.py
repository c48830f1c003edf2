"""``GraphCache`` and ``@addons.function``: build a graph once per distinct signature (spec addons §6).

The key hashes the function itself (a module instance by identity unless it defines
``__hash__``), the current ipu and tile set, and every bound argument: tensors and specs by
``(shape, dtype, meta_shape)`` (values and names ignored), graphs by identity, containers
recursively, anything else with ``hash()``. A hit returns the *same* ``popxl.Graph`` object.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from .. import ops
from ..errors import given
from ..ir.context import current_ipu, current_tile_set, gcg
from ..ir.graph import Graph
from ..ir.module import Module
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor, TensorSpec
from .graph import BoundGraph, GraphWithNamedArgs
from .named_tensors import NamedTensors

__all__ = ["GraphCache", "function", "named_tensors_function", "get_function_hash", "argument_hash",
           "bound_arguments", "tensor_hash"]  # fmt: skip


def _spec_key(shape, dtype, meta_shape) -> tuple:
    # An unsharded meta_shape may be () or None; both mean "not sharded".
    return ("spec", tuple(shape), dtype, tuple(meta_shape or ()))


def tensor_hash(t: Tensor | TensorSpec) -> int:
    """The hash of a tensor as a graph-building argument: its shape, dtype and meta_shape."""
    return hash(_spec_key(t.shape, t.dtype, t.meta_shape))


def bound_arguments(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``{parameter: value}`` that calling ``fn(*args, **kwargs)`` binds, defaults included; for
    a bound method or a callable object, ``self`` is the first entry."""
    if inspect.ismethod(fn):
        args, fn = (fn.__self__, *args), fn.__func__
    elif not inspect.isfunction(fn) and callable(fn) and not isinstance(fn, type):
        args, fn = (fn, *args), type(fn).__call__
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def argument_hash(value: Any) -> int:
    """The hash of one graph-building argument (see the module docstring)."""
    return hash(_argument_key(value))


def _argument_key(value: Any) -> Any:
    if isinstance(value, Tensor):
        return _spec_key(value.shape, value.dtype, value.meta_shape)
    if isinstance(value, TensorSpec):
        return _spec_key(value.shape, value.dtype, value.meta_shape)
    if isinstance(value, BoundGraph):
        return (
            "bound",
            id(value.graph),
            tuple(sorted((k.id, v.id) for k, v in value.args.items())),
        )
    if isinstance(value, GraphWithNamedArgs):
        return ("graph", id(value.graph))
    if isinstance(value, Graph):
        return ("graph", id(value))
    if isinstance(value, ReplicaGrouping):  # unhashable in PopXL; its layout identifies it
        return ("rg", value.stride, value.group_size, tuple(value.assignment))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_argument_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _argument_key(v)) for k, v in value.items()))
    try:
        return ("value", hash(value))
    except TypeError:
        return ("id", id(value))


def get_function_hash(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """The cache key of ``fn(*args, **kwargs)`` as an int."""
    return hash(_function_key(fn, args, kwargs))


def _function_key(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    target = fn.build if isinstance(fn, Module) else fn
    try:
        bound = inspect.signature(target).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = tuple((k, _argument_key(v)) for k, v in bound.arguments.items())
    except (TypeError, ValueError):
        arguments = (_argument_key(args), _argument_key(kwargs))
    return (_argument_key(fn), current_ipu(), current_tile_set(), arguments)


class GraphCache:
    """Per-Ir cache of graphs built by ``ir.create_graph``."""

    def __init__(self) -> None:
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def create_graph(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
        """``gcg().ir.create_graph(fn, *args, **kwargs)``, or the cached graph for this key."""
        return self._create_graph_keyed(_function_key(fn, args, kwargs), fn, *args, **kwargs)

    def _create_graph_keyed(
        self, key: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Graph:
        ir = gcg().ir
        per_ir = self._graphs.setdefault(ir, {})
        graph = per_ir.get(key)
        if graph is None:
            graph = ir.create_graph(fn, *args, **kwargs)
            per_ir[key] = graph
        return graph

    def __len__(self) -> int:
        return sum(len(v) for v in self._graphs.values())


_FUNCTION_CACHE = GraphCache()


def function(fn: Callable[..., Any]) -> Callable[..., tuple[Tensor, ...]]:
    """Outline ``fn``: build (or reuse) its graph and call it with the given arguments."""

    @functools.wraps(fn)
    def outlined(*args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        graph = _FUNCTION_CACHE.create_graph(fn, *args, **kwargs)
        bound = inspect.signature(fn).bind(*args, **kwargs)
        return ops.call(graph, *_tensors_in(bound.arguments.values()))

    return outlined


def named_tensors_function(
    fn: Callable[[NamedTensors], NamedTensors],
) -> Callable[[NamedTensors], NamedTensors]:
    """Outline ``fn``, a function of one ``NamedTensors`` that returns a ``NamedTensors`` with the
    same keys (an update applied to each tensor, say): one graph per distinct set of tensor specs,
    called with the tensors in key order."""
    cache = GraphCache()

    @functools.wraps(fn)
    def outlined(named: NamedTensors) -> NamedTensors:
        if not isinstance(named, NamedTensors):
            raise TypeError(
                f"{getattr(fn, '__qualname__', fn)}: a named_tensors_function takes one "
                f"NamedTensors, got {given(named)}."
            )
        keys, tensors = named.unpack()

        def flat(*inner: Tensor) -> tuple[Tensor, ...]:
            result = fn(NamedTensors.pack(keys, inner))
            if not isinstance(result, NamedTensors) or set(result.keys_flat()) != set(keys):
                raise ValueError(
                    f"{getattr(fn, '__qualname__', fn)}: a named_tensors_function must return "
                    f"NamedTensors with the keys it was given ({list(keys)}), got "
                    f"{list(result.keys_flat()) if isinstance(result, NamedTensors) else result!r}."
                )
            out = result.to_dict()
            return tuple(out[k] for k in keys)

        flat.__qualname__ = getattr(fn, "__qualname__", "named_tensors_function")
        # The key is fn with the keys and the tensors' specs: the closure ``flat`` is new per call.
        key = (_argument_key(fn), tuple(keys), _argument_key(tuple(tensors)), current_ipu(),
               current_tile_set())  # fmt: skip
        graph = cache._create_graph_keyed(key, flat, *tensors)
        return NamedTensors.pack(keys, ops.call(graph, *tensors))

    return outlined


def _tensors_in(values) -> list[Tensor | TensorSpec]:
    out: list[Tensor | TensorSpec] = []
    for v in values:
        if isinstance(v, Tensor | TensorSpec):
            out.append(v)
        elif isinstance(v, list | tuple):
            out.extend(_tensors_in(v))
        elif isinstance(v, dict):
            out.extend(_tensors_in(v.values()))
    return out
