"""``repeat_graph``: wrap a graph's ops in a loop (popxl-addons' ``transforms.repeat_graph``).

Note [repeat_graph]
    Every op of ``graph``'s program (the main graph: the ops that ``Session.run`` executes; not
    the weights-to/from-host ones) moves, in its order, into a new graph, which ``graph`` then
    repeats ``repeat_count`` times. Any tensor an op reads that the moved ops do not produce (a
    variable, a constant, an input of ``graph``) stays in ``graph`` and becomes a by-reference
    input of the new graph, so in-place updates of variables carry from one iteration to the
    next. Op order is kept, which is what PopXL's topological constraints transfer gives.
    Host streams read or written by the moved ops run once per iteration, so set
    ``ir.num_host_transfers`` to the repeat count.
"""

from __future__ import annotations

from dataclasses import replace

from ...errors import given
from ...ir.context import in_sequence
from ...ir.graph import Graph, Op
from ...ir.tensor import Tensor, _fake_like, graph_input
from ...ops.call import repeat_with_info

__all__ = ["repeat_graph"]


def repeat_graph(graph: Graph, repeat_count: int) -> Graph:
    """Move ``graph``'s ops into a new graph called ``repeat_count`` times; returns the new graph.

    ``graph`` is changed in place and may be the main graph. With ``repeat_count <= 1`` nothing
    changes and ``graph`` itself is returned (as in popxl-addons). See Note [repeat_graph].
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"repeat_graph expects a popxl Graph; got {given(graph)}.")
    if isinstance(repeat_count, bool) or not isinstance(repeat_count, int):
        raise TypeError(f"repeat_count must be an int; got {repeat_count!r}.")
    if repeat_count <= 1:
        return graph
    if graph._outputs:
        raise ValueError(
            f"repeat_graph: {graph.id!r} has outputs ({len(graph._outputs)}); a repeated graph "
            "gives its caller nothing back, so only a graph without outputs (such as the main "
            "graph) can be wrapped. Store results with host_store or remote_store instead."
        )
    ir = graph.ir
    moved = [op for op in graph._ops if op.context == "normal"]
    loop = ir.create_empty_graph("repeat_graph")
    new_of: dict[Tensor, Tensor] = {}
    outer_of: dict[Tensor, Tensor] = {}  # loop input -> the tensor of ``graph`` it stands for
    cloned: list[Op] = []
    with loop:
        for op in moved:
            ins = []
            for t in op.inputs:
                if t not in new_of:
                    new = graph_input(t.shape, t.dtype, t.name, True, t.meta_shape)
                    new_of[t], outer_of[new] = new, t
                ins.append(new_of[t])
            outs = []
            for t in op.outputs:
                if t in new_of:  # an in-place op's output is its (already mapped) input
                    outs.append(new_of[t])
                    continue
                new = Tensor._create(loop, t.name, _fake_like(t.shape, t.dtype), t.meta_shape)
                new._ipu, new._tile_set = t._ipu, t._tile_set
                new_of[t] = new
                outs.append(new)
            cloned.append(replace(op, inputs=tuple(ins), outputs=tuple(outs)))
    for op in cloned:
        loop._append_op(op)

    # All-or-nothing: ``graph`` changes only once the loop graph is complete.
    kept = [op for op in graph._ops if op.context != "normal"]
    graph._ops[:] = kept
    graph._version += 1
    with graph, in_sequence(True):
        repeat_with_info(loop, repeat_count, inputs_dict=outer_of)
    return loop
