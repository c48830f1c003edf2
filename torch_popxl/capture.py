"""Capture: torch code applied to popxl handles is recorded as aten-level ops.

``call_torch(func, args, kwargs)`` swaps every popxl handle for its fake tensor, runs
``func`` under ``FakeTensorMode`` (shapes and dtypes without compute) with the ``_Recorder``
dispatch mode on top, and maps the fake results back to handles. The recorder appends one
``Op`` per aten (or ``torch_popxl`` custom) op it sees, so there are no hand-written shape
rules: whatever torch can run on fake tensors can be captured.
"""

from __future__ import annotations

import contextlib
import math
import random
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch._prims_common import get_computation_dtype
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from .capture_packed import PackedRNN
from .errors import DataDependentError
from .ir.attrs import TorchCall
from .ir.context import gcg, in_sequence, in_sequence_mode
from .ir.fake import fake_mode
from .ir.graph import Graph, Op, OpKind, Slot
from .ir.tensor import Constant, Tensor, _constant_from_torch, variable

__all__ = [
    "call_torch",
    "fake_mode",
    "in_torch_order",
    "record_into",
    "values_read_by",
    "view_or_copy",
]

aten = torch.ops.aten

# Ops that must never be captured: they need a concrete value (Python control flow on data).
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
}
_CONSTANT_LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_CTC_LOSSES = {aten._ctc_loss.default, aten._ctc_loss.Tensor}
# Factories that read only their tensor argument's shape, dtype and device, never its values:
# those whose values are then known (Note [constant folding]), and all of them (the loss
# splitter follows no batch data through them: compile_loss.py)
SHAPE_FACTORIES = frozenset({
    aten.ones_like.default, aten.zeros_like.default, aten.full_like.default,
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
})  # fmt: skip
VALUE_FREE = SHAPE_FACTORIES | {
    aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default,
}  # fmt: skip
# In-place ops that change a tensor's shape/strides, not its data, and their view forms. Torch's
# own decompositions use them on fresh intermediates (1-D @ 2-D matmul is
# `unsqueeze(0).mm(w).squeeze_(0)`); recording them in place would change the shape of the
# producing op's output after the fact, so they are recorded as the view op (Note [in-place
# metadata ops]).
_INPLACE_VIEWS = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.swapdims_.default: aten.transpose.int,
    aten.swapaxes_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
    aten.as_strided_.default: aten.as_strided.default,
}

# Note [saved results in second-order gradients]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Autograd saves an op's result for its backward (tanh's, exp's, softmax's) as a detached
# alias: that ``aten.detach`` reaches the recorder right after the op, from torch's C++, with
# no Python call of its own. When the engine later runs the backward with
# ``create_graph=True`` (``torch.autograd.grad`` in a forward: gradient penalties, physics
# losses on input derivatives), it unpacks the saved result with the op's own gradient
# function again, so the second-order gradient flows through it. Recorded as it reaches the
# recorder, the backward op would read the detached alias and that path would be lost. So a
# detach that no Python code asked for (``_DetachCalls`` counts the ``detach`` calls torch
# code makes, which do cut gradients) is remembered with its source, and an op recorded
# while the engine runs a backward with grad enabled reads the source instead.
_user_detaches = [0]  # Python-level detach calls in progress


