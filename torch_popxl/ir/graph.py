"""``Graph``: an ordered list of ops over symbolic tensors, and the ``Op`` record.

Ops are kept in creation order, which is the order the simulator executes them in (the
``in_sequence(True)`` schedule, a valid PopXL schedule for every program).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterator, MutableSet
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import given
from . import context as _ctx
from .attrs import CallSite, HostTransfer, RemoteTransfer, TorchCall
from .fake import fake_mode
from .opdef import OpDef, runtime_definition
from .tensor import Constant, Tensor, Variable

if TYPE_CHECKING:
    from .ir import Ir

__all__ = ["Graph", "Op", "OpKind", "Slot"]


@dataclass(frozen=True)
class Slot:
    """Placeholder for ``op.inputs[index]`` inside an op's argument template."""

    index: int


class OpKind(str, enum.Enum):
    """What an ``Op`` is when it is not a runtime op with its own definition (Note [op
    definitions] in ir/opdef.py). Its ``attrs`` is the typed record of the kind
    (``ir/attrs.py``): ``TorchCall`` for ``TORCH``, ``CallSite`` for ``CALL`` / ``REPEAT``.

    Members compare and hash equal to their string values (``OpKind.CALL == "call"``).
    """

    TORCH = "torch"
    CALL = "call"
    REPEAT = "repeat"

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


@dataclass(frozen=True, eq=False)
class Op:
    """One operation of a graph: its ``kind`` (an ``OpKind``, or the ``OpDef`` of a runtime
    op; a name string is converted), inputs, outputs and attributes (Note [op definitions])."""

    kind: OpKind | OpDef
    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    attrs: Any  # the record of ``_ATTRS[kind]``, or of ``kind.attrs``
    context: str = "normal"
    # (chain, unit) of the in_sequence constraints it was created under (Note [in_sequence
    # constraints] in ir/context.py); None when created outside in_sequence.
    sequence: tuple[int, int] | None = None
    # The ``name_scope`` the op was created in ("fc1/fwd/", "" outside any); the memory
    # report groups a phased program's main-graph ops into phases by it.
    scope: str = ""

    def __post_init__(self) -> None:
        kind = self.kind
        if not isinstance(kind, OpKind | OpDef):
            kind = runtime_definition(kind) or OpKind(kind)
            object.__setattr__(self, "kind", kind)
        expected = kind.attrs if isinstance(kind, OpDef) else _ATTRS[kind]
        assert expected is not None, f"{kind} is not the definition of a runtime op"
        if not isinstance(self.attrs, expected):
            raise TypeError(
                f"{kind.name} op {self.name!r} needs {expected.__name__} attributes; "
                f"got {type(self.attrs).__name__}."
            )

    def with_outputs(self, outputs) -> Op:
        return replace(self, outputs=tuple(outputs))

    def tensor_arg(self, position: int) -> Tensor:
        """The input tensor at argument ``position`` of a captured torch op."""
        slot = self.attrs.args[position]
        assert isinstance(slot, Slot), f"{self.name}: argument {position} is not a tensor"
        return self.inputs[slot.index]

    def modifiesIndex(self, index: int) -> bool:  # noqa: N802 - upstream's (pybind) name
        """Whether this call or repeat lets its callee write input ``index`` (the callee's input
        is a ``TensorByRef``), as upstream's ``CallSiteInfo._op.modifiesIndex``. A repeat counts
        its inputs from 2, as PopART's loop op, whose inputs 0 and 1 are the trip count and the
        loop condition."""
        if self.kind not in (OpKind.CALL, OpKind.REPEAT):
            raise TypeError(
                f"modifiesIndex answers for call and repeat ops; {self.name!r} is a "
                f"{self.kind.name} op."
            )
        offset = 2 if self.kind == OpKind.REPEAT else 0
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"modifiesIndex: index must be an int >= 0; got {index!r}.")
        return index - offset in self.attrs.modified


