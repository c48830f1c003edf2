"""``addons.Module``: stateful layers whose variables are graph inputs (spec addons §4).

``build`` registers variables with ``add_variable_input``: each becomes a graph input of the
graph being built plus a ``VariableFactory``. ``create_graph`` returns the factories and the
graph with its named inputs, then resets the module, so one instance can build many graphs.

Child modules assigned as attributes share their factory / input trees with the parent
(Note [shared sub-trees] in dot_tree.py), and their ``build`` runs inside
``popxl.name_scope(<attribute name>)``: calling ``self.fc1(x)`` inside the parent's build
*inlines* the child, giving inputs like ``fc1/weight`` keyed ``fc1.weight``.

A module may define its own gradient: ``build_grad(self, *output_grads)`` builds the gradient
graph from the gradients of ``build``'s outputs, reads forward tensors kept in ``self.aux``,
sets ``self.var_grad[name]`` for each variable and returns the gradients of the non-variable
inputs (Note [aux stitching] in grad_state.py). ``create_grad_graph`` (or
``GraphWithNamedArgs.autodiff``) builds it; ``call_module`` outlines a child inside a parent's
build and registers the child's gradient graph so that differentiating the parent uses it.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..errors import given
from ..ir.context import gcg, name_scope
from ..ir.graph import Graph
from ..ir.module import Module as _PopXLModule
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor, graph_output
from ..transforms.autodiff import (
    ExpectedConnection,
    ExpectedConnectionType,
    GradGraphInfo,
    _stitch_output,
)
from .grad_state import (
    Aux,
    CalledGraphsGradInfo,
    VarGrads,
    build_context,
    build_grad_context,
    current_build,
    mark_build_grad_graph,
)
from .graph import BoundGraph, GraphWithNamedArgs
from .graph_cache import GraphCache, _tensors_in
from .named_tensors import NamedTensors
from .utils import OrderedDict  # popxl-addons re-exports it from here
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
    "create_grad_graph_info",
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
    aux: Aux
    var_grad: VarGrads
    called_graphs_grad_info: CalledGraphsGradInfo

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        build = cls.__dict__.get("build")
        if build is not None and not getattr(build, "_addons_scoped", False):
            cls.build = _scoped(build)  # type: ignore[method-assign]

    def __init__(self, cache: bool | GraphCache | None = False, grad_inlining_error: str = "error"):
        if grad_inlining_error not in _GRAD_INLINING:
            raise ValueError(
                f"grad_inlining_error should be one of 'error', 'warning', 'none'; got "
                f"{grad_inlining_error!r}."
            )
        if isinstance(cache, GraphCache):
            graph_cache: GraphCache | None = cache
        else:
            graph_cache = GraphCache() if cache else None
        if graph_cache is not None and self.implements_grad_graph:
            raise ValueError(
                "You cannot use graph caching if you have implemented `build_grad`. "
                f"{type(self).__name__}: graph caching (cache=True) cannot be used with a module "
                "that implements build_grad: each forward graph needs its own gradient graph. "
                "Create it with cache=False."
            )
        d = self.__dict__
        d["_variable_factories"] = NamedVariableFactories()
        d["_named_inputs"] = NamedTensors()
        d["_graph_cache"] = graph_cache
        d["_args_cache"] = {}
        d["_name_scope"] = None
        d["grad_inlining_error"] = grad_inlining_error
        d["aux"] = Aux()
        d["var_grad"] = VarGrads()
        d["called_graphs_grad_info"] = CalledGraphsGradInfo()

    # ---- custom gradients -----------------------------------------------------------------

    @property
    def implements_grad_graph(self) -> bool:
        """Whether this module's class overrides ``build_grad``."""
        return type(self).build_grad is not Module.build_grad

    def build_grad(self, *args: Any) -> Any:
        """Override to define the gradient graph: takes the gradients of ``build``'s outputs (in
        order), returns the gradients of its non-variable inputs (in order) and sets
        ``self.var_grad[name]`` per variable; forward tensors come from ``self.aux``."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement build_grad, which create_grad_graph needs. "
            "Override build_grad, or differentiate the graph with addons.autodiff."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Inlining a module into another's build bypasses its build_grad: autodiff of the
        # parent would differentiate the inlined ops instead (upstream's guard rail).
        if self.implements_grad_graph and current_build() is not self:
            msg = (
                f"{type(self).__name__} is called directly (inlined) but `build_grad` has been "
                "implemented, which autodiff then cannot use. Outline it instead: "
                "`self.call_module(module)(*args)`, or create its graph and call that. To allow "
                "inlining set grad_inlining_error='none' (or 'warning')."
            )
            if self.grad_inlining_error == "error":
                raise RuntimeError(msg)
            if self.grad_inlining_error == "warning":
                warnings.warn(msg, stacklevel=2)
        return super().__call__(*args, **kwargs)

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
            self.called_graphs_grad_info.add_submap(value.called_graphs_grad_info)
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

        Returns ``(factories, graph)`` and resets the module's state. With ``cache=True`` an
        equal argument signature returns the same graph (and copies of the same factories).
        """
        self._check_init()
        ir = gcg().ir
        try:
            if self._graph_cache is None:
                self.__dict__["aux"] = Aux()
                with build_context(self):
                    graph = ir.create_graph(self, *args, **kwargs)
                if self.implements_grad_graph:
                    mark_build_grad_graph(graph, type(self).__name__)
                facts, named = self._variable_factories.copy(), self._named_inputs.copy()
            else:
                with build_context(self):
                    graph = self._graph_cache.create_graph(self, *args, **kwargs)
                if graph not in self._args_cache:
                    self._args_cache[graph] = (
                        self._variable_factories.copy(),
                        self._named_inputs.copy(),
                    )
                facts, named = self._args_cache[graph]
            aux = self.aux.copy()
            called = self.called_graphs_grad_info.consolidate()
        finally:
            self._reset()
        return facts.copy(), GraphWithNamedArgs(
            graph, named.copy(), from_module=self, aux=aux, called_graphs_grad_info=called
        )

    def _reset(self) -> None:
        # clear() empties the shared sub-trees / sub-maps of child modules as well.
        self._variable_factories._clear()
        self._named_inputs._clear()
        self.called_graphs_grad_info.clear()
        self.__dict__["aux"] = Aux()
        self.__dict__["var_grad"] = VarGrads()

    def create_grad_graph(self, fwd_graph: GraphWithNamedArgs,
                          grads_provided: Iterable[Tensor] | None = None,
                          grads_required: Iterable[Tensor] | None = None) -> GraphWithNamedArgs:  # fmt: skip
        """The gradient graph ``build_grad`` defines for ``fwd_graph`` (made by this module).

        ``grads_provided`` (default: every forward output, in order) are the outputs whose
        gradients ``build_grad`` takes, one positional argument each. ``grads_required``
        (default: every forward input) are the inputs whose gradients the graph outputs:
        ``build_grad``'s return values for the non-variable ones (in order), then
        ``var_grad[name]`` for the variables. The forward tensors read through ``self.aux``
        become outputs of ``fwd_graph`` (existing call sites gain them), so do not call this
        twice for one forward graph. Returns the grad graph with its ``grad_graph_info``.

        Raises:
            TypeError: ``build_grad`` takes ``*args`` / keyword-only parameters, or a
                ``grads_provided`` / ``grads_required`` entry is not a forward output / input.
            ValueError: duplicate entries; a required variable gradient is missing from
                ``var_grad``; ``build_grad`` returns the wrong number or shapes of gradients.
        """
        if not self.implements_grad_graph:
            raise NotImplementedError(
                f"{type(self).__name__}.create_grad_graph needs build_grad to be overridden; use "
                "addons.autodiff for an automatic gradient."
            )
        if not isinstance(fwd_graph, GraphWithNamedArgs):
            raise TypeError(
                "create_grad_graph expects the GraphWithNamedArgs returned by create_graph; got "
                f"{type(fwd_graph).__name__}."
            )
        graph = fwd_graph.graph
        provided, required = _check_grad_args(self, graph, grads_provided, grads_required)
        var_names = {t: k for k, t in fwd_graph.args.to_dict().items()}
        required_vars = OrderedDict((var_names[t], t) for t in required if t in var_names)
        required_plain = [t for t in required if t not in var_names]

        ir = graph.ir
        d = self.__dict__
        d["var_grad"] = VarGrads(fwd_graph.args.to_dict())
        d["aux"] = fwd_graph.aux.copy()
        try:
            with build_grad_context(self):
                grad_graph = ir.create_graph(self.build_grad, *provided)
            _check_grad_outputs(self, grad_graph, required_plain, required_vars)
            with grad_graph:
                for name in required_vars:
                    graph_output(self.var_grad._dict[name])
            aux = self.aux
        finally:
            self._reset()

        # Note [aux stitching]: as upstream, every tensor build kept in aux becomes a forward
        # output, in the order it was kept (graph inputs included, read or not).
        for value in aux._dict.values():
            if isinstance(value, Tensor):
                _stitch_output(graph, value)
        return GraphWithNamedArgs.from_grad_graph(
            create_grad_graph_info(
                graph,
                grad_graph,
                provided,
                aux._grad_to_fwd,
                [*required_plain, *required_vars.values()],
            )  # fmt: skip
        )

    def call_module(self, module: Module, name: str | None = None,
                    autodiff: str = "auto") -> _CallModule:  # fmt: skip
        """Outline ``module`` inside this module's ``build``: ``self.call_module(child)(x)``
        builds the child's graph, adds its variables under ``name`` (default: the child's class
        name), calls it and returns its outputs.

        ``autodiff``: "auto" creates the child's gradient graph now if it implements
        ``build_grad`` (so differentiating this module's graph uses it); "build_grad" or
        "autodiff" force that method; "none" creates none (autodiff of the parent then
        differentiates through the call).
        """
        if autodiff not in ("auto", "build_grad", "autodiff", "none"):
            raise ValueError(
                f"call_module: autodiff must be 'auto', 'build_grad', 'autodiff' or 'none'; got "
                f"{autodiff!r}."
            )
        if not isinstance(module, Module):
            raise TypeError(f"call_module expects an addons.Module; got {given(module)}.")
        return _CallModule(self, module, name or type(module).__name__, autodiff)