class _DetachCalls(TorchFunctionMode):
    """Counts the ``detach`` calls of Python code (Note [saved results in second-order
    gradients])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in (torch.Tensor.detach, torch.detach):
            return func(*args, **(kwargs or {}))
        _user_detaches[0] += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            _user_detaches[0] -= 1


# Note [sparse embedding gradients]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``nn.Embedding(sparse=True)`` (and ``EmbeddingBag``) makes autograd produce a sparse COO
# gradient: the rows the batch looked up. A program's values are dense, and a dense gradient
# with zeros in the other rows holds the same numbers (SGD with or without momentum, Adagrad
# and the rest update every row from it as from the sparse one), so the capture records these
# ops with ``sparse=False``. The positional index of each op's ``sparse`` argument:
_SPARSE_ARG = {aten.embedding.default: 4, aten._embedding_bag.default: 5}


# Note [recorded views meet other layouts]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A graph's ops are recorded on fake tensors laid out contiguously, and torch's decompositions
# record ``aten.view`` wherever that layout allows one (``reshape``, a batched ``@``). The
# values a graph later runs on need not share that layout: a called graph receives whatever
# its caller computed (a query split after a transpose, in Graphcore's serialised attention),
# and under vmap a batched tensor has its own. Popxl tensors have no layout, so wherever such
# a view cannot be taken the same values are given by a copy; where it can, it is the view, so
# aliasing is kept wherever the program could observe it. Every replay of a recorded
# ``aten.view`` (the runtime's generated code, autodiff's replay) goes through ``view_or_copy``.
def view_or_copy(x: torch.Tensor, shape) -> torch.Tensor:
    """``aten.view`` of ``x`` as ``shape``, or the reshaped copy where ``x``'s layout allows no
    view (Note [recorded views meet other layouts])."""
    try:
        return aten.view.default(x, shape)
    except (RuntimeError, ValueError):  # eager tensors raise RuntimeError, fake ones ValueError
        return aten.reshape.default(x, shape)


# Outputs larger than this (elements in all) are not folded (Note [constant folding]).
_FOLD_LIMIT = 1 << 16


def _op_name(func) -> str:
    return str(getattr(func, "_opname", None) or getattr(func, "__name__", "op"))


class _Recorder(TorchDispatchMode):
    """Appends every dispatched op to ``graph``, mapping fake tensors to handles.

    ``new_tensors_of``: the ids of the handles a PopXL non-in-place op was given; a view op
    of one of them is recorded with ``new_tensors`` (Note [views of new tensors] in
    ir/views.py)."""

    def __init__(self, graph: Graph, on_unknown=None, new_tensors_of: frozenset[str] = frozenset()):
        super().__init__()
        self.graph = graph
        self.new_tensors_of = new_tensors_of
        # Note [no_grad in captured code]: torch code may compute part of its result under
        # ``torch.no_grad()`` (a scale it does not differentiate, spectral norm's power
        # iteration writing its buffers): eager autograd passes no gradient through those ops.
        # They are recorded with ``no_grad`` and autodiff replays them without a gradient. Only
        # relative to the grad mode the capture started in (popxl programs built under
        # no_grad differentiate as ever), and not inside torch's own autograd Functions
        # (``_inside_torch_function``: the reentrant checkpoint's forward).
        self._grad_at_start = torch.is_grad_enabled()
        # Called for fake inputs that are not handles of this graph (autodiff maps saved
        # forward tensors to grad-graph inputs this way). Returns a handle or None.
        self.on_unknown = on_unknown
        # id(fake) -> (weakref to it, its storage, its real value), for fakes whose value is
        # known at capture time (Note [constant folding]).
        self._values: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        # id(detached) -> (detached, source): results autograd saved for its backward
        # (Note [saved results in second-order gradients])
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT:
            folded = self._evaluate(func, args, kwargs)
            if folded is None:
                folded = self._read(func, args, kwargs)
            if folded is not None:
                return folded[0]
            raise DataDependentError(
                f"{func} needs the value of a tensor while the graph is being captured (for "
                "example `.item()`, `bool(t)` or `if t.sum() > 0:`). Tensor values are not "
                "known at capture time: express the choice with ops such as torch.where."
            )
        if func in _INPLACE_VIEWS:
            return self._inplace_view(func, args, kwargs)
        if func in _SPARSE_ARG:  # Note [sparse embedding gradients]
            args, kwargs = _dense_gradient(func, args, kwargs)
        if func in _CTC_LOSSES:  # Note [CTC loss in a captured graph] in opdefs/ctc.py
            return self._ctc_loss(args, kwargs)
        if func is aten.cat.default:
            args = (_without_legacy_empty(args[0]), *args[1:])
        if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
            mask = kwargs.get("attn_mask")
            if mask is not None and mask.dtype.is_floating_point and self._value_of(mask) is None:
                math_out = self._attention_math(args, kwargs)
                if math_out is not None:
                    return math_out
        try:
            out = func(*args, **kwargs)
        except torch._subclasses.fake_tensor.DynamicOutputShapeException as e:
            if func is aten.nonzero.default:
                found = self._nonzero_read(args, kwargs)
                if found is not None:
                    return found
            raise DataDependentError(
                f"{func}: the shape of its result depends on tensor values (for example "
                "nonzero, unique, or a boolean-mask selection outside a training loss), which "
                "are not known while the graph is captured; a popxl graph has static shapes. "
                "Keep shapes fixed: pad and mask (torch.where, a multiplication by the mask); "
                "a loss over x[mask] in popxl.compile and pack_padded_sequence into an RNN "
                "are captured so (Note [rows selected by a mask], Note [packed sequences in a "
                "captured graph])."
            ) from e
        if func in _CONSTANT_LIFTS:
            real = args[0]
            const = _constant_from_torch(self.graph, real, "constant")
            self.graph._rebind_fake(const, out)
            return out
        out_leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        mutable = func._schema.is_mutable if hasattr(func, "_schema") else False
        if not out_leaves and not mutable:
            return out
        self._record(func, args, kwargs, out)
        self._fold(func, args, kwargs, out, mutable)
        if func is aten.detach.default and not _user_detaches[0]:
            self._saved[id(out)] = (out, args[0])  # Note [saved results in second-order ...]
        return out

    def _unpacked(self, x):
        """``x`` as autograd's engine unpacks it for a backward op that builds a graph
        (Note [saved results in second-order gradients])."""
        # (unpacking detaches the saved alias again: follow the chain to the result)
        while (entry := self._saved.get(id(x))) is not None and entry[0] is x:
            x = entry[1]
        return x

    def _ctc_loss(self, args, kwargs):
        """``aten._ctc_loss`` recorded as ``torch_popxl::ctc_loss`` (Note [CTC loss in a
        captured graph] in opdefs/ctc.py); ``log_alpha``, which only torch's backward reads,
        is an unrecorded placeholder."""
        names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank",
                 "zero_infinity")  # fmt: skip
        a = {"blank": 0, "zero_infinity": False, **dict(zip(names, args, strict=False)), **kwargs}
        log_probs, targets = a["log_probs"], a["targets"]
        with _disable_current_modes():  # Python ints: real tensors, recorded as constants
            lengths = [x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.long)
                       for x in (a["input_lengths"], a["target_lengths"])]  # fmt: skip
        with self:
            nll = torch.ops.torch_popxl.ctc_loss(log_probs, targets, *lengths, a["blank"],
                                                 a["zero_infinity"])  # fmt: skip
        width = 2 * (targets.shape[1] if targets.dim() == 2 else targets.shape[0]) + 1
        log_alpha = log_probs.new_empty((log_probs.shape[1], log_probs.shape[0], width))
        return nll, log_alpha

    def _attention_math(self, args, kwargs):
        # Note [attention with a computed mask]: torch's CPU flash attention has no gradient
        # for `attn_mask`, and captured code has no requires_grad to tell torch's backend choice
        # that the mask needs one (T5's mask is its learned relative position bias). A float mask
        # computed in the program is captured as the math path's primitive ops instead (what
        # eager torch runs when the mask requires grad: scaled scores + mask, softmax, dropout,
        # weighted values). They are spelled as aten ops that reach this mode as themselves
        # (torch.matmul called here would be recorded whole and decompose only at replay). The
        # caller reads only the output: the logsumexp slot gets an unrecorded placeholder.
        q, k, v, *rest = args
        dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
        *batch, length, e = q.shape
        if is_causal or q.ndim != 4 or k.shape[:-1] != v.shape[:-1] or k.shape[:2] != q.shape[:2]:
            return None
        scale = kwargs.get("scale") or 1.0 / math.sqrt(e)
        bh = batch[0] * batch[1]
        with self:
            qs = aten.clone.default(
                aten.mul.Tensor(q, scale), memory_format=torch.contiguous_format
            )
            qs = aten.view.default(qs, [bh, length, e])
            kt = aten.clone.default(aten.transpose.int(k, -2, -1),
                                    memory_format=torch.contiguous_format)  # fmt: skip
            kt = aten.view.default(kt, [bh, e, k.shape[-2]])
            scores = aten.view.default(aten.bmm.default(qs, kt), [*batch, length, k.shape[-2]])
            weights = aten._softmax.default(aten.add.Tensor(scores, kwargs["attn_mask"]), -1,
                                            False)  # fmt: skip
            if dropout_p > 0:
                weights = aten.native_dropout.default(weights, dropout_p, True)[0]
            vv = aten.view.default(aten.clone.default(v, memory_format=torch.contiguous_format),
                                   [bh, v.shape[-2], v.shape[-1]])  # fmt: skip
            w3 = aten.view.default(weights, [bh, length, k.shape[-2]])
            out = aten.view.default(aten.bmm.default(w3, vv), [*batch, length, v.shape[-1]])
        # as torch's kernel makes it: float32 for 16-bit q, q's dtype otherwise (float64)
        lse = torch.empty((*batch, length), dtype=get_computation_dtype(q.dtype), device=q.device)
        return out, lse

    # Note [constant folding]
    # ~~~~~~~~~~~~~~~~~~~~~~~
    # Torch's own modules branch on values that only depend on constants: nn.TransformerEncoder
    # compares the mask it is given with a causal mask it builds (`bool((mask == causal).all())`,
    # `_detect_is_causal_mask`), both made from shapes by factory ops. Such a check is evaluated
    # at capture time, as eager torch would: the recorder keeps the real value of every small
    # tensor computed only from constants (factory ops, lifted constants, graph constants, and
    # deterministic ops on those), and a data-dependent op (`.item()`, `bool(t)`) whose inputs
    # all have known values returns the real answer instead of raising. The ops are still
    # recorded as usual (the graph computes them too); only the Python value is folded. A
    # mutating op forgets every known value sharing storage with a tensor it is given (a view
    # or its base may have changed); random ops, ops outside aten (torch_popxl's collectives
    # and remote ops need the runtime) and large outputs are never folded.

    def _value_of(self, x: torch.Tensor) -> torch.Tensor | None:
        entry = self._values.get(id(x))
        if entry is not None and entry[0]() is x:
            return entry[2]
        handle = self.graph._tensor_for_fake(x)
        if isinstance(handle, Constant):
            return handle._data
        constant = getattr(x, "constant", None)
        if constant is not None:
            return constant
        if handle is None and not isinstance(x, torch._subclasses.fake_tensor.FakeTensor):
            return x
        return None

    def _evaluate(self, func, args, kwargs):
        """``(func's real result,)`` when every tensor it reads has a known value, else None.
        A factory that reads only its argument's shape (``ones_like(x)``: a variance of ones
        that ``gaussian_nll_loss`` checks) has a known value whatever ``x`` holds."""
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        values = {id(x): self._value_of(x) for x in leaves}
        stand_in = func in SHAPE_FACTORIES and values.get(id(args[0]), 0) is None
        if stand_in:
            del values[id(args[0])]
        if any(v is None for v in values.values()):
            return None

        def real(x):
            return values[id(x)] if isinstance(x, torch.Tensor) else x

        with _disable_current_modes():
            if stand_in:
                values[id(args[0])] = torch.zeros(args[0].shape, dtype=args[0].dtype)
            return (func(*pytree.tree_map(real, args), **pytree.tree_map(real, kwargs)),)

    def _read(self, func, args, kwargs):
        """``(the value read,)`` from the reader registered for this graph (Note [values read
        on real data]), or None where none is."""
        read = next((r for g, r in reversed(_readers) if g is self.graph), None)
        if read is None:
            return None
        handles = pytree.tree_map(
            lambda x: self._handle_for(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
        )
        with _disable_current_modes(), torch.no_grad():
            return (read(func, *handles),)

    def _nonzero_read(self, args, kwargs):
        """``nonzero`` as ``nonzero_static`` of the size the reader for this graph reads, or
        None without a reader (Note [values read on real data]). (``_local_scalar_dense``
        itself: ``Tensor.item`` would reach this mode whole.)"""
        if not any(g is self.graph for g, _ in _readers):
            return None
        x = args[0] if args else kwargs["self"]
        with self:
            n = int(aten._local_scalar_dense.default(aten.sum.default(aten.ne.Scalar(x, 0))))
            return aten.nonzero_static.default(x, size=n)

    def _fold(self, func, args, kwargs, out, mutable: bool) -> None:
        if mutable:
            written = {
                x.untyped_storage()._cdata
                for x in pytree.tree_leaves((args, kwargs))
                if isinstance(x, torch.Tensor)
            }
            self._values = {k: v for k, v in self._values.items() if v[1] not in written}
            return
        # Only aten's own ops: torch_popxl's (collectives, remote memory) need the runtime.
        if getattr(func, "namespace", None) != "aten":
            return
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            return
        fakes = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        if sum(x.numel() for x in fakes) > _FOLD_LIMIT:
            return
        folded = self._evaluate(func, args, kwargs)
        if folded is None:
            return
        reals = [x for x in pytree.tree_leaves(folded[0]) if isinstance(x, torch.Tensor)]
        if len(reals) != len(fakes):
            return
        for fake, value in zip(fakes, reals, strict=True):
            storage = fake.untyped_storage()._cdata
            self._values[id(fake)] = (weakref.ref(fake), storage, value)

    def _inplace_view(self, func, args, kwargs):
        # Note [in-place metadata ops]: the caller holds `self` and expects it reshaped in place
        # (an in-place op's return value is ignored), so the fake object itself must mutate. The
        # handle it belonged to keeps its old metadata on a fresh fake, and the mutated object
        # becomes the output of a recorded out-of-place view op.
        target = args[0]
        before = self._handle_for(target)
        kept = torch.empty_strided(
            target.shape, target.stride(), dtype=target.dtype, device=target.device
        )
        before._fake = kept
        self.graph._rebind_fake(before, kept)
        self.graph._unbind_fake(target)
        view = _INPLACE_VIEWS[func]
        func(*args, **kwargs)
        fargs = (kept, *args[1:])
        self._record(view, fargs, kwargs, target)
        return target

    def _handle_for(self, fake: torch.Tensor) -> Tensor:
        t = self.graph._tensor_for_fake(fake)
        if t is not None:
            return t
        if self.on_unknown is not None:
            t = self.on_unknown(fake)
            if t is not None:
                return t
        constant = getattr(fake, "constant", None)
        if constant is not None:
            t = _constant_from_torch(self.graph, constant, "constant")
            self.graph._rebind_fake(t, fake)
            return t
        if not isinstance(fake, torch._subclasses.fake_tensor.FakeTensor):
            t = _constant_from_torch(self.graph, fake, "constant")
            self.graph._rebind_fake(t, fake)
            return t
        raise RuntimeError(
            f"A tensor of shape {tuple(fake.shape)} used by the captured code does not belong "
            f"to graph {self.graph.id!r}. Tensors from another graph must be passed in as "
            "graph inputs (popxl.graph_input / create_graph arguments)."
        )

    def _record(self, func, args, kwargs, out) -> None:
        inputs: list[Tensor] = []
        slot_of: dict[str, int] = {}
        # Note [saved results in second-order gradients]: a backward that builds a graph
        unpacking = torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()

        def to_slot(x):
            if not isinstance(x, torch.Tensor):
                return x
            t = self._handle_for(self._unpacked(x) if unpacking else x)
            if t.id not in slot_of:
                slot_of[t.id] = len(inputs)
                inputs.append(t)
            return Slot(slot_of[t.id])

        args_t = pytree.tree_map(to_slot, list(args))
        kwargs_t = pytree.tree_map(to_slot, dict(kwargs))
        outputs: list[Tensor] = []
        paths: list[tuple] = []
        name = _op_name(func)
        for path, leaf in _tensor_leaves_with_paths(out):
            existing = self.graph._tensor_for_fake(leaf)
            if existing is None:
                existing = Tensor._create(self.graph, name, leaf)
            outputs.append(existing)
            paths.append(path)
        op = Op(
            kind=OpKind.TORCH,
            name=str(func),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            attrs=TorchCall(
                func,
                tuple(args_t),
                kwargs_t,
                tuple(paths),
                no_grad=self._grad_at_start
                and not torch.is_grad_enabled()
                and not _inside_torch_function[0],
                new_tensors=bool(self.new_tensors_of)
                and _views_of(func, args_t, inputs, self.new_tensors_of),
            ),
        )
        self.graph._append_op(op)


def _views_of(func, args, inputs: list[Tensor], given: frozenset[str]) -> bool:
    """Whether ``func`` is a view op (its schema returns an alias and writes nothing) whose
    aliased argument is one of the handles in ``given`` (Note [views of new tensors])."""
    schema = getattr(func, "_schema", None)
    if schema is None or not any(r.alias_info is not None for r in schema.returns):
        return False
    aliased = [(i, a.alias_info) for i, a in enumerate(schema.arguments) if a.alias_info]
    if any(info.is_write for _, info in aliased):
        return False
    return any(i < len(args) and isinstance(args[i], Slot) and inputs[args[i].index].id in given
               for i, _ in aliased)  # fmt: skip


def _without_legacy_empty(tensors):
    """``torch.cat``'s inputs without the 1-D empty tensors it skips.

    torch.cat accepts a shape-(0,) tensor next to tensors of any rank and ignores it (a legacy
    rule; Hugging Face's DynamicCache starts each layer's keys and values as ``torch.tensor([])``
    and concatenates onto them). The rule only holds for exactly that shape: once the program
    gives the empty constant a replica dimension (2, 0) the cat would fail, so it is not
    recorded at all (the result is the same)."""
    kept = [t for t in tensors if not (isinstance(t, torch.Tensor) and t.shape == (0,))]
    if not kept or all(t.ndim == 1 for t in kept):
        return tensors
    return type(tensors)(kept) if isinstance(tensors, list | tuple) else kept


def _tensor_leaves_with_paths(out, prefix=()):
    if isinstance(out, torch.Tensor):
        yield prefix, out
    elif isinstance(out, list | tuple):
        for i, x in enumerate(out):
            yield from _tensor_leaves_with_paths(x, (*prefix, i))


# Note [values read on real data]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A data-dependent op (`.item()`, `bool(t)`, `torch.equal`) whose value constant folding cannot
# give raises DataDependentError, unless whoever builds the graph has real data for it and
# registered a reader for the graph (``values_read_by``): the reader is given the op and its
# arguments as handles of the graph, evaluates them on that data and answers with the Python
# value, which the captured code then goes on with. The builder must make the program check
# that value when it runs (popxl.compile's guards: Note [guarded specialisation] in
# compile_guards.py). Reads inside another graph (a subgraph being recorded) are not answered.
# ``nonzero``, whose result's shape is its count of nonzero elements, is answered the same
# way: the count is read (``sum(x != 0).item()``, recorded, so the builder's check covers it)
# and the op recorded as ``nonzero_static`` of that size (Longformer's global attention
# indices), a static shape for as long as the count stays the same.
_readers: list[tuple[Graph, Callable[..., Any]]] = []


@contextlib.contextmanager
def values_read_by(graph: Graph, read: Callable[..., Any]) -> Iterator[None]:
    """Reads of tensor values in ``graph`` while capturing are answered by ``read(func, args,
    kwargs)``, with the tensors as ``graph``'s handles (Note [values read on real data])."""
    _readers.append((graph, read))
    try:
        yield
    finally:
        _readers.pop()