_ATTRS: dict[OpKind, type] = {
    OpKind.TORCH: TorchCall,
    OpKind.CALL: CallSite,
    OpKind.REPEAT: CallSite,
}

_CONTEXTS = ("weights_from_host", "normal", "weights_to_host")


class _ByRefInputs(MutableSet):
    """A set view of a graph's by-reference inputs, stored as ids in ``graph._by_ref``."""

    def __init__(self, graph: Graph):
        self._graph = graph

    def __contains__(self, t) -> bool:
        return isinstance(t, Tensor) and t._graph is self._graph and t.id in self._graph._by_ref

    def __iter__(self):
        return iter([t for t in self._graph._inputs if t.id in self._graph._by_ref])

    def __len__(self) -> int:
        return len(self._graph._by_ref)

    def add(self, t: Tensor) -> None:
        if not isinstance(t, Tensor) or t not in self._graph._inputs:
            name = t.id if isinstance(t, Tensor) else repr(t)
            raise ValueError(
                f"{name} is not an input of graph {self._graph.id!r}; only graph inputs can be "
                "passed by reference."
            )
        self._graph._by_ref.add(t.id)

    def discard(self, t: Tensor) -> None:
        if isinstance(t, Tensor) and t._graph is self._graph:
            self._graph._by_ref.discard(t.id)

    def __repr__(self) -> str:
        return f"{{{', '.join(t.id for t in self)}}}"


