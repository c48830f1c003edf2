"""``addons.Module``: stateful layers whose variables are graph inputs (spec addons §4).

``build`` registers variables with ``add_variable_input``: each becomes a graph input of the
graph being built plus a ``VariableFactory``. ``create_graph`` returns the factories and the
graph with its named inputs, then resets the module, so one instance can build many graphs.

Child modules assigned as attributes share their factory / input trees with the parent
(Note [shared sub-trees] in dot_tree.py), and their ``build`` runs inside
``popxl.name_scope(<attribute name>)``: calling ``self.fc1(x)`` inside the parent's build
*inlines* the child, giving inputs like ``fc1/weight`` keyed ``fc1.weight``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..ir.context import gcg, name_scope
from ..ir.module import Module as _PopXLModule
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor
from .graph import BoundGraph, GraphWithNamedArgs
from .graph_cache import GraphCache
from .named_tensors import NamedTensors
from .utils import OrderedDict  # noqa: F401  (popxl-addons re-exports it from here)
from .variable_factory import (
    NamedVariableFactories,
    VariableFactory,
    add_replica_sharded_variable_input,
    add_variable_input,
)

__all__ = [
    "Module",
    "NamedTensors",
    "NamedVariableFactories",
    "VariableFactory",
    "add_variable_input",
    "add_replica_sharded_variable_input",
    "GraphWithNamedArgs",
    "BoundGraph",
    "GraphCache",
]

_GRAD_INLINING = ("error", "warning", "none")


def _scoped(build: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``build`` inside ``name_scope(self._name_scope)`` when the module has one."""

    @functools.wraps(build)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        scope = self.__dict__.get("_name_scope")
        if scope is None:
            return build(self, *args, **kwargs)
        with name_scope(scope):
            return build(self, *args, **kwargs)

    wrapper._addons_scoped = True  # type: ignore[attr-defined]
    return wrapper


def _key(name: Any) -> str:
    if isinstance(name, int) and not isinstance(name, bool):
        if name < 0:
            raise ValueError(
                f"Module names must be non-negative integers or identifiers; got {name}."
            )
        return str(name)
    return str(name)