@contextlib.contextmanager
def record_into(graph: Graph, on_unknown=None,
                new_tensors_of: frozenset[str] = frozenset()) -> Iterator[None]:  # fmt: skip
    """Record all torch ops run inside into ``graph`` (fake mode + recorder); views of the
    handles ``new_tensors_of`` are new tensors (Note [views of new tensors])."""
    # oneDNN off (Note [no oneDNN in captured code]).
    recorder = _Recorder(graph, on_unknown, new_tensors_of)
    with (
        _onednn_off(),
        _distribution_checks_off(),  # Note [argument checks of torch.distributions]
        fake_mode(),
        recorder,
        _functions_recorded_by(recorder),
        _DetachCalls(),  # Note [saved results in second-order gradients]
        PackedRNN(),  # Note [packed sequences in a captured graph]
        _conversions_in_place(),  # Note [module conversions in captured code]
    ):
        yield


# Note [module conversions in captured code]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Model code converts modules while it runs: SwitchTransformers' router runs
# ``self.classifier = self.classifier.to(self.dtype)`` in every forward, which in eager torch
# changes nothing when the classifier has that dtype already (``Tensor.to`` returns the
# parameter itself). Captured, the module holds the capture's fake tensors, and
# ``Module._apply`` swaps every fake parameter with its converted copy
# (``torch.utils.swap_tensors``, which it always uses for fakes), even where that copy is the
# parameter itself; torch refuses the swap ("Couldn't swap Linear.weight": the parameter is
# referenced elsewhere). While something records, a parameter whose conversion gives back the
# parameter itself stays as it is, as in eager torch, and the rest of ``_apply`` runs as
# torch's. A conversion that changes a captured parameter (``.half()`` of a float32 module
# in its forward) is refused naming it: eager torch would convert the module's parameter in
# place for the steps after, which a program built once does not do.
_module_apply = torch.nn.Module._apply


