"""``addons.autodiff`` and ``autodiff_with_accumulation`` (spec addons §7).

Both wrap ``popxl.transforms.autodiff``, which *mutates the forward graph*: forward tensors the
backward needs become extra forward outputs, so create forward call sites after autodiff and
use ``outputs[0]`` for the real output.

Note [running-mean accumulation]
    ``autodiff_with_accumulation`` gives the grad graph by-ref accumulator inputs updated with
    ``accum = accum * c/(c+1) + g/(c+1)`` where ``c`` is the ``mean_accum_counter`` before the
    call, then ``c += 1``. After N calls since the counter was last zeroed each accumulator is
    the mean of the N gradients; the first call after a reset overwrites it, so a reset only
    zeroes the counter (``ops.var_updates.accumulator_scale_(counter, 0.0)``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import partial

import numpy as np

from ... import dtypes as _dtypes
from ... import ops
from ...errors import given
from ...ir.context import in_sequence
from ...ir.graph import Graph, OpKind
from ...ir.tensor import Tensor, constant
from ...transforms.autodiff import autodiff as _popxl_autodiff
from ..grad_state import build_grad_module_of, normalise_grad_info
from ..graph import GraphWithNamedArgs
from ..named_replica_grouping import NamedReplicaGrouping
from ..named_tensors import NamedTensors
from ..variable_factory import NamedVariableFactories, VariableFactory

__all__ = ["autodiff", "autodiff_with_accumulation"]


def _as_graph(graph: GraphWithNamedArgs | Graph) -> tuple[Graph, GraphWithNamedArgs | None]:
    if isinstance(graph, GraphWithNamedArgs):
        return graph.graph, graph
    if isinstance(graph, Graph):
        return graph, None
    raise TypeError(f"autodiff expects a GraphWithNamedArgs or a popxl Graph; got {given(graph)}.")


def _merged_grad_info(named: GraphWithNamedArgs | None, given: Mapping | None) -> dict:
    merged = normalise_grad_info(given or {})
    if named is not None:  # the graph's own map (made by call_module) wins, as upstream
        merged.update(normalise_grad_info(named.called_graphs_grad_info))
    return merged


def _check_no_build_grad_callee(graph: Graph, given: Mapping) -> None:
    """Refuse to differentiate through a call of a graph whose module implements build_grad
    when its grad graph is not given: the hand-written gradient would be silently replaced by
    an automatic one (upstream PopXL marks such graphs unsafe to autodiff recursively)."""
    seen: set[int] = set()
    stack = [graph]
    while stack:
        g = stack.pop()
        for op in g._ops:
            if op.kind != OpKind.CALL:
                continue  # repeats carry no gradient path
            callee = op.attrs.graph
            if callee in given or id(callee) in seen:
                continue
            seen.add(id(callee))
            module = build_grad_module_of(callee)
            if module is not None:
                raise ValueError(
                    f"autodiff of {graph.id!r}: the called graph {callee.id!r} is marked as unsafe "
                    f"to autodiff: it was created by {module}, which implements build_grad, and "
                    "its gradient graph was not given. Outline it with `self.call_module(...)` "
                    "(which records its grad graph in the graph's called_graphs_grad_info), or "
                    "pass {forward graph: grad graph} in called_graphs_grad_info."
                )
            stack.append(callee)


def autodiff(graph: GraphWithNamedArgs | Graph, grads_provided: Iterable[Tensor] | None = None,
             grads_required: Iterable[Tensor] | None = None,
             called_graphs_grad_info: Mapping | None = None) -> GraphWithNamedArgs:  # fmt: skip
    """The gradient graph of ``graph``.

    Defaults: gradients for every forward output are provided (in order) and gradients of
    every forward input are required, in graph-input order (tensor arguments first).
    """
    g, named = _as_graph(graph)
    given = _merged_grad_info(named, called_graphs_grad_info)
    _check_no_build_grad_callee(g, given)
    info = _popxl_autodiff(g, grads_provided, grads_required, given)
    if named is not None:
        named.autodiff_applied = True
    return GraphWithNamedArgs.from_grad_graph(info)


def _accum_name(t: Tensor, key_of: Mapping[Tensor, str]) -> str:
    if t in key_of:
        return key_of[t]
    name = re.sub(r"\W", "_", t.name)
    return f"_{name}" if name[:1].isdigit() else name


def autodiff_with_accumulation(graph: GraphWithNamedArgs | Graph, tensors_to_accumulate_grads: Iterable[Tensor],
                               grads_required: Iterable[Tensor] | None = None,
                               called_graphs_grad_info: Mapping | None = None,
                               replica_groupings: NamedReplicaGrouping | None = None, *,
                               grads_provided: Iterable[Tensor] | None = None,
                               ) -> tuple[NamedVariableFactories, GraphWithNamedArgs]:  # fmt: skip
    """Autodiff whose gradients of ``tensors_to_accumulate_grads`` go into running-mean accumulators.

    The positional parameters are popxl-addons 3.4's (``graph, tensors_to_accumulate_grads,
    grads_required, called_graphs_grad_info, replica_groupings``); ``grads_provided`` (default:
    every forward output) is a keyword-only extension.

    Returns the accumulator factories (``mean_accum_counter`` and ``accum.<key>``) and the grad
    graph, whose remaining outputs are the gradients of ``grads_required`` (default: none).
    See Note [running-mean accumulation].
    """
    g, named = _as_graph(graph)
    accumulate = list(tensors_to_accumulate_grads)
    plain = list(grads_required or [])
    given = _merged_grad_info(named, called_graphs_grad_info)
    _check_no_build_grad_callee(g, given)
    info = _popxl_autodiff(g, grads_provided, plain + accumulate, given)
    if named is not None:
        named.autodiff_applied = True
    grad_graph = info.graph
    outputs = list(grad_graph.outputs)
    assert len(outputs) == len(plain) + len(accumulate), (
        "autodiff must give one output per required tensor"
    )
    key_of = {t: k for k, t in named.args.to_dict().items()} if named is not None else {}

    facts: dict[str, VariableFactory] = {}
    inputs: dict[str, Tensor] = {}
    with grad_graph, in_sequence(True):
        counter_f = VariableFactory(
            partial(np.zeros, ()), _dtypes.float32, "mean_accum_counter", by_ref=True
        )
        counter = counter_f.create_input()
        facts["mean_accum_counter"], inputs["mean_accum_counter"] = counter_f, counter
        for t, grad in zip(accumulate, outputs[len(plain) :], strict=True):
            name = _accum_name(t, key_of)
            key = f"accum.{name}"
            if key in facts:
                raise ValueError(
                    f"autodiff_with_accumulation: {t.id!r} is accumulated twice (key {key!r})."
                )
            f = _accumulator_factory(t, key, _grouping(replica_groupings, name))
            accum = f.create_input()
            facts[key], inputs[key] = f, accum
            ops.var_updates.accumulate_mean_(accum, grad, counter)
        ops.var_updates.accumulate_(counter, constant(1.0, _dtypes.float32, "one"))
    grad_graph._outputs[:] = outputs[: len(plain)]
    grad_graph._version += 1
    named_facts = NamedVariableFactories.from_dict(facts)
    return named_facts, GraphWithNamedArgs(grad_graph, NamedTensors.from_dict(inputs), info)


def _grouping(groupings: NamedReplicaGrouping | None, key: str):
    if groupings is None or key not in groupings:
        return None
    return groupings.get(key)


def _accumulator_factory(t: Tensor, key: str, rg) -> VariableFactory:
    if t.meta_shape:  # a sharded forward input gets a sharded accumulator of the same layout
        shard_over = int(np.prod(t.meta_shape)) // int(np.prod(t.shape))
        return VariableFactory(partial(np.zeros, t.meta_shape), t.dtype, key, True, rg, shard_over)
    return VariableFactory(
        partial(np.zeros, t.shape), t.dtype, key, by_ref=True, replica_grouping=rg
    )


# ---- GraphWithNamedArgs.autodiff ----------------------------------------------------------
# Installed from here because the graph module sits below the transforms (Note [tensor methods
# are installed from above] in torch_popxl/tensor_methods.py: the same pattern).


def _graph_autodiff(self: GraphWithNamedArgs, grads_provided: Iterable[Tensor] | None = None,
             grads_required: Iterable[Tensor] | None = None,
             called_graphs_grad_info: Mapping | None = None, method: str = "auto",
             force: bool = False) -> GraphWithNamedArgs:  # fmt: skip
    """The gradient graph of this graph.

    ``method``: "build_grad" uses the ``build_grad`` of the module that created the graph
    (``Module.create_grad_graph``); "autodiff" differentiates the ops (``addons.autodiff``,
    using ``called_graphs_grad_info`` and the graph's own for the graphs it calls); "auto"
    picks "build_grad" when the module implements it. Both add forward outputs, so a second
    differentiation of one graph needs ``force=True``.
    """
    if method not in ("auto", "autodiff", "build_grad"):
        raise ValueError(f"method must be 'auto', 'autodiff' or 'build_grad'; got {method!r}.")
    if self.autodiff_applied and not force:
        raise ValueError(
            f"Autodiff has already been applied: {self.graph.id!r} has already been "
            "differentiated; autodiff appends forward outputs, so a second pass needs force=True."
        )
    module = self.from_module
    if method in ("auto", "build_grad"):
        if module is not None and module.implements_grad_graph:
            grad = module.create_grad_graph(self, grads_provided, grads_required)
            self.autodiff_applied = True
            return grad
        if method == "build_grad" and module is None:
            raise ValueError(
                f"method='build_grad' can only be used if `from_module` is specified: "
                f"{self.graph.id!r} was wrapped in a GraphWithNamedArgs without it (the one "
                "Module.create_graph returns has it). Use method='autodiff'."
            )
        if method == "build_grad":
            raise ValueError(
                f"method='build_grad' needs a graph created by a module that implements "
                f"build_grad; {self.graph.id!r} was created by {type(module).__name__}, which "
                "does not. Use method='autodiff'."
            )
    return autodiff(self, grads_provided, grads_required, called_graphs_grad_info)


GraphWithNamedArgs.autodiff = _graph_autodiff  # type: ignore[attr-defined]