class _CallModule:
    """The callable ``Module.call_module`` returns (kept for reuse: ``graph``, ``var_factories``)."""

    def __init__(self, caller: Module, callee: Module, name: str, autodiff: str,
                 grads_provided: Iterable[Tensor] | None = None,
                 grads_required: Iterable[Tensor] | None = None):  # fmt: skip
        self.caller, self.callee, self.name, self.autodiff = caller, callee, name, autodiff
        self.grads_provided, self.grads_required = grads_provided, grads_required

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        facts, graph = self.callee.create_graph(*args, **kwargs)
        graph_vars = self.caller.add_variable_inputs(self.name, facts)
        self.caller.called_graphs_grad_info.add_submap(graph.called_graphs_grad_info)
        n_outputs = len(graph.graph.outputs)
        if self.autodiff != "none" and (
            self.autodiff != "auto" or self.callee.implements_grad_graph
        ):
            # Before the call site: the gradient may add forward outputs (aux, saved tensors).
            # GraphWithNamedArgs.autodiff is installed by addons/transforms/autodiff.py.
            grad = graph.autodiff(method=self.autodiff, grads_provided=self.grads_provided,  # type: ignore[attr-defined]
                                  grads_required=self.grads_required)  # fmt: skip
            self.caller.called_graphs_grad_info.add(graph, grad)
        # The graph's tensor inputs come first, in the order create_graph made them.
        bound = inspect.signature(self.callee.build).bind(*args, **kwargs)
        outs = graph.bind(graph_vars).call(*_tensors_in(bound.arguments.values()))
        self.var_factories, self.graph, self.n_outputs_pre_autodiff = facts, graph, n_outputs
        return outs[:n_outputs]