def _apply_keeping_fakes(module: torch.nn.Module, fn, recurse: bool = True):
    saved = dict(module._parameters)
    fakes = [k for k, p in saved.items() if isinstance(p, FakeTensor)]
    if not fakes:
        return _module_apply(module, fn, recurse)
    for key in fakes:
        p = saved[key]
        assert p is not None
        with torch.no_grad():
            converted = fn(p)
        if converted is not p:
            raise ValueError(
                f"captured code converts parameter {key!r} of a {type(module).__name__} "
                f"({p.dtype}, {p.device}) to {converted.dtype} on {converted.device} (module.to, "
                ".half, .cuda, ...: Note [module conversions in captured code]); a program "
                "keeps its parameters' dtype and device. Convert the model before the program "
                "is built (model.to(...) before popxl.compile), or convert the inputs instead."
            )
    for key in fakes:
        del module._parameters[key]
    try:
        _module_apply(module, fn, recurse)
    finally:
        rest = dict(module._parameters)
        module._parameters.clear()
        module._parameters.update({k: saved[k] if k in fakes else rest[k] for k in saved})
    return module


@contextlib.contextmanager
def _conversions_in_place() -> Iterator[None]:
    """Note [module conversions in captured code], while inside."""
    before = torch.nn.Module._apply  # (captures nest: the outer one's stays)
    torch.nn.Module._apply = _apply_keeping_fakes  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module._apply = before  # type: ignore[method-assign]


