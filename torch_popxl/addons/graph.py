"""``GraphWithNamedArgs`` and ``BoundGraph`` (spec addons §5).

A module graph's variable inputs are named (``graph.args.fc1.weight``); ``bind`` pairs them
with tensors of the calling graph by key, and ``call`` connects the remaining inputs
positionally: tensor arguments come first in a module graph, gradient seeds first in a grad
graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .. import opdefs, ops
from ..errors import given
from ..ir.attrs import CallSite
from ..ir.graph import Graph, Op, OpKind
from ..ir.tensor import Tensor
from ..ops.call import CallSiteInfo, _flatten
from .grad_state import Aux
from .named_tensors import NamedTensors

if TYPE_CHECKING:
    from ..transforms.autodiff import GradGraphInfo

__all__ = ["GraphWithNamedArgs", "BoundGraph"]

TensorMap = Mapping[Tensor, Tensor]


class BoundGraph:
    """A graph plus a partial ``{graph input: caller tensor}`` binding."""

    def __init__(self, graph: Graph, args: TensorMap | None = None):
        if not isinstance(graph, Graph):
            raise TypeError(f"BoundGraph expects a popxl Graph; got {given(graph)}.")
        self.graph = graph
        self.args: dict[Tensor, Tensor] = dict(args or {})

    def bind(self, args: TensorMap | None = None) -> BoundGraph:
        """A new BoundGraph with ``args`` merged in (new entries win)."""
        return BoundGraph(self.graph, {**self.args, **dict(args or {})})

    def _inputs(
        self, targs: tuple[Any, ...], args: TensorMap | None
    ) -> tuple[list[Any], dict[Tensor, Any]]:
        positional = _flatten(targs)
        inputs = {**self.args, **dict(args or {})}
        for i, _ in enumerate(positional[: len(self.graph.inputs)]):
            gt = self.graph.inputs[i]
            if gt in inputs:
                raise ValueError(
                    f"Input {gt.id!r} of {self.graph.id!r} is given twice: positionally (argument "
                    f"{i}) and by binding/args. Positional arguments connect the first graph inputs."
                )
        return positional, inputs

    def call(self, *targs: Any, args: TensorMap | None = None) -> tuple[Tensor, ...]:
        """Call the graph; positional ``targs`` connect graph inputs 0..k-1."""
        return self.call_with_info(*targs, args=args).outputs

    def call_with_info(self, *targs: Any, args: TensorMap | None = None) -> CallSiteInfo:
        positional, inputs = self._inputs(targs, args)
        return ops.call_with_info(self.graph, *positional, inputs_dict=inputs)

    def subgraph_io_map(self, *targs: Any, args: TensorMap | None = None,
                        outs: Iterable[Tensor] | None = None) -> dict[Tensor, Tensor]:  # fmt: skip
        """``{graph input: caller input}`` (and ``{graph output: call output}`` for ``outs``)."""
        positional, inputs = self._inputs(targs, args)
        mapping = dict(zip(self.graph.inputs, positional, strict=True))
        mapping.update(inputs)
        if outs is not None:
            mapping.update(zip(self.graph.outputs, outs, strict=True))
        return mapping

    def print_schedule(self) -> str:
        return print_schedule(self.graph, {})

    def __repr__(self) -> str:
        return f"BoundGraph({self.graph.id}, {len(self.args)} bound inputs)"


class GraphWithNamedArgs:
    """A graph whose variable inputs are named by a ``NamedTensors`` tree (``.args``)."""

    def __init__(self, graph: Graph, args: NamedTensors | None = None,
                 grad_graph_info: GradGraphInfo | None = None, from_module: Any = None,
                 aux: Aux | Mapping | None = None,
                 called_graphs_grad_info: Mapping | None = None):  # fmt: skip
        if not isinstance(graph, Graph):
            raise TypeError(f"GraphWithNamedArgs expects a popxl Graph; got {given(graph)}.")
        self.graph = graph
        self.args = args if args is not None else NamedTensors()
        self._grad_graph_info = grad_graph_info
        self.from_module = from_module
        # The forward tensors ``build`` kept for ``build_grad`` (Note [aux stitching]).
        self.aux: Aux
        if isinstance(aux, Aux):
            self.aux = aux
        else:
            self.aux = Aux()
            for k, v in dict(aux or {}).items():
                self.aux[k] = v
        self.called_graphs_grad_info = dict(called_graphs_grad_info or {})
        self.autodiff_applied = False

    @classmethod
    def from_grad_graph(
        cls, grad_graph_info: GradGraphInfo, args: NamedTensors | None = None
    ) -> GraphWithNamedArgs:
        return cls(grad_graph_info.graph, args, grad_graph_info)

    @property
    def grad_graph_info(self) -> GradGraphInfo:
        if self._grad_graph_info is None:
            raise AttributeError(f"Not a gradient graph: {self.graph.id!r} has no grad_graph_info.")
        return self._grad_graph_info

    @grad_graph_info.setter
    def grad_graph_info(self, info: GradGraphInfo) -> None:
        self._grad_graph_info = info

    def bind(self, args: NamedTensors | None = None) -> BoundGraph:
        """Bind ``self.args`` to ``args`` by common flat key (missing keys stay unbound)."""
        if args is None:
            return BoundGraph(self.graph)
        if not isinstance(args, NamedTensors):
            args = NamedTensors.from_dict(dict(args))
        return BoundGraph(self.graph, self.args.to_mapping(args))

    def call(self, *targs: Any, args: TensorMap | None = None) -> tuple[Tensor, ...]:
        return self.bind().call(*targs, args=args)

    def call_with_info(self, *targs: Any, args: TensorMap | None = None) -> CallSiteInfo:
        return self.bind().call_with_info(*targs, args=args)

    def copy(self) -> GraphWithNamedArgs:
        new = GraphWithNamedArgs(self.graph, self.args.copy(), self._grad_graph_info, self.from_module,
                                 self.aux, self.called_graphs_grad_info)  # fmt: skip
        new.autodiff_applied = self.autodiff_applied
        return new

    def print_schedule(self) -> str:
        """The graph's ops as text (a debugging aid; returned, not printed)."""
        names = {t: k for k, t in self.args.to_dict().items()}
        return print_schedule(self.graph, names)

    def __repr__(self) -> str:
        return f"GraphWithNamedArgs({self.graph.id}, args={list(self.args.keys_flat())})"