def _check_grad_args(module: Module, graph: Graph, grads_provided, grads_required):
    params = inspect.signature(module.build_grad).parameters.values()
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            raise TypeError(
                "The `build_grad` method signature must only have a fixed number of positional "
                "parameters as inputs. "
                f"{type(module).__name__}.build_grad must take a fixed number of positional "
                f"parameters (one gradient per provided output); {p.name!r} is {p.kind.description}."
            )

    def check(entries, pool, what, kind):
        if entries is None:
            return list(pool)
        entries = list(entries)
        for t in entries:
            # ValueError for both, as upstream's _create_grad_graph_pre_validation.
            if not isinstance(t, Tensor):
                raise ValueError(
                    f"create_grad_graph: {what} entries must be Tensors of {graph.id!r}; got "
                    f"{given(t)}."
                )
            if t not in pool:
                # Upstream's wording ("a input") first: programs match on it.
                raise ValueError(
                    f"A Tensor specified in `{what}` is not a {kind} of `fwd_graph`. "
                    f"create_grad_graph: {what} entry {t.id!r} is not an {kind} of "
                    f"{graph.id!r} ({[p.id for p in pool]})."
                )
        dups = sorted({t.id for t in entries if entries.count(t) > 1})
        if dups:
            raise ValueError(f"create_grad_graph: {what} lists {dups} more than once.")
        return entries

    provided = check(grads_provided, graph.outputs, "grads_provided", "output")
    required = check(grads_required, graph.inputs, "grads_required", "input")
    return provided, required