# Note [argument checks of torch.distributions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.distributions checks the values of a distribution's parameters and samples by default
# (``Normal(mu, std)`` raises if a ``std`` is not positive: ``if not valid.all(): raise``), a
# check on data that a captured graph cannot make while it is built. A VAE's posterior or a
# policy's ``Categorical`` built in a forward is captured with the checks off (as ``python -O``
# runs torch), so invalid values give NaN instead of a ValueError; a distribution made with
# ``validate_args=True`` explicitly still raises ``DataDependentError``.
@contextlib.contextmanager
def _distribution_checks_off() -> Iterator[None]:
    dist = torch.distributions.Distribution
    before = dist._validate_args
    dist.set_default_validate_args(False)
    try:
        yield
    finally:
        dist.set_default_validate_args(before)


# ---- custom autograd Functions (Note [custom autograd Functions], transforms/functions.py) ----
#
# ``Fn.apply`` is torch's C++ code (and a program may hold it bound: ``ste = STE.apply``), but
# it calls ``Fn.forward`` (and ``Fn.setup_context``) by name. While something records, every
# Function class of the program's own (those that exist when recording starts, and those
# created during it) has them replaced by hooks that hand the call to the handler, which
# records the Function with its backward; they are put back when recording ends.

# (recorder, cls, forward, setup_context or None, args, kwargs) -> outputs; set by
# transforms/functions.py.
_function_handler: Callable[..., Any] | None = None
_recording: list[_Recorder] = []  # the recorders in use, innermost last
# class -> (its own "forward", "setup_context" entries or None, the resolved functions)
_hooked: dict[type, tuple[Any, Any, Callable, Callable | None]] = {}
_skip_setup: list[bool] = [False]  # the handler ran setup_context already


