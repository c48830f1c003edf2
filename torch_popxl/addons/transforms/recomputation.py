"""``addons.recompute_graph``: recompute forward activations inside the backward (issue 16).

Note [recomputation]
    A grad graph normally takes the activations it needs from the forward call site, so they
    stay alive in the caller from the forward pass until the backward pass. ``recompute_graph``
    returns a new graph (one more graph in the Ir) that instead takes the *forward graph's
    inputs*, calls the forward graph again and feeds the fresh activations to the original grad
    graph, which it calls next. Only the forward inputs must then stay alive between the passes;
    the activations live only while one layer's backward runs. The numbers are unchanged.

    The new graph's inputs, in order: the gradient seeds of the original (``FwdGrad``) and every
    forward input the original grad graph named as an expected input, in the original order;
    then the forward inputs it did not name, sorted by name; then the original graph's inputs
    that have no forward counterpart (accumulators, counters), sorted by name and by reference
    where the original takes them by reference. Its ``grad_graph_info`` lists the first two groups
    as expected inputs, so ``grad_graph_info.inputs_dict(fwd_call_info)`` binds the forward
    inputs from the forward call site exactly as it bound activations before; its named args
    are the original's, remapped to the new inputs.
"""

from __future__ import annotations

from ...ir.graph import Graph
from ...ir.tensor import Tensor, graph_input, graph_output
from ...transforms.autodiff import ExpectedConnection, ExpectedConnectionType, GradGraphInfo
from ..graph import BoundGraph, GraphWithNamedArgs

__all__ = ["recompute_graph"]


def _input_like(t: Tensor, by_ref: bool = False) -> Tensor:
    return graph_input(t.shape, t.dtype, t.name, by_ref, t.meta_shape)


def recompute_graph(grad_graph: GraphWithNamedArgs) -> GraphWithNamedArgs:
    """A gradient graph that recomputes its forward activations (Note [recomputation]).

    ``grad_graph`` must come from ``addons.autodiff`` / ``autodiff_with_accumulation`` (it needs
    ``grad_graph_info``). Call the result exactly as the original: seeds positionally and
    ``args=result.grad_graph_info.inputs_dict(fwd_call_info)``; bind its ``args`` as before.
    """
    if not isinstance(grad_graph, GraphWithNamedArgs):
        raise TypeError(
            "recompute_graph expects the GraphWithNamedArgs returned by addons.autodiff; got "
            f"{type(grad_graph).__name__}."
        )
    try:
        info = grad_graph.grad_graph_info
    except AttributeError:
        raise ValueError(
            f"recompute_graph: {grad_graph.graph.id!r} is not a gradient graph (no "
            "grad_graph_info). Pass the graph returned by addons.autodiff."
        ) from None
    original: Graph = grad_graph.graph
    fwd: Graph = info.forward_graph
    ir = original.ir
    r_graph = ir.create_empty_graph(f"{original.name}_recomp")

    expected = info.expected_inputs
    n_expected = len(expected)
    with r_graph:
        fwd_inputs: dict[Tensor, Tensor] = {}  # forward graph input -> new input
        grad_inputs: dict[Tensor, Tensor] = {}  # original grad input -> new-graph tensor
        new_expected: list[ExpectedConnection] = []
        for gt, ec in zip(original.inputs[:n_expected], expected, strict=True):
            if ec.connection_type is ExpectedConnectionType.FwdGrad:
                grad_inputs[gt] = _input_like(gt)
                new_expected.append(ec)
            elif ec.fwd_tensor in fwd.inputs and ec.fwd_tensor not in fwd_inputs:
                fwd_inputs[ec.fwd_tensor] = _input_like(ec.fwd_tensor)
                new_expected.append(ec)
        for t in sorted(set(fwd.inputs) - set(fwd_inputs), key=lambda t: t.name):
            fwd_inputs[t] = _input_like(t)
            new_expected.append(ExpectedConnection(t, ExpectedConnectionType.Fwd))

        # The forward call: its outputs include every activation autodiff appended.
        fwd_info = BoundGraph(fwd, fwd_inputs).call_with_info()
        grad_inputs.update(info.inputs_dict(fwd_info))

        extra = [t for t in original.inputs if t not in grad_inputs]
        for t in sorted(extra, key=lambda t: t.name):
            grad_inputs[t] = _input_like(t, by_ref=original.is_input_by_ref(t))

        outputs = BoundGraph(original, grad_inputs).call()
        for out in outputs:
            graph_output(out)

    r_info = GradGraphInfo._create(r_graph, fwd, new_expected, info.expected_outputs)
    return GraphWithNamedArgs(r_graph, grad_graph.args.remap(grad_inputs), r_info)