def _check_grad_outputs(module: Module, grad_graph: Graph, required_plain, required_vars) -> None:
    name = type(module).__name__
    missing = [k for k in required_vars if k not in module.var_grad]
    if missing:
        raise ValueError(
            "Not all variable gradients have been specified in self.var_grad. "
            f"{name}.build_grad did not set the gradients of the variables {missing} in "
            "self.var_grad. Set them, or pass grads_required without those variables."
        )
    outs = grad_graph.outputs
    if len(outs) != len(required_plain):
        upstream = (
            "Too many outputs in the grad graph. "
            if len(outs) > len(required_plain)
            else "Not all forward graph inputs have been specified as outputs in the grad graph. "
        )
        raise ValueError(
            f"{upstream}{name}.build_grad returned {len(outs)} gradients, but {len(required_plain)} are "
            f"required, one per non-variable forward input in grads_required "
            f"({[t.id for t in required_plain]}). Return them in that order (variable gradients "
            "go in self.var_grad), or pass grads_required."
        )
    for i, (g, t) in enumerate(zip(outs, required_plain, strict=True)):
        if tuple(g.shape) != tuple(t.shape) or tuple(g.meta_shape) != tuple(t.meta_shape):
            raise ValueError(
                f"Shape or meta-shape of output Tensor at position {i} does not match the "
                f"`grad_required` at position {i}. {name}.build_grad output {i} has shape {tuple(g.shape)} (meta-shape "
                f"{tuple(g.meta_shape)}), but the input it is the gradient of, {t.id!r}, has shape "
                f"{tuple(t.shape)} (meta-shape {tuple(t.meta_shape)})."
            )


def create_grad_graph_info(fwd_graph: Graph, grad_graph: Graph, grads_provided: Iterable[Tensor],
                           aux_inputs: Mapping[Tensor, Tensor],
                           grads_required: Iterable[Tensor]) -> GradGraphInfo:  # fmt: skip
    """The ``GradGraphInfo`` of a hand-built gradient graph: its inputs are the gradients of
    ``grads_provided`` (forward outputs) then the ``aux_inputs`` ({grad input: forward
    tensor}); its outputs the gradients of ``grads_required`` (forward inputs), in order."""
    expected_in = [ExpectedConnection(t, ExpectedConnectionType.FwdGrad) for t in grads_provided]
    expected_in += [ExpectedConnection(t, ExpectedConnectionType.Fwd) for t in aux_inputs.values()]
    expected_out = [ExpectedConnection(t, ExpectedConnectionType.FwdGrad) for t in grads_required]
    if len(expected_in) != len(grad_graph.inputs) or len(expected_out) != len(grad_graph.outputs):
        raise ValueError(
            f"create_grad_graph_info: {grad_graph.id!r} has {len(grad_graph.inputs)} inputs and "
            f"{len(grad_graph.outputs)} outputs, but {len(expected_in)} inputs and "
            f"{len(expected_out)} outputs are described."
        )
    return GradGraphInfo._create(grad_graph, fwd_graph, expected_in, expected_out)