def handle_functions(handler: Callable[..., Any]) -> None:
    """Route custom autograd Functions run in captured code to ``handler``."""
    global _function_handler
    _function_handler = handler
    _find_users_classes()
    torch.autograd.function.FunctionMeta.__init__ = _meta_init  # type: ignore[method-assign]


def _is_users(cls) -> bool:
    """A Function of the program's own, not torch's or torch_popxl's (``torch.utils.checkpoint``
    is differentiated through its ops)."""
    module = getattr(cls, "__module__", "") or ""
    return not module.startswith(("torch.", "torch_popxl."))


def _has_setup_context(cls) -> bool:
    return torch.autograd.function._is_setup_context_defined(cls.setup_context)


def _hook(cls) -> None:
    if cls in _hooked or not _is_users(cls) or _function_handler is None:
        return
    setup = cls.setup_context if _has_setup_context(cls) else None
    _hooked[cls] = (cls.__dict__.get("forward"), cls.__dict__.get("setup_context"),
                    cls.forward, setup)  # fmt: skip

    def forward(*args, **kwargs):
        _, _, fwd, setup_context = _hooked[cls]
        if not _recording:  # called outside recording (cannot happen while hooked)
            return fwd(*args, **kwargs)
        if setup_context is None:
            args = args[1:]  # torch's ctx: the handler fills its own
        result = _function_handler(_recording[-1], cls, fwd, setup_context, args, kwargs)
        _skip_setup[0] = setup_context is not None
        return result

    cls.forward = staticmethod(forward)
    if setup is not None:

        def setup_context(ctx, inputs, output):
            if _skip_setup[0]:  # torch's own call after the hooked forward
                _skip_setup[0] = False
                return None
            return _hooked[cls][3](ctx, inputs, output)

        cls.setup_context = staticmethod(setup_context)


def _unhook_all() -> None:
    for cls, (own_forward, own_setup, _, setup) in _hooked.items():
        for name, own in (("forward", own_forward), ("setup_context", own_setup)):
            if name == "setup_context" and setup is None:
                continue
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
    _hooked.clear()