class Module(_PopXLModule):
    """Base class for layers with variables. Subclass it and implement ``build``.

    ``cache=True`` (or a ``GraphCache``) reuses graphs for equal argument specs.
    """

    # Set through ``__dict__`` by ``__init__`` (``__setattr__`` treats sub-modules specially).
    _variable_factories: NamedVariableFactories
    _named_inputs: NamedTensors
    _graph_cache: GraphCache | None
    _args_cache: dict[Any, Any]
    _name_scope: str | None
    grad_inlining_error: str
    aux: dict[Any, Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        build = cls.__dict__.get("build")
        if build is not None and not getattr(build, "_addons_scoped", False):
            cls.build = _scoped(build)  # type: ignore[method-assign]

    def __init__(self, cache: bool | GraphCache | None = False, grad_inlining_error: str = "error"):
        if grad_inlining_error not in _GRAD_INLINING:
            raise ValueError(
                f"grad_inlining_error must be one of {_GRAD_INLINING}; got {grad_inlining_error!r}."
            )
        if isinstance(cache, GraphCache):
            graph_cache: GraphCache | None = cache
        else:
            graph_cache = GraphCache() if cache else None
        if graph_cache is not None and type(self).__dict__.get("build_grad") is not None:
            raise ValueError(
                f"{type(self).__name__}: cache=True cannot be combined with a custom build_grad."
            )
        d = self.__dict__
        d["_variable_factories"] = NamedVariableFactories()
        d["_named_inputs"] = NamedTensors()
        d["_graph_cache"] = graph_cache
        d["_args_cache"] = {}
        d["_name_scope"] = None
        d["grad_inlining_error"] = grad_inlining_error
        d["aux"] = {}

    # ---- nesting --------------------------------------------------------------------------

    def _check_init(self) -> None:
        if "_variable_factories" not in self.__dict__:
            raise RuntimeError(
                f"{type(self).__name__}.__init__ must call super().__init__() before assigning "
                "sub-modules or registering variables."
            )

    def set_name_scope(self, name: str) -> None:
        self.__dict__["_name_scope"] = name

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Module):
            self._check_init()
            value.set_name_scope(name)
            self._variable_factories.insert(name, value._variable_factories)
            self._named_inputs.insert(name, value._named_inputs)
        super().__setattr__(name, value)

    def get(self, key: Any) -> Any:
        return getattr(self, _key(key))

    def __getitem__(self, key: Any) -> Any:
        return self.get(key)

    def __iter__(self) -> Iterator[Any]:
        i = 0
        while str(i) in self.__dict__:
            yield self.__dict__[str(i)]
            i += 1

    @classmethod
    def from_list(cls, modules: Iterable[Module]) -> Module:
        """A container module with the given children under ``"0"``, ``"1"``, ..."""
        container = Module()
        for i, m in enumerate(modules):
            setattr(container, str(i), m)
        return container

    @classmethod
    def from_variable_factories(cls, factories: Iterable[VariableFactory]) -> Module:
        """A container whose inputs ``"0"``, ``"1"``, ... are created now, in the current graph."""
        container = Module()
        for i, f in enumerate(factories):
            t = container.add_variable_factory(f, str(i))
            object.__setattr__(container, str(i), t)
        return container

    # ---- variable registration ------------------------------------------------------------

    def add_variable_input(self, name: str, data_iter, dtype=None, by_ref: bool = False,
                           replica_grouping: ReplicaGrouping | None = None,
                           overwrite: bool = False) -> Tensor:  # fmt: skip
        """A variable input of the graph being built; its factory is registered under ``name``."""
        self._check_init()
        factory = VariableFactory(data_iter, dtype, name, by_ref, replica_grouping)
        return self._register(name, factory, overwrite)

    def add_replica_sharded_variable_input(self, name: str, data_iter, dtype=None, by_ref: bool = False,
                                           replica_grouping: ReplicaGrouping | None = None,
                                           shard_over: int | None = None,
                                           overwrite: bool = False) -> Tensor:  # fmt: skip
        """A replica-sharded variable input (flat shard, ``meta_shape`` = full shape)."""
        self._check_init()
        rg = replica_grouping if replica_grouping is not None else gcg().ir.replica_grouping()
        shard_over = rg.group_size if shard_over is None else shard_over
        factory = VariableFactory(data_iter, dtype, name, by_ref, rg, shard_over)
        return self._register(name, factory, overwrite)

    def add_variable_factory(self, factory: VariableFactory, name: str | None = None) -> Tensor:
        """A graph input made from an existing factory."""
        self._check_init()
        name = name or factory.name
        if name is None:
            raise ValueError("add_variable_factory: the factory has no name; pass name=.")
        return self._register(name, factory, False)

    def _register(self, name: str, factory: VariableFactory, overwrite: bool) -> Tensor:
        # Register the factory first: a duplicate key fails before the graph gains an input.
        self._variable_factories.insert(name, factory, overwrite)
        t = factory.create_input()
        self._named_inputs.insert(name, t, overwrite)
        return t

    def add_variable_inputs(self, name: Any, factories: NamedVariableFactories,
                            overwrite: bool = False) -> NamedTensors:  # fmt: skip
        """Inputs for every factory of another graph (for outlining); returns them keyed as ``factories``."""
        self._check_init()
        key = _key(name)
        inputs = NamedTensors.from_dict(
            {k: f.create_input() for k, f in factories.to_dict().items()}
        )
        self._variable_factories.insert(key, factories.copy(), overwrite)
        self._named_inputs.insert(key, inputs, overwrite)
        return inputs

    # ---- graph creation -------------------------------------------------------------------

    def create_graph(
        self, *args: Any, **kwargs: Any
    ) -> tuple[NamedVariableFactories, GraphWithNamedArgs]:
        """Build ``build(*args, **kwargs)`` as a subgraph; tensors/specs become graph inputs.

        Returns ``(factories, graph)`` and resets the module's state.
        """
        self._check_init()
        ir = gcg().ir
        try:
            if self._graph_cache is None:
                graph = ir.create_graph(self, *args, **kwargs)
                facts, named = self._variable_factories.copy(), self._named_inputs.copy()
            else:
                graph = self._graph_cache.create_graph(self, *args, **kwargs)
                if graph not in self._args_cache:
                    self._args_cache[graph] = (
                        self._variable_factories.copy(),
                        self._named_inputs.copy(),
                    )
                facts, named = self._args_cache[graph]
            aux = dict(self.aux)
        finally:
            self._reset()
        return facts.copy(), GraphWithNamedArgs(graph, named.copy(), from_module=self, aux=aux)

    def _reset(self) -> None:
        self._variable_factories._clear()
        self._named_inputs._clear()
        self.aux.clear()
