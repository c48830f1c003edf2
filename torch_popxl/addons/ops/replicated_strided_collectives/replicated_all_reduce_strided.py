"""All-reduces over any constant-stride replica grouping, with the TP gradient modes."""

from __future__ import annotations

from ....ir.context import gcg, in_sequence
from ....ir.replica_grouping import ReplicaGrouping
from ....ir.tensor import Tensor, graph_input, graph_output
from ....opdefs.all_reduce_tp import replicated_all_reduce_TP
from ...graph import GraphWithNamedArgs
from ...named_tensors import NamedTensors

__all__ = [
    "replicated_all_reduce_strided",
    "replicated_all_reduce_strided_identical_inputs",
    "replicated_all_reduce_strided_identical_grad_inputs",
    "replicated_all_reduce_strided_graph",
]


def replicated_all_reduce_strided(
    t: Tensor, op: str = "add", group: ReplicaGrouping | None = None
) -> Tensor:
    """All-reduce over ``group`` (all replicas when None); differentiable (gradient: all-reduce)."""
    return replicated_all_reduce_TP(t, op, group, mode="plain")


def replicated_all_reduce_strided_identical_inputs(t: Tensor, op: str = "add",
                                                   group: ReplicaGrouping | None = None) -> Tensor:  # fmt: skip
    """Identity forward, all-reduce gradient (inputs identical across ``group``)."""
    return replicated_all_reduce_TP(t, op, group, mode="identical_inputs")


def replicated_all_reduce_strided_identical_grad_inputs(t: Tensor, op: str = "add",
                                                        group: ReplicaGrouping | None = None) -> Tensor:  # fmt: skip
    """All-reduce forward, identity gradient (gradients identical across ``group``)."""
    return replicated_all_reduce_TP(t, op, group, mode="identical_grad_inputs")


def replicated_all_reduce_strided_graph(tensors: NamedTensors, op: str = "add",
                                        group: ReplicaGrouping | None = None,
                                        use_io_tiles: bool = False) -> tuple[GraphWithNamedArgs, list[str]]:  # fmt: skip
    """A graph with one named input per tensor of ``tensors`` that returns each all-reduced over
    ``group``; also the output names (sorted keys, as ``NamedTensors.unpack``). Call it as
    ``NamedTensors.pack(names, graph.bind(ts).call())``. ``use_io_tiles`` is accepted and has no
    effect on values."""
    ir = gcg().ir
    graph = ir.create_empty_graph("replica_reduce")
    names, args = [], {}
    with graph, in_sequence(False):
        for name, t in zip(*tensors.unpack(), strict=True):
            sg = graph_input(t.shape, t.dtype, t.name, meta_shape=t.meta_shape)
            args[name] = sg
            names.append(name)
            graph_output(replicated_all_reduce_strided(sg, op, group))
    return GraphWithNamedArgs(graph, NamedTensors.from_dict(args)), names