# The program's own Function classes: those that existed when the handler was set and every
# one created since (torch's metaclass tells), so recording need not search torch's classes.
_users_classes: weakref.WeakSet = weakref.WeakSet()
_META_INIT = torch.autograd.function.FunctionMeta.__init__


def _meta_init(cls, name, bases, attrs):
    _META_INIT(cls, name, bases, attrs)
    if _is_users(cls):
        _users_classes.add(cls)
        if _recording:
            _hook(cls)


# Torch's own Functions run their forward without grad (C++ ``apply``; the reentrant
# checkpoint says ``torch.no_grad()`` itself): that is how a Function works, not a choice of
# the program, so their ops are differentiated (not marked ``no_grad``: Note [no_grad in
# captured code]) while ``_inside_torch_function`` counts the calls in progress.
_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]
_inside_torch_function = [0]


def _apply(cls, *args, **kwargs):
    apply = _FUNCTION_APPLY.__get__(None, cls)
    if _is_users(cls):  # its forward is hooked
        return apply(*args, **kwargs)
    _inside_torch_function[0] += 1
    try:
        return apply(*args, **kwargs)
    finally:
        _inside_torch_function[0] -= 1


def _find_users_classes() -> None:
    todo, seen = list(torch.autograd.Function.__subclasses__()), set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        if _is_users(cls):
            _users_classes.add(cls)


@contextlib.contextmanager
def _functions_recorded_by(recorder: _Recorder) -> Iterator[None]:
    """Custom Functions go to the handler while ``recorder`` records."""
    first = not _recording
    if first:
        for cls in list(_users_classes):
            _hook(cls)
        torch.autograd.Function.apply = classmethod(_apply)
    _recording.append(recorder)
    try:
        yield
    finally:
        _recording.pop()
        if first:
            torch.autograd.Function.apply = _FUNCTION_APPLY
            _unhook_all()


@contextlib.contextmanager
def recording_instead(old: _Recorder, graph: Graph, on_unknown, *,
                      keep_above: bool) -> Iterator[None]:  # fmt: skip
    """Record into ``graph`` where ``old`` recorded: a new recorder takes ``old``'s place on
    the dispatch-mode stack. The modes above it (a loss splitter following batch data) keep
    seeing the ops with ``keep_above``; without, they are set aside until the end."""
    stack = _get_current_dispatch_mode_stack()
    if old not in stack:
        raise AssertionError("the recorder to replace is not on the dispatch-mode stack")
    above = []
    while (mode := _pop_mode()) is not old:
        above.append(mode)
    new = _Recorder(graph, on_unknown)
    _push_mode(new)
    if keep_above:
        for mode in reversed(above):
            _push_mode(mode)
    try:
        with graph, _functions_recorded_by(new), in_torch_order():
            yield
    finally:
        if keep_above:
            for _ in above:
                _pop_mode()
        _pop_mode()
        _push_mode(old)
        for mode in reversed(above):
            _push_mode(mode)


@contextlib.contextmanager
def modes_set_aside() -> Iterator[None]:
    """No torch dispatch mode but fake mode (graph building from inside captured code)."""
    modes = []
    while (stack := _get_current_dispatch_mode_stack()) and not isinstance(
        stack[-1], torch._subclasses.fake_tensor.FakeTensorMode
    ):
        modes.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(modes):
            _push_mode(mode)


@contextlib.contextmanager
def _onednn_off() -> Iterator[None]:
    # Only the enabled flag: torch.backends.mkldnn.flags() also sets TF32 flags, which warns on
    # builds without Intel GPU support.
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


# Note [no oneDNN in captured code]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some composite torch ops pick a oneDNN (mkldnn) kernel on CPU when it is enabled: nn.LSTM runs
# `aten.mkldnn_rnn_layer`, whose workspace output has a size on fake tensors (0) other than the
# real one, so a program that runs it per replica fails ("shape '[2, 0]' is invalid"). Captured
# with oneDNN disabled these ops decompose into ordinary aten ops
# (LSTM into its cell's matmuls and pointwise ops), which the runtime batches over replicas and
# autodiff differentiates like any other. Ops recorded as themselves (convolution, matmul) still
# pick their kernels when the program runs, with the flags the user has then.


# ---- the __torch_function__ entry point ---------------------------------------------------


def _param_variable(graph: Graph, p: torch.Tensor) -> Tensor:
    """A module parameter used in a graph becomes (once per Ir) a main-graph variable."""

    ir = graph.ir
    cached = ir._param_variables.get(id(p))
    if cached is not None and cached[0]() is p:
        return cached[1]
    if not graph._is_main:
        raise ValueError(
            f"A torch.nn.Parameter of shape {tuple(p.shape)} is used inside subgraph "
            f"{graph.id!r}. Variables only exist in the main graph: run the module in the main "
            "graph, or pass the weight in as a graph input."
        )
    v = variable(p.detach().cpu(), dtype=p.dtype, name=_param_name(p))
    ir._param_variables[id(p)] = (weakref.ref(p), v)
    return v


def _param_name(p) -> str:
    return getattr(p, "_popxl_name", None) or "param"