# ---- print_schedule -------------------------------------------------------------------------

# PopART op types for the aten / runtime ops the simulator records.
_OP_TYPES = {
    "zeros": "Init", "empty": "Init", "add": "Add", "add_": "AddLhsInplace", "sub": "Sub",
    "sub_": "SubtractLhsInplace", "mul": "Mul", "mul_": "MulLhsInplace", "div": "Div",
    "mm": "MatMul", "matmul": "MatMul", "bmm": "MatMul", "gelu": "Gelu", "relu": "Relu",
    "gelu_backward": "GeluGrad", "_softmax": "Softmax", "_log_softmax": "LogSoftmax",
    "view": "Reshape", "reshape": "Reshape", "_unsafe_view": "Reshape", "t": "Transpose",
    "transpose": "Transpose", "permute": "Transpose", "copy_": "CopyVarUpdate", "sqrt": "Sqrt",
    "neg": "Neg", "sum": "ReduceSum", "mean": "ReduceMean", "clone": "Identity",
    "detach": "Detach", "_to_copy": "Cast", "zero_": "AccumulatorZero", "pow": "Pow",
    "reciprocal": "Reciprocal", "rsub": "Sub", "exp": "Exp", "log": "Log",
}  # fmt: skip
_KIND_TYPES = {"call": "Call", "repeat": "Loop"}


def _op_type(op: Op) -> str:
    opdef = opdefs.lookup(op)
    if opdef is not None and opdef.popart_type:  # a torch_popxl or runtime op names its type
        return opdef.popart_type
    if op.kind != OpKind.TORCH:
        return _KIND_TYPES.get(str(op.kind), op.name)
    target = op.attrs.target
    base = getattr(target, "_opname", None) or str(target).split(".")[-2]
    return _OP_TYPES.get(base, "".join(p.capitalize() for p in base.split("_")) or base)


def _op_ids(graph: Graph) -> dict[int, int]:
    """Stable ids for the ops of ``graph``: position over every op of the Ir, from 1."""
    ids: dict[int, int] = {}
    n = 0
    for g in graph.ir.graphs:
        for op in g.ops:
            if _op_type(op) == "Detach":
                continue
            n += 1
            if g is graph:
                ids[id(op)] = n
    return ids


def print_schedule(graph: Graph, arg_names: Mapping[Tensor, str]) -> str:
    ids: dict[str, int] = {}

    def ref(t: Tensor) -> str:
        if t.id not in ids:
            ids[t.id] = len(ids) + 1
        return f"%{ids[t.id]}"

    def typed(t: Tensor) -> str:
        return f"{ref(t)} [{tuple(t.shape)} {t.dtype.name}]"

    ins = []
    for t in graph.inputs:
        r = ref(t)
        ins.append(f"{arg_names[t]}={r}" if t in arg_names else r)
    op_ids = _op_ids(graph)
    lines = []
    for op in graph.ops:
        if _op_type(op) == "Detach" and len(op.inputs) == 1:
            # A capture artefact (torch detaches fresh tensors); PopXL has no such op.
            ids[op.outputs[0].id] = int(ref(op.inputs[0])[1:])
            continue
        callee = op.attrs.graph if isinstance(op.attrs, CallSite) else None
        called = f"({callee.id})" if callee is not None else ""
        op_ins = ", ".join(typed(t) for t in op.inputs)
        op_outs = ", ".join(typed(t) for t in op.outputs)
        lines.append(f"    {_op_type(op)}.{op_ids[id(op)]}{called} ({op_ins}) -> ({op_outs})")
    outs = ", ".join(ref(t) for t in graph.outputs)
    head = f"Graph : {graph.id}\n  ({', '.join(ins)}) -> ({outs}) {{"
    return "\n".join([head, *lines, "  }"])
