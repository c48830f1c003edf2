"""``autodiff``: gradient graphs produced by ``torch.autograd`` (spec §8).

There is no per-op gradient table. The forward graph is replayed on fake tensors with
``requires_grad``; ``torch.autograd.grad`` then runs under the capture recorder targeting a
new graph, so the backward aten ops (whatever torch's derivative formulas emit) become the
grad graph. Forward tensors the backward reads (autograd's saved tensors) become grad-graph
inputs with ``Fwd`` connections; those that are neither forward inputs nor outputs are added
as forward outputs ("stitching"), and every call site of the forward graph gains the output.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import opdefs
from ..capture import fake_mode, in_torch_order, record_into, view_or_copy
from ..errors import PopXLError
from ..errors import given as _given
from ..ir import context as _ctx
from ..ir.attrs import TorchCall
from ..ir.graph import Graph, Op, OpKind, Slot
from ..ir.opdef import OpDef
from ..ir.tensor import (
    Constant,
    Tensor,
    _constant_from_torch,
    _fake_like,
    graph_input,
    graph_output,
)
from ..ir.walk import Interpreter, effects
from ..opdefs.registry import Effect
from .custom_grads import call_with_given_grad, given_grad_graphs, with_intermediate_grads

__all__ = ["autodiff", "GradGraphInfo", "ExpectedConnection", "ExpectedConnectionType"]


class ExpectedConnectionType(enum.Enum):
    Fwd = "Fwd"
    FwdGrad = "FwdGrad"


@dataclass(frozen=True)
class ExpectedConnection:
    """A grad-graph input or output and the forward tensor it corresponds to."""

    fwd_tensor: Tensor
    connection_type: ExpectedConnectionType

    def __repr__(self) -> str:
        return f"({self.connection_type.name}: {self.fwd_tensor.id})"


class GradGraphInfo:
    """The result of ``autodiff``: the grad graph and how to connect it."""

    # Set by ``_create`` (built with ``object.__new__``, never ``__init__``).
    _graph: Graph
    _forward_graph: Graph
    _expected_inputs: tuple[ExpectedConnection, ...]
    _expected_outputs: tuple[ExpectedConnection, ...]

    def __init__(self, *args, **kwargs):
        raise TypeError("GradGraphInfo is created by popxl.transforms.autodiff.")

    @classmethod
    def _create(cls, graph, forward_graph, expected_inputs, expected_outputs):
        info = object.__new__(cls)
        info._graph = graph
        info._forward_graph = forward_graph
        info._expected_inputs = tuple(expected_inputs)
        info._expected_outputs = tuple(expected_outputs)
        return info

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def forward_graph(self) -> Graph:
        return self._forward_graph

    @property
    def expected_inputs(self) -> tuple[ExpectedConnection, ...]:
        return self._expected_inputs

    @property
    def expected_outputs(self) -> tuple[ExpectedConnection, ...]:
        return self._expected_outputs

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(e.fwd_tensor for e in self._expected_inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(e.fwd_tensor for e in self._expected_outputs)

    def inputs_dict(self, fwd_call_info) -> dict[Tensor, Tensor]:
        """{grad-graph input: parent tensor} for the ``Fwd`` inputs, through the forward call."""
        if fwd_call_info.called_graph is not self._forward_graph:
            raise TypeError(
                f"The call site calls {fwd_call_info.called_graph.id!r}, not the forward graph "
                f"{self._forward_graph.id!r} of this GradGraphInfo."
            )
        out = {}
        # Inputs past the expected ones (accumulators added by addons) have no forward source.
        expected = self._expected_inputs
        for gt, e in zip(self._graph._inputs[: len(expected)], expected, strict=True):
            if e.connection_type is ExpectedConnectionType.Fwd:
                out[gt] = fwd_call_info.graph_to_parent(e.fwd_tensor)
        return out

    def fwd_graph_ins_to_grad_parent_outs(self, grad_call_info) -> dict[Tensor, Tensor]:
        return {
            e.fwd_tensor: grad_call_info.parent_output(i)
            for i, e in enumerate(self._expected_outputs)
        }

    def fwd_parent_ins_to_grad_parent_outs(
        self, fwd_call_info, grad_call_info
    ) -> dict[Tensor, Tensor]:
        return {
            fwd_call_info.graph_to_parent(e.fwd_tensor): grad_call_info.parent_output(i)
            for i, e in enumerate(self._expected_outputs)
        }

    def __repr__(self) -> str:
        ins = ", ".join(repr(e) for e in self._expected_inputs)
        outs = ", ".join(repr(e) for e in self._expected_outputs)
        return (f"GradGraphInfo[\n  graph={self._graph.id}\n  expected_inputs=[{ins}]\n"
                f"  expected_outputs=[{outs}]\n]")  # fmt: skip


def _is_modifying(op: Op) -> bool:
    """Whether ``op`` itself writes a tensor of the graph (Note [one effects query]; a call's
    writes are its callee's ops'). Stores have side effects but modify no tensor of the graph:
    upstream (PopART's checkForModifyingOps asks Op::modifies()) differentiates graphs holding
    them; batch norm's running statistics carry no gradient."""
    if op.kind in (OpKind.CALL, OpKind.REPEAT):
        return False
    e = effects(op)
    return bool(e.writes - e.undeclared)


def _check_differentiable(graph: Graph) -> None:
    for op in graph._ops:
        if _is_modifying(op):
            raise PopXLError(
                f"The graph {graph.id} contains a modifying op {op.name} (outputs "
                f"{[t.id for t in op.outputs]}), which autodiff cannot differentiate. Use the "
                "out-of-place op in graphs you differentiate."
            )


def _differentiable_dtype(t: Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


# Note [callee values in gradients]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The replay enters called graphs, so torch's autograd differentiates through their ops and may
# save a value computed inside a callee (an activation of a layer graph, say). The gradient graph
# can only read tensors of the graph being differentiated, so such a value is brought out as
# upstream's autodiff does for the callee's own gradient: it becomes an output of the callee
# (every call site gets the matching output), then of each enclosing callee, and the outermost
# call's new output is an ordinary intermediate of ``graph``, which the gradient graph takes as a
# Fwd input. ``enter`` records where each callee value was computed (the chain of call sites);
# ``surface`` does the stitching, on first use.


class _Replay(Interpreter[torch.Tensor]):
    """The forward graph re-run on fake tensors that track gradients (``ir.walk.Interpreter``
    over fake tensors). Calls are entered; a repeat, like a host or remote load, yields fresh
    values without a gradient path."""

    def __init__(self, graph: Graph, required: list[Tensor], given: dict | None = None):
        self.graph = graph
        # Calls whose gradient graph is given (Note [given gradient graphs], custom_grads.py).
        self.given = given or {}
        self.given_call_outputs: dict[int, list[torch.Tensor]] = {}
        # fake -> grad-graph tensor, set while the backward records
        self.grad_handle: Callable[[torch.Tensor], Tensor] | None = None
        self.value: dict[str, torch.Tensor] = {}
        self.fwd_of: dict[int, Tensor] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids in fwd_of from being reused
        self._depth = 0  # > 0 inside a callee, whose values are not the graph's own
        # Values computed inside called graphs (Note [callee values in gradients]):
        # id(fake) -> (call sites from ``graph`` inwards as (graph, op index), callee tensor).
        self._sites: list[tuple[Op, int]] = []  # the calls being entered, with their indices
        self.inner_of: dict[int, tuple[tuple[tuple[Graph, int], ...], Tensor]] = {}
        required_ids = {t.id for t in required}
        with fake_mode():
            for t in graph._inputs:
                leaf = _fake_like(t.shape, t.dtype)
                if t.id in required_ids and _differentiable_dtype(t):
                    leaf.requires_grad_(True)
                self._bind(t, leaf)
            # (op, its input, autograd's copy of it) for Note [autograd copies before in-place ops]
            self._copies: list[tuple[Op, Tensor, torch.Tensor]] = []
            with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
                self.run(graph._ops, self.value)
            self._snapshot_copies()

    def _note(self, fake: torch.Tensor, t: Tensor) -> None:
        self._alive.append(fake)
        self.fwd_of.setdefault(id(fake), t)

    def _bind(self, t: Tensor, fake: torch.Tensor) -> None:
        self.value[t.id] = fake
        self._note(fake, t)
        self._hook(t, fake)

    def _note_outputs(self, op: Op, values) -> None:
        if self._depth == 0:
            for t, v in zip(op.outputs, values, strict=True):
                self._note(v, t)
                self._hook(t, v)

    def _hook(self, t: Tensor, fake: torch.Tensor) -> None:
        # the capture's tensor hooks (Note [requires_grad in captured code], compile.py)
        for hook in self.graph._grad_hooks.get(t.id, ()):
            if fake.requires_grad:
                fake.register_hook(hook)

    def constant(self, t: Constant) -> torch.Tensor:
        with fake_mode() as fm:
            fake = fm.from_tensor(t._data)
        self._note(fake, t)
        return fake

    def op(self, op: Op, ins: list[torch.Tensor], env) -> list[torch.Tensor]:
        opdef = op.kind if isinstance(op.kind, OpDef) else None
        if opdef is not None and opdef.has("replay"):
            # the definition's own replay under autograd (print: an identity for gradients)
            outs = opdef.rule("replay")(op, ins, self)
            self._note_outputs(op, outs)
            return outs
        if op.kind != OpKind.TORCH:
            return self._no_gradient_path(op)
        target = op.attrs.target
        if target is torch.ops.aten.view.default:  # Note [recorded views meet other layouts]
            target = view_or_copy
        args = _fill(op.attrs.args, ins)
        kwargs = _fill(op.attrs.kwargs, ins)
        if op.attrs.no_grad or _has_no_gradient(op):  # Note [no_grad in captured code]
            with torch.no_grad():
                result = target(*args, **kwargs)
        elif self._depth == 0 and _is_modifying(op):
            with _CopyWatch(op, ins, self._copies):
                result = target(*args, **kwargs)
        else:
            result = target(*args, **kwargs)
        outs = []
        for path in op.attrs.out_paths:
            value = result
            for i in path:
                value = value[i]
            outs.append(value)
        self._note_outputs(op, outs)
        return outs

    def _snapshot_copies(self) -> None:
        # Note [autograd copies before in-place ops]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # An in-place op whose derivative needs its input as it was before (`h.mul_(r)` needs
        # the old `h`; GRU and GRUCell do this on CPU) makes autograd copy that input inside the
        # op (`original_self = self.clone()`), and the backward reads the copy. The copy is no
        # op of the forward graph, and the forward tensor holds the value after the op, so the
        # copy is made a forward op: a clone inserted just before the in-place op (its context
        # and scope, ordered before it by in_sequence constraints, as the in-place check
        # requires), whose output the gradient graph takes as a Fwd input. Indices of
        # call sites recorded for Note [callee values in gradients] move with the insertion.
        position = {id(o): i for i, o in enumerate(self.graph._ops)}
        # From the last: an insertion (or a sequence rewrite, which replaces ops) then leaves
        # the positions of the ones still to come as they were.
        for index, source, copy in sorted(
            ((position[id(op)], source, copy) for op, source, copy in self._copies),
            key=lambda e: -e[0],
        ):
            saved = Tensor._create(self.graph, source.name + "_before_inplace",
                                   _fake_like(source.shape, source.dtype))  # fmt: skip
            sequence = _sequence_before(self.graph, index)
            op = self.graph._ops[index]
            clone = Op(OpKind.TORCH, str(torch.ops.aten.clone.default), (source,), (saved,),
                       TorchCall(torch.ops.aten.clone.default, (Slot(0),), {}, ((),)),
                       context=op.context, sequence=sequence, scope=op.scope)  # fmt: skip
            self.graph._ops.insert(index, clone)
            self.graph._version += 1
            self._note(copy, saved)
            for key, (sites, t) in list(self.inner_of.items()):
                if sites and sites[0][1] >= index:
                    self.inner_of[key] = (((sites[0][0], sites[0][1] + 1), *sites[1:]), t)

    def call(self, op: Op, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        info = self.given.get(op.attrs.graph) if op.kind == OpKind.CALL else None
        # Deeper calls with a given gradient are only met inside a given call's forward (whose
        # gradient is its own graph: with_intermediate_grads), where values are all we need.
        if info is not None and not self._depth:
            outs = call_with_given_grad(self, op, info, ins)
            self._note_outputs(op, outs)
            return outs
        self._depth += 1
        try:
            outs = self.enter(op, self.by_value(op, ins))
        finally:
            self._depth -= 1
        self._note_outputs(op, outs)
        return outs

    def enter(self, op: Op, args) -> list[torch.Tensor]:
        callee: Graph = op.attrs.graph
        parent = self._sites[-1][0].attrs.graph if self._sites else self.graph
        index = next(i for i, o in enumerate(parent._ops) if o is op)
        self._sites.append((op, index))
        try:
            env = self.run(callee._ops, self.bind(callee, args))
            sites = tuple((self._parent_of(k), i) for k, (_, i) in enumerate(self._sites))
        finally:
            self._sites.pop()
        # Inner calls finished first: assigning (not setdefault) keeps the shallowest site.
        for tid, value in env.items():
            if isinstance(value, torch.Tensor):
                self.inner_of[id(value)] = (sites, callee._tensors[tid])
                self._alive.append(value)
        return self.results(callee, env)

    def _parent_of(self, k: int) -> Graph:
        return self._sites[k - 1][0].attrs.graph if k else self.graph

    def surface(self, fake: torch.Tensor) -> Tensor | None:
        """The tensor of ``graph`` holding ``fake``, a value computed inside a called graph:
        that value is made an output of each callee on the way out (Note [callee values in
        gradients]). None if ``fake`` is no such value."""
        entry = self.inner_of.get(id(fake))
        if entry is None:
            return None
        sites, t = entry
        for parent, index in reversed(sites):
            callee: Graph = parent._ops[index].attrs.graph
            if t not in callee._outputs:
                _stitch_output(callee, t)
            # _stitch_output replaced the call op: read the op at the same index again.
            t = parent._ops[index].outputs[callee._outputs.index(t)]
        self.fwd_of[id(fake)] = t
        return t

    def repeat(self, op: Op, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._no_gradient_path(op)

    def _no_gradient_path(self, op: Op) -> list[torch.Tensor]:
        # Host loads, remote loads, repeats: values without a gradient path; stores: no values.
        outs = [_fake_like(t.shape, t.dtype) for t in op.outputs]
        for t, fake in zip(op.outputs, outs, strict=True):
            self._note(fake, t)
        return outs


def _sequence_before(graph: Graph, index: int) -> tuple[int, int]:
    """An in_sequence position for an op to be inserted at ``index`` that orders it before the
    op now there (the inserted clone reads what that op writes in place): a fresh chain when the
    op has none, else the op's unit, with that unit and all later ones of its chain moved one
    on (units are only compared, so every other order is kept)."""
    op = graph._ops[index]
    if op.sequence is None:
        chain = next(_ctx._chains)
        graph._replace_op(index, replace(op, sequence=(chain, 1)))
        return (chain, 0)
    chain, unit = op.sequence
    for i, other in enumerate(graph._ops):
        if other.sequence is not None and other.sequence[0] == chain and other.sequence[1] >= unit:
            graph._replace_op(i, replace(other, sequence=(chain, other.sequence[1] + 1)))
    for state in _ctx._sequence_state.values():  # ops created later in the chain come after
        if state[0] == chain:
            state[1] += 1
    return (chain, unit)


class _CopyWatch(TorchDispatchMode):
    """Notes the copies autograd makes of an in-place op's inputs while the op runs (Note
    [autograd copies before in-place ops])."""

    def __init__(self, op: Op, ins: list[torch.Tensor], copies: list):
        super().__init__()
        self.op, self.ins, self.copies = op, ins, copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.clone.default:
            source = next((t for t, x in zip(self.op.inputs, self.ins, strict=True)
                           if x is args[0]), None)  # fmt: skip
            if source is not None:
                self.copies.append((self.op, source, out))
        return out


def _has_no_gradient(op: Op) -> bool:
    # Ops PopXL defines no gradient for (all-reduce, spec §5.1): autodiff yields none through them.
    opdef = opdefs.lookup(op)
    return (
        opdef is not None and Effect.COLLECTIVE in opdef.effects and opdef.rule("no_gradient")(op)
    )


def _fill(x, ins):
    if isinstance(x, Slot):
        return ins[x.index]
    if isinstance(x, list):
        return [_fill(y, ins) for y in x]
    if isinstance(x, tuple):
        return tuple(_fill(y, ins) for y in x)
    if isinstance(x, dict):
        return {k: _fill(v, ins) for k, v in x.items()}
    return x


def _stitch_output(graph: Graph, t: Tensor) -> None:
    """Make ``t`` an output of ``graph`` and give every call site the matching output."""
    graph._add_output(t)
    for parent in graph.ir._graphs:
        for i, op in enumerate(parent._ops):
            if op.kind == OpKind.CALL and op.attrs.graph is graph:
                with parent:
                    new = Tensor._create(parent, t.name, _fake_like(t.shape, t.dtype), t.meta_shape)
                parent._replace_op(i, op.with_outputs((*op.outputs, new)))


def autodiff(graph: Graph, grads_provided: Iterable[Tensor] | None = None,
             grads_required: Iterable[Tensor] | None = None,
             called_graphs_grad_info: dict | None = None,
             return_all_grad_graphs: bool = False, *, _allow_modifying: bool = False,
             _missing_ok: bool = False):  # fmt: skip
    """Differentiate ``graph``; returns a ``GradGraphInfo`` (see spec §8).

    ``called_graphs_grad_info`` ({called graph: its ``GradGraphInfo``}) makes calls of those
    graphs, at any depth, use the given gradient graphs (Note [given gradient graphs]).

    ``_allow_modifying`` (used by ``popxl.compile``) accepts in-place updates of inputs that
    carry no gradient, such as BatchNorm running statistics; ``_missing_ok`` leaves a required
    input without a gradient path out of the outputs instead of raising.
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"autodiff expects a popxl Graph; got {_given(graph)}.")
    if not _allow_modifying:
        _check_differentiable(graph)
        for callee in graph.called_graphs:
            _check_differentiable(callee)
    explicit_required = grads_required is not None
    provided = list(graph._outputs) if grads_provided is None else list(grads_provided)
    required = list(graph._inputs) if grads_required is None else list(grads_required)
    for t in provided:
        if t not in graph._outputs:
            warnings.warn(
                f"autodiff: grads_provided entry {t.id!r} is not an output of {graph.id!r}.",
                stacklevel=2,
            )
    for t in required:
        if t not in graph._inputs:
            raise PopXLError(
                f"[Autodiff] Unable to provide required gradient output for {t.id!r}: it is not an "
                f"input of {graph.id!r}."
            )

    # Custom autograd Functions' gradient graphs first: the caller's map may replace them.
    given_in = {**graph.ir._function_grads, **given_grad_graphs(called_graphs_grad_info)}
    given = with_intermediate_grads(graph, given_in, autodiff)
    replay = _Replay(graph, required, given)
    ir = graph.ir
    grad_graph = ir.create_empty_graph(f"{graph.name}_grad")
    expected_in: list[ExpectedConnection] = []
    fwd_inputs: dict[str, Tensor] = {}

    with grad_graph:
        seeds = []
        for t in provided:
            seeds.append(graph_input(t.shape, t.dtype, f"Gradient___{t.name}"))
            expected_in.append(ExpectedConnection(t, ExpectedConnectionType.FwdGrad))

    def resolve(fake: torch.Tensor) -> Tensor | None:
        ft = replay.fwd_of.get(id(fake))
        if ft is None:
            ft = replay.surface(fake)
        if ft is None:
            return None
        if isinstance(ft, Constant):
            c = _constant_from_torch(grad_graph, ft._data, ft.name)
            grad_graph._rebind_fake(c, fake)
            return c
        if ft.id not in fwd_inputs:
            with grad_graph:
                fwd_inputs[ft.id] = graph_input(
                    ft.shape, ft.dtype, ft.name, meta_shape=ft.meta_shape
                )
        handle = fwd_inputs[ft.id]
        grad_graph._rebind_fake(handle, fake)
        return handle

    def grad_handle(fake: torch.Tensor) -> Tensor:
        handle = grad_graph._tensor_for_fake(fake)
        if handle is None:
            handle = resolve(fake)
        if handle is None:
            raise AssertionError("a value the given gradient graph reads was not captured")
        return handle

    replay.grad_handle = grad_handle
    outs = [replay.value[t.id] for t in provided]
    pairs = [(o, s) for o, s in zip(outs, seeds, strict=True) if o.requires_grad]
    wrt = [(t, replay.value[t.id]) for t in required]
    wrt_grad = [(t, v) for t, v in wrt if v.requires_grad]
    grads: dict[str, torch.Tensor | None] = {t.id: None for t in required}
    with grad_graph:
        if pairs and wrt_grad:
            with record_into(grad_graph, on_unknown=resolve), in_torch_order():
                results = torch.autograd.grad(
                    [o for o, _ in pairs],
                    [v for _, v in wrt_grad],
                    grad_outputs=[s._fake for _, s in pairs],
                    allow_unused=True,
                )
            for (t, _), result in zip(wrt_grad, results, strict=True):
                grads[t.id] = result
        expected_out: list[ExpectedConnection] = []
        for t in required:
            g = grads[t.id]
            if g is None:
                if explicit_required and not _missing_ok:
                    raise PopXLError(
                        f"[Autodiff] Unable to provide required gradient output for {t.id!r}: no "
                        f"gradient path from the provided outputs of {graph.id!r}."
                    )
                continue
            handle = grad_graph._tensor_for_fake(g)
            if handle is None:
                handle = resolve(g)
            if handle is None:
                raise AssertionError(f"gradient of {t.id} was not captured")
            graph_output(handle)
            expected_out.append(ExpectedConnection(t, ExpectedConnectionType.FwdGrad))

    # Fwd inputs follow the FwdGrad seeds, in lexicographic order of forward tensor id.
    fwd_entries = sorted(fwd_inputs.items())
    grad_graph._inputs[len(seeds) :] = [h for _, h in fwd_entries]
    for fid, _ in fwd_entries:
        ft = graph._tensors[fid]
        expected_in.append(ExpectedConnection(ft, ExpectedConnectionType.Fwd))
        if ft not in graph._inputs and ft not in graph._outputs:
            _stitch_output(graph, ft)

    info = GradGraphInfo._create(grad_graph, graph, expected_in, expected_out)
    if return_all_grad_graphs:  # with the gradient graphs made for called graphs
        return {**{g: i for g, i in given.items() if g not in given_in}, graph: info}
    return info