def _to_fake(graph: Graph, x: Any) -> Any:
    if isinstance(x, Tensor):
        if x._graph is not graph:
            where = "another Ir" if x._graph.ir is not graph.ir else f"graph {x._graph.id!r}"
            raise ValueError(
                f"Tensor {x.id!r} belongs to {where}, but the op is being created in graph "
                f"{graph.id!r}. Pass it in as an input of {graph.id!r} instead."
            )
        return x._fake
    if isinstance(x, torch.nn.Parameter):
        return _param_variable(graph, x)._fake
    if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.fake_tensor.FakeTensor):
        return _constant_from_torch(graph, x)._fake
    return x


def _from_fake(graph: Graph, x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        t = graph._tensor_for_fake(x)
        if t is None:
            raise RuntimeError(f"Captured code returned a tensor that is not part of {graph.id!r}.")
        return t
    return x


def _dense_gradient(func, args, kwargs):
    """``func``'s arguments with ``sparse=False`` (Note [sparse embedding gradients])."""
    i = _SPARSE_ARG[func]
    if "sparse" in kwargs:
        return args, {**kwargs, "sparse": False}
    if len(args) > i:
        return (*args[:i], False, *args[i + 1 :]), kwargs
    return args, kwargs


def call_torch(func, args, kwargs, *, new_tensors: bool = False) -> Any:
    """Run a torch callable on popxl handles in the current graph and record it.

    With torch's semantics a view it returns aliases its source. ``new_tensors``: ``func``
    is one of PopXL's non-in-place ops, whose results are new tensors: a view of a handle it
    was given is recorded as such, and a handle it returns unchanged (``Tensor.to`` its own
    dtype) comes back as a new tensor (Note [views of new tensors] in ir/views.py)."""
    graph = gcg()
    given = frozenset(
        x.id for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor)
    ) if new_tensors else frozenset()  # fmt: skip
    fargs = pytree.tree_map(lambda x: _to_fake(graph, x), args)
    fkwargs = pytree.tree_map(lambda x: _to_fake(graph, x), kwargs)
    first = len(graph._ops)
    before = _host_draws()
    with record_into(graph, new_tensors_of=given), in_torch_order():
        result = func(*fargs, **fkwargs)
        if given:
            result = pytree.tree_map(lambda x: _unless_given(graph, x, given, first), result)
    if _host_draws() != before:
        raise _host_random_error(func)
    return pytree.tree_map(lambda x: _from_fake(graph, x), result)


def _unless_given(graph: Graph, x: Any, given: frozenset[str], first: int) -> Any:
    """``x``, or a new-tensor view of it where it is a handle a PopXL non-in-place op was
    given and returns unchanged (an in-place op, which writes it, returns its input)."""
    if not isinstance(x, torch.Tensor):
        return x
    t = graph._tensor_for_fake(x)
    if t is None or t.id not in given:
        return x
    if any(t in op.outputs for op in graph._ops[first:]):
        return x
    return aten.alias.default(x)


# Note [Python random numbers in captured code]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Captured code runs once, while its program is built, and the program repeats what it
# recorded. A draw from Python's ``random`` or numpy's global generator inside it (seq2seq's
# teacher forcing, ``if random.random() < ratio:``) would be the value drawn at build time at
# every step, where eager torch draws anew each time. So a capture that moves either
# generator is refused, naming the way out: draw on the host and pass the value in (a Python
# value in a dict of inputs is a keyword option, with a program per value: Note [keyword
# options]), or draw with torch (``torch.rand``), whose draws the program makes at every
# step. Only the generators' positions are compared (before and after), not each call.
def _host_draws() -> tuple:
    """Where Python's and numpy's global generators stand."""
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple)  # (the legacy form; the dict form is the other)
    _, keys, pos, has_gauss, _ = state
    return random.getstate(), pos, has_gauss, hash(keys.tobytes())


def _host_random_error(func) -> DataDependentError:
    name = getattr(func, "__qualname__", None) or type(func).__name__
    return DataDependentError(
        f"captured code ({name}) draws from Python's `random` or numpy's global generator; "
        "the compiled program would repeat the value drawn now at every step, where eager torch "
        "draws anew (Note [Python random numbers in captured code]). Draw it on the host and "
        "pass it in (e.g. trainer.step({'x': x, 'teacher_forcing': random.random() < 0.5}, y): "
        "a Python value in a dict of inputs selects a program per value), or draw with torch "
        "(torch.rand(()) < 0.5 with torch.where), which the program draws at every step."
    )


def in_torch_order() -> contextlib.AbstractContextManager:
    """The ops recorded inside keep the order torch ran them in (Note [torch code runs in
    order]), unless an enclosing ``in_sequence`` decides the order."""
    return in_sequence(True) if in_sequence_mode() is None else contextlib.nullcontext()


# Note [torch code runs in order]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# One torch call may record several ops where torch's own code reads a value and then updates
# it in place (quantile: `below = ranks.long(); ranks.ceil_()`; feature_alpha_dropout; cumprod's
# gradient). torch ran them in that order, so they are recorded in sequence: the in-place
# ambiguity check (Note [in-place ambiguity], ir/inplace.py) is for ops a user leaves
# unordered, not for the inside of one torch function. Only those ops are ordered (a chain of
# their own); under a caller's in_sequence (``'pass'`` included: no constraint at all) the
# caller's constraints apply, as before.