class Graph:
    """A popxl graph. Create with ``ir.create_graph`` / ``ir.create_empty_graph``."""

    # Set by ``_create`` (graphs are built with ``object.__new__``, never ``__init__``).
    _ir: Ir
    _id: str
    _name: str
    _tensors: dict[str, Tensor]
    # id(fake) -> (fake, handle). The fake is kept alive so its id cannot be reused by
    # a later fake tensor (which would then resolve to the wrong handle).
    _by_fake: dict[int, tuple[torch.Tensor, Tensor]]
    _inputs: list[Tensor]
    _by_ref: set[str]
    _outputs: list[Tensor]
    _ops: list[Op]
    _op_context: str
    _hooks: dict[int, Callable[[Op], None]]
    _grad_hooks: dict[str, tuple[Callable[..., Any], ...]]
    _hook_ids: Iterator[int]
    _version: int

    def __init__(self, *args, **kwargs):
        raise TypeError("Graphs cannot be constructed directly; use ir.create_graph(...).")

    @classmethod
    def _create(cls, ir: Ir, graph_id: str, name: str) -> Graph:
        g = object.__new__(cls)
        g._ir = ir
        g._id = graph_id
        g._name = name
        g._tensors = {}
        g._by_fake = {}
        g._inputs = []
        g._by_ref = set()
        g._outputs = []
        g._ops = []
        g._op_context = "normal"
        g._hooks = {}
        # tensor id -> gradient hooks torch code registered on it while it was captured
        # (``Tensor.register_hook``; autodiff registers them again: Note [requires_grad in
        # captured code])
        g._grad_hooks = {}
        g._hook_ids = itertools.count()
        g._version = 0
        return g

    # ---- identity -------------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def name(self) -> str:
        return self._name

    @property
    def ir(self) -> Ir:
        return self._ir

    @property
    def main_graph(self) -> Graph:
        """The main graph of this graph's Ir (upstream's ``Graph.main_graph``)."""
        return self._ir.main_graph

    @property
    def _is_main(self) -> bool:
        return self is self._ir.main_graph

    def __eq__(self, other):
        if not isinstance(other, Graph):
            raise TypeError(f"Cannot compare a Graph with {type(other).__name__}.")
        return self is other

    def __hash__(self):
        return id(self)

    def __repr__(self):
        return f"Graph[id={self._id}]"

    def __enter__(self) -> Graph:
        _ctx._push_graph(self)
        return self

    def __exit__(self, *exc) -> None:
        _ctx._pop_graph()

    # ---- contents -------------------------------------------------------------------------

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(self._inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(self._outputs)

    @property
    def inputs_by_name(self) -> dict[str, Tensor]:
        return {t.name: t for t in self._inputs}

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(self._tensors.values())

    @property
    def variables(self) -> tuple[Variable, ...]:
        return tuple(t for t in self._tensors.values() if isinstance(t, Variable))

    @property
    def constants(self) -> tuple[Constant, ...]:
        return tuple(t for t in self._tensors.values() if isinstance(t, Constant))

    @property
    def called_graphs(self) -> tuple[Graph, ...]:
        seen: dict[int, Graph] = {}
        for op in self._ops:
            if isinstance(op.attrs, CallSite):
                g = op.attrs.graph
                seen.setdefault(id(g), g)
        return tuple(seen.values())

    @property
    def ops(self) -> tuple[Op, ...]:
        return tuple(self._ops)

    def get_tensor(self, tensor_id: str) -> Tensor:
        if tensor_id not in self._tensors:
            raise ValueError(f"Graph {self._id!r} has no tensor with id {tensor_id!r}.")
        return self._tensors[tensor_id]

    def __contains__(self, t) -> bool:
        if not isinstance(t, Tensor):
            raise TypeError(f"`in graph` expects a popxl Tensor; got {given(t)}.")
        return t._graph is self and t.id in self._tensors

    def is_input_by_ref(self, t: Tensor) -> bool:
        return t.id in self._by_ref

    @property
    def _by_ref_inputs(self) -> _ByRefInputs:
        """The by-reference inputs as a live set of tensors (upstream's attribute): adding a
        graph input marks it by-reference for the call sites created afterwards."""
        return _ByRefInputs(self)

    def register_op_created_hook(self, fn: Callable[[Op], None]) -> int:
        handle = next(self._hook_ids)
        self._hooks[handle] = fn
        return handle

    def remove_op_created_hook(self, handle: int) -> None:
        if handle not in self._hooks:
            raise ValueError(f"Unknown op-created hook handle {handle!r} for graph {self._id!r}.")
        del self._hooks[handle]

    # ---- builders (used by tensor.py, capture.py and ops) ---------------------------------

    def _register_tensor(self, t: Tensor, name: str, scoped: bool = True) -> str:
        self._ir._check_mutable()
        base = _ctx.current_name_scope() + name if scoped else name
        tid = base if self._is_main else f"{self._id}/{base}"
        # Host streams are main-graph tensors upstream: their ids share this namespace.
        taken = self._ir._stream_ids() if self._is_main else ()
        if tid in self._tensors or tid in taken:
            k = 1
            while f"{tid}__t{k}" in self._tensors or f"{tid}__t{k}" in taken:
                k += 1
            tid = f"{tid}__t{k}"
        self._tensors[tid] = t
        self._by_fake[id(t._fake)] = (t._fake, t)
        self._version += 1
        return tid

    def _rename_tensor(self, t: Tensor, name: str) -> None:
        """Give a just-created tensor a PopXL-style name (e.g. ``<name>_sharded_slice``).

        ``name`` is graph-relative and already scoped (like ``Tensor.name``)."""
        del self._tensors[t._id]
        t._id = self._register_tensor(t, name, scoped=False)

    def _rebind_fake(self, t: Tensor, fake: torch.Tensor) -> None:
        self._by_fake[id(fake)] = (fake, t)

    def _unbind_fake(self, fake: torch.Tensor) -> None:
        entry = self._by_fake.get(id(fake))
        if entry is not None and entry[0] is fake:
            del self._by_fake[id(fake)]

    def _tensor_for_fake(self, fake: torch.Tensor) -> Tensor | None:
        entry = self._by_fake.get(id(fake))
        return entry[1] if entry is not None and entry[0] is fake else None

    def _producer(self, t: Tensor) -> Op | None:
        """The op of this graph that outputs ``t`` (None for inputs, variables, constants)."""
        for op in reversed(self._ops):
            if any(o is t for o in op.outputs):
                return op
        return None

    def _add_input(self, t: Tensor, by_ref: bool) -> None:
        self._inputs.append(t)
        if by_ref:
            self._by_ref.add(t.id)

    def _add_output(self, t: Tensor) -> None:
        self._ir._check_mutable()
        self._outputs.append(t)
        self._version += 1

    def _add_constant(self, value: torch.Tensor, dt, name: str) -> Constant:
        with fake_mode() as fm:
            fake = fm.from_tensor(value)
        return Constant._create(self, name, fake, _data=value)

    def _append_op(self, op: Op) -> Op:
        self._ir._check_mutable()
        if self._op_context != "normal":
            op = replace(op, context=self._op_context)
        if op.sequence is None:  # a moved or cloned op keeps the constraints it was built with
            op = replace(op, sequence=_ctx._next_sequence(self, op.context))
        if not op.scope and _ctx.current_name_scope():
            op = replace(op, scope=_ctx.current_name_scope())
        self._ops.append(op)
        self._version += 1
        for hook in list(self._hooks.values()):
            hook(op)
        return op

    def _replace_op(self, index: int, op: Op) -> None:
        if not op.scope and self._ops[index].scope:
            op = replace(op, scope=self._ops[index].scope)  # a rewrite keeps the op's scope
        self._ops[index] = op
        self._version += 1

    def _ops_in_context(self, context: str) -> list[Op]:
        return [op for op in self._ops if op.context == context]

    # ---- text form ------------------------------------------------------------------------

    def text(self) -> str:
        """A deterministic, human-readable listing of the graph (inputs, ops, outputs)."""
        lines = [f"graph {self._id}:"]
        for t in self._inputs:
            ref = " (by_ref)" if t.id in self._by_ref else ""
            lines.append(f"  input {_fmt(t)}{ref}")
        if self._is_main:
            for v in self.variables:
                lines.append(f"  variable {_fmt(v)}")
        for ctx_name in _CONTEXTS:
            ops = self._ops_in_context(ctx_name)
            if not ops:
                continue
            if ctx_name != "normal":
                lines.append(f"  [{ctx_name}]")
            for op in ops:
                lines.append("  " + _fmt_op(op))
        for t in self._outputs:
            lines.append(f"  output {t.id}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _fmt(t: Tensor) -> str:
    meta = f" meta{list(t.meta_shape)}" if t.meta_shape else ""
    return f"{t.id}: {t.dtype.name}{list(t.shape)}{meta}"


def _fmt_arg(a, op: Op) -> str:
    if isinstance(a, Slot):
        return op.inputs[a.index].id
    if isinstance(a, list | tuple):
        inner = ", ".join(_fmt_arg(x, op) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype | torch.device | torch.layout | torch.memory_format):
        return str(a)
    return repr(a)


def _fmt_op(op: Op) -> str:
    outs = ", ".join(_fmt(t) for t in op.outputs)
    lhs = f"{outs} = " if outs else ""
    if op.kind == OpKind.TORCH:
        args = [_fmt_arg(a, op) for a in op.attrs.args]
        args += [f"{k}={_fmt_arg(v, op)}" for k, v in op.attrs.kwargs.items()]
        return f"{lhs}{op.name}({', '.join(args)})"
    ins = ", ".join(t.id for t in op.inputs)
    return f"{lhs}{op.name}({ins}){_describe(op)}"


def _describe(op: Op) -> str:
    a = op.attrs
    if isinstance(a, CallSite):
        return (
            f" [{a.graph.id}]" if op.kind == OpKind.CALL else f" [{a.graph.id} x{a.repeat_count}]"
        )
    if isinstance(a, HostTransfer):
        return (" <- " if op.outputs else " -> ") + a.stream.tensor_id
    if isinstance(a, RemoteTransfer):
        arrow = " <- " if op.outputs else " -> "  # a load has its loaded value, a store none
        return f"{arrow}buffer {a.buffer.remote_buffer_id}"
    return ""
