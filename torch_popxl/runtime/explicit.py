"""Explicit batching: replicated programs without ``vmap`` when every op allows it.

Note [explicit batching]
    Under ``torch.func.vmap`` every op pays a dispatch cost (tens of µs) on top of its maths,
    which dominates small replicated programs. The compiler already knows, statically, which
    values are batched (one row per replica, ``[R, *shape]``) and which are replica-invariant
    (stored once). For a small, common set of ops the stacked form is a direct rewrite —
    elementwise ops broadcast as they do per replica once a batched operand of lower rank
    gets unit dims after the replica dim (Note [broadcasting on stacked values]); ``mm`` becomes ``matmul``/``bmm``; ops
    taking a ``dim`` shift it past the replica dimension. A ``torch_popxl`` op brings its own
    rule: its definition's ``explicit`` rule (``opdefs/registry.py``) says whether it has a
    stacked form for the given batched inputs and returns the callable that runs it (a
    full-group all-reduce is one call of the stacked kernel). An aten op without a rule runs
    alone through torch's batching rule (Note [one op through torch's batching rule]). When
    every op of a fragment has a rule or that form the fragment is emitted in this form and
    runs on the physical stacked tensors with no ``vmap``; otherwise the whole fragment runs
    under ``vmap`` as before. The reference executor checks both.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._decomp import decomposition_table
from torch._subclasses.fake_impls import _like_tensor_constructors
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _disable_current_modes

from .. import opdefs
from ..ir.fake import trace_fake
from ..ir.graph import Op, Slot
from ..ir.walk import effects
from ..opdefs.aten_batching import COVERED
from .gemm import gemm

__all__ = [
    "ELEMENTWISE",
    "SAFE_FORMS",
    "PER_ELEMENT",
    "batchable",
    "draws_random",
    "element_inputs",
    "emit_torch",
    "FoldPlan",
    "fold_plan",
    "is_random",
    "opdef_rule",
    "per_element_ok",
    "per_element_stacked",
    "rank_padding",
    "scalar_tensor_args",
    "vmap_reason",
]

aten = torch.ops.aten
_DEBUG = False


# Note [elementwise ops from torch's facts]
#     An op computed element by element with broadcasting runs on stacked values as it does
#     per replica (Note [broadcasting on stacked values]). torch enumerates most such ops: it
#     tags them ``pointwise``. For the others this module derives the fact from what torch
#     declares about the op, once per overload (``_derive_elementwise``), in this order:
#     * torch's factories shaped like their input (``empty_like``, ``zeros_like``, ...; the
#       fake-tensor table ``_like_tensor_constructors``): they read only the input's shape,
#       dtype and device, so on stacked values they make the stacked result;
#     * an in-place overload (its schema writes ``self``: ``hardswish_``, ``mish_``,
#       ``fill_.Scalar``) is elementwise when its functional overload (the same name without
#       ``_``) is;
#     * an overload that differs from an elementwise sibling only in taking a Tensor where the
#       sibling takes a Scalar (``masked_fill.Tensor``): elementwise, with those tensors 0-d
#       by torch's contract, so they must be the same on every replica
#       (``scalar_tensor_args``; a per-replica one goes through torch's batching rule);
#     * an overload whose decomposition in torch's table (``torch._decomp``: ``hardswish``,
#       the activation gradients) traces, on tiny tensors, into elementwise ops and 0-d
#       constants only: a composition of elementwise ops is elementwise.
#     The decomposition is torch's declaration that the op equals that composition; nothing is
#     inferred from values. ``_NO_FACTS`` lists the ops torch gives none of these facts for.


_NO_FACTS = frozenset({
    # copy_(self, src) broadcasts src into self: torch neither tags it nor decomposes it
    aten.copy_.default,
    # torch 2.14 has no decomposition for these two activation gradients (their forward
    # ops and every other activation gradient have one)
    aten.hardshrink_backward.default, aten.softshrink_backward.default,
})  # fmt: skip
_LIKE_FACTORIES = frozenset(  # without a ``size``: shaped like their input
    op
    for op in _like_tensor_constructors
    if torch.Tag.nondeterministic_seeded not in op.tags
    and not any(a.name == "size" for a in op._schema.arguments)
)
_CONSTANTS = frozenset({aten.scalar_tensor.default})  # 0-d: broadcast like a Scalar
_known: dict = {}  # overload -> whether it is elementwise (False while being derived)


def _is_elementwise(target) -> bool:
    """Whether ``target`` is computed element by element with broadcasting (Note
    [elementwise ops from torch's facts])."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target not in _known:
        _known[target] = False  # a decomposition that reaches the op itself proves nothing
        _known[target] = _derive_elementwise(target)
    return _known[target]


def _derive_elementwise(target: torch._ops.OpOverload) -> bool:
    if any(a.is_out for a in target._schema.arguments):
        return False  # an ``out=`` form: the captured programs call the functional ones
    if torch.Tag.pointwise in target.tags or target in _LIKE_FACTORIES or target in _NO_FACTS:
        return True
    if target.namespace == "prims":  # a prim is elementwise where its aten namesake is
        packet = getattr(aten, target._schema.name.split("::")[-1], None)
        return packet is not None and any(
            torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()
        )
    functional = _functional_form(target)
    if functional is not None:
        return _is_elementwise(functional)
    if _scalar_sibling(target) is not None:
        return True
    return _decomposes_elementwise(target)


def _functional_form(target):
    """The functional overload of an in-place aten overload (``add_.Tensor`` ->
    ``add.Tensor``), or None."""
    name = target._schema.name.split("::")[-1]
    first = target._schema.arguments[0].alias_info if target._schema.arguments else None
    # in place: writes its first argument (the schema's fact; torch < 2.12 has no Tag.inplace)
    if first is None or not first.is_write or not name.endswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    overload = target._overloadname
    return getattr(packet, overload, None) if packet is not None else None


def _scalar_sibling(target):
    """The argument positions where ``target`` takes a Tensor and an overload of the same op
    tagged pointwise takes a Scalar, all other argument types equal; None when there is no
    such sibling."""
    packet = getattr(aten, target._schema.name.split("::")[-1], None)
    if packet is None:
        return None
    mine = [str(a.type) for a in target._schema.arguments]
    for name in packet.overloads():
        sibling = getattr(packet, name)
        if sibling is target or torch.Tag.pointwise not in sibling.tags:
            continue
        theirs = [str(a.type) for a in sibling._schema.arguments]
        if len(theirs) != len(mine):
            continue
        swapped = [i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]
        if swapped and all(mine[i] == "Tensor" and theirs[i] in _SCALARS for i in swapped):
            return tuple(swapped)
    return None


def scalar_tensor_args(target) -> tuple[int, ...]:
    """The positions of ``target``'s 0-d tensor arguments that stand for a Scalar (Note
    [elementwise ops from torch's facts]): one value for every replica on stacked values."""
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return ()
    return _scalar_sibling(target) or ()


_SCALARS = ("Scalar", "number")  # how a schema prints a Scalar argument
_PROBE_VALUES = {"Scalar": (0.5,), "number": (0.5,), "float": (0.5,), "bool": (False, True)}
_PROBE_SHAPES = ((2, 3), (4, 1, 5))


def _decomposes_elementwise(target) -> bool:
    """Whether torch's decomposition of ``target`` traces into elementwise ops and 0-d
    constants only, the same code for tensors of two shapes (a constant computed from a shape,
    as a mean's ``1 / numel``, is not elementwise) and for either value of every bool argument.
    The other required arguments must be numbers (an int may select a reduction)."""
    fn = decomposition_table.get(target)
    if fn is None:
        return False
    choices: list[tuple[float | bool | None, ...]] = []
    for a in target._schema.arguments:
        if a.has_default_value() or str(a.type).endswith("?"):
            break
        kind = str(a.type)
        if kind == "Tensor":
            choices.append((None,))  # a probe tensor
        elif kind in _PROBE_VALUES:
            choices.append(_PROBE_VALUES[kind])
        else:
            return False
    for values in itertools.product(*choices):
        codes = {_probe_code(fn, values, shape) for shape in _PROBE_SHAPES}
        if len(codes) != 1 or None in codes:
            return False
    return True


def _probe_code(fn, values, shape) -> str | None:
    """The code of ``fn`` traced on ``values`` (None: a float tensor of ``shape``) when every
    op it calls is elementwise or a 0-d constant; None otherwise."""

    def call(*ts):
        it = iter(ts)
        return fn(*[next(it) if v is None else v for v in values])

    # outside any mode of the caller's (a fake or tracing mode), drawing no random numbers
    with _disable_current_modes():
        tensors = [torch.full(shape, 0.5) for v in values if v is None]
        try:
            graph = make_fx(call)(*tensors)
        except Exception:  # noqa: BLE001 - the probe's arguments do not fit: no fact derived
            return None
    nodes = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    if not nodes or not all(t in _CONSTANTS or _is_elementwise(t) for t in nodes):
        return None
    return graph.code


class _Elementwise:
    """The ops computed element by element with broadcasting (Note [elementwise ops from
    torch's facts]). On stacked values they broadcast as they do per replica (Note
    [broadcasting on stacked values])."""

    def __contains__(self, target) -> bool:
        return _is_elementwise(target)


ELEMENTWISE = _ELEMENTWISE = _Elementwise()
# Note [random ops on stacked rows]
#     Random ops whose every output element is an independent draw (given its own element of
#     the parameters) draw every replica's values in one call on the stacked rows: replicas
#     draw independently from the same distribution, which is what the reference executor
#     defines (tests/test_random_replicas.py checks it statistically; the values differ from
#     a per-replica loop's, as vmap's do). A replica-invariant operand is expanded to the rows
#     first, so the call draws a value per row. Ops whose draws depend on each other
#     (multinomial without replacement, randperm) keep the per-replica path.
_RANDOM_ELEMENTWISE = {
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
    aten.randint_like.low_dtype, aten.bernoulli.default, aten.bernoulli.p,
    aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.native_dropout.default,
    aten.uniform_.default, aten.normal_.default, aten.exponential_.default,
    aten.poisson.default, aten.normal.Tensor_float, aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor, aten.cauchy_.default, aten.geometric_.default,
    aten.log_normal_.default,
}  # fmt: skip
# ops whose argument 1 is a single dim of the (per-replica) input
_DIM1 = {aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default,
         aten.unsqueeze.default, aten.gather.default, aten.scatter_add.default,
         aten.squeeze.dim, aten.slice.Tensor, aten.select.int, aten.cumsum.default,
         aten.cumprod.default, aten.logcumsumexp.default}  # fmt: skip
# ops taking (self, dim, index, ...) with a 1-D index along dim (the pipeline's activation
# stashes): stacked when the index is the same on every replica
_INDEXED = {aten.index_select.default, aten.index_copy.default, aten.index_add.default}
# 2-d pooling per replica on [N, C, H, W] or [C, H, W]: the replicas' rows are more images
# (max pooling's indices are positions within each image's plane, so they do not change);
# each op with the positions of its image-shaped tensor arguments
_POOL = {
    aten.max_pool2d_with_indices.default: (0,),
    aten.max_pool2d_with_indices_backward.default: (0, 1, 7),
    aten._adaptive_avg_pool2d.default: (0,),
    aten._adaptive_avg_pool2d_backward.default: (0, 1),
    aten.avg_pool2d.default: (0,),
    aten.avg_pool2d_backward.default: (0, 1),
}
_SOFTMAX_BACKWARD = {aten._softmax_backward_data.default, aten._log_softmax_backward_data.default}
# nll_loss forward/backward: the position of the ``reduction`` argument
_NLL = {aten.nll_loss_forward.default: 3, aten.nll_loss_backward.default: 4}
_SUMS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.dim, aten.mean.default,
         aten.amax.default}  # fmt: skip
_FULL_REDUCTIONS = {aten.sum.default, aten.mean.default}  # over every per-replica dim
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_FLAT_KINDS = {
    "clone",
    "alias",
    "mm_all_reduce",
    "mm_replica_sum",
    "loop",
}


# ops of transformer programs with a stacked form (Note [explicit batching]): the
# ``_stacked_*`` helpers below; each entry says whether its inputs allow that form
def _embedding_ok(f, batched) -> bool:
    args = f.op.attrs.args
    weight = args[0]
    return isinstance(weight, Slot) and not batched[weight.index] and not f.op.attrs.kwargs


def _embedding_backward_ok(f, batched) -> bool:
    args = f.op.attrs.args  # grad, indices, num_weights, padding_idx, scale_grad_by_freq
    return len(args) == 5 and args[4] is False


def _batched_arg(f, batched, i: int) -> bool:
    """Whether argument ``i`` of ``f`` is a per-replica tensor."""
    v = f.op.attrs.args[i]
    return isinstance(v, Slot) and batched[v.index]


def _any_ok(f, batched) -> bool:
    return not f.op.attrs.kwargs


def _attention_ok(f, batched, n_tensors: int) -> bool:
    """Flash attention (forward: q, k, v; backward: grad, q, k, v, out, logsumexp) on
    per-replica ``[B, H, S, D]`` values without dropout: the replicas' rows fold into the batch
    dim (``_attention_stacked``). A per-replica mask must be ``[B or 1, H or 1, S, S]``."""
    args, kwargs = f.op.attrs.args, f.op.attrs.kwargs
    mask = kwargs.get("attn_mask")
    if isinstance(mask, Slot) and batched[mask.index] and f.op.inputs[mask.index].rank != 4:
        return False
    dropout = args[n_tensors] if len(args) > n_tensors else kwargs.get("dropout_p", 0.0)
    tensors = args[:n_tensors]
    return (dropout == 0 and all(isinstance(v, Slot) for v in tensors)
            and all(f.op.inputs[v.index].rank == 4 for v in tensors[:4]))  # fmt: skip


# ``x.new_zeros(size)`` and friends read only ``x``'s dtype and device; on stacked ``x`` they
# make the stacked zeros ``[R, *size]``
_NEW_FACTORIES = (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
                  aten.new_full.default)  # fmt: skip
_TRANSFORMER = {
    aten.embedding.default: _embedding_ok,
    aten.embedding_dense_backward.default: _embedding_backward_ok,
    aten.native_layer_norm.default: _any_ok,
    aten.native_layer_norm_backward.default: _any_ok,
    aten.split.Tensor: _any_ok,
    aten.unsafe_split.Tensor: _any_ok,
    aten.transpose.int: _any_ok,
    aten.expand.default: _any_ok,
    aten.bmm.default: _any_ok,
    aten.cat.default: _any_ok,
    aten.stack.default: _any_ok,
    aten._scaled_dot_product_flash_attention_for_cpu.default: lambda f, b: _attention_ok(f, b, 3),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        lambda f, b: _attention_ok(f, b, 6)
    ),
    # and of other models (RNNs unbind their time steps, T5 and GPT-2 pad and make zeros)
    aten.unbind.int: _any_ok,
    aten.constant_pad_nd.default: _any_ok,  # pads trailing dims: the rows are untouched
    aten.flip.default: _any_ok,  # (cumsum's gradient)
    # a fill with a 0-d tensor: the value must be shared, not one per replica
    aten.fill_.Tensor: lambda f, b: not _batched_arg(f, b, 1),
    aten.fill.Tensor: lambda f, b: not _batched_arg(f, b, 1),
    **dict.fromkeys(_NEW_FACTORIES, lambda f, b: True),
}


# Note [per-element list ops]
#     torch's fused optimizer kernels (``_fused_adam_``, ``_fused_adamw_``) take lists of
#     tensors and update each list element on its own: element k of the parameters, gradients
#     and states is computed from element k of every list and from tensors read as scalars
#     (the learning rate; the step counts, one per element) only. Replica batching is
#     therefore per element: the analysis makes element k's written tensors per replica only
#     when an input of element k is (``element_inputs``, read by ``_Pass._torch`` in
#     runtime/lower.py), so one call updates RTS shards (per replica) and replica-invariant
#     weights together. Stacked, an element ``[R, ...]`` is R elementwise updates in one, so
#     the kernel runs as is on the physical tensors when every element is all stacked or all
#     replica-invariant and the scalars are replica-invariant (``per_element_stacked``; under
#     vmap, which has no batching rule for these kernels, it unwraps the batched elements to
#     their stacked rows first; a per-replica scalar is an error there).
#
#     Two properties of torch's CPU kernels matter. They round a value by where it falls in
#     its tensor (a vectorised body and a scalar tail give results an ulp apart), so the same
#     numbers in another tensor size can differ in the last bit: stacked RTS shards ``[R,
#     shard]`` are the parameter's own flat layout, so shards that divide the parameter give
#     the unsharded update bit for bit, while a padded last shard (a longer tensor) or the
#     reference executor's one call per replica may differ by an ulp. And they walk each
#     element's memory as flat and contiguous whatever its strides say (a transposed parameter
#     or an expanded gradient is silently misread), so a non-contiguous operand gets a
#     contiguous copy, written back unless it is a broadcast (read-only) one; the compiled
#     step's operands are contiguous, this keeps any other layout correct.
PER_ELEMENT = frozenset({
    aten._fused_adam_.default, aten._fused_adam_.tensor_lr,
    aten._fused_adamw_.default, aten._fused_adamw_.tensor_lr,
})  # fmt: skip
_SCALAR_LISTS = frozenset({"state_steps"})  # list arguments whose elements are read as scalars


def _per_element_args(op: Op) -> tuple[list[list[int]], list[int], set[int]]:
    """The tensor input indices of a ``PER_ELEMENT`` op: per list position, its element of
    every list; the non-list tensors; the indices read as scalars (those and the step counts)."""
    args, kwargs = op.attrs.args, op.attrs.kwargs
    elements: list[list[int]] = []
    shared: list[int] = []
    scalars: set[int] = set()
    for i, arg in enumerate(op.attrs.target._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, list | tuple):
            for k, v in enumerate(value):
                if isinstance(v, Slot):
                    elements.extend([] for _ in range(k + 1 - len(elements)))
                    elements[k].append(v.index)
                    if arg.name in _SCALAR_LISTS:
                        scalars.add(v.index)
        elif isinstance(value, Slot):
            shared.append(value.index)
            scalars.add(value.index)
    return elements, shared, scalars


def element_inputs(op: Op) -> dict[int, frozenset[int]] | None:
    """Note [per-element list ops]: for a ``PER_ELEMENT`` op, each tensor input's index ->
    the input indices its value is computed from (its list element's and the scalars); None
    for any other op (what it writes depends on all its inputs)."""
    if op.attrs.target not in PER_ELEMENT:
        return None
    elements, shared, _ = _per_element_args(op)
    out: dict[int, frozenset[int]] = {i: frozenset(shared) for i in shared}
    for element in elements:
        for i in element:
            out[i] = out.get(i, frozenset()) | frozenset(element) | frozenset(shared)
    for i in shared:  # a scalar is read by every element
        out[i] = out[i].union(*elements)
    return out


def per_element_ok(op: Op, batched: list[bool]) -> bool:
    """Whether a ``PER_ELEMENT`` op runs on the physical tensors (Note [per-element list
    ops]): every element all stacked or all replica-invariant, every scalar invariant."""
    elements, _, scalars = _per_element_args(op)
    if any(batched[i] for i in scalars):
        return False
    return all(len({batched[i] for i in e if i not in scalars}) <= 1 for e in elements)


def per_element_stacked(fn, *args, **kwargs) -> None:
    """A ``PER_ELEMENT`` kernel ``fn`` on the physical tensors: stacked ``[R, ...]`` elements as
    they are, a vmap-batched one as its stacked rows, non-contiguous ones through contiguous
    copies written back (Note [per-element list ops])."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def physical(t):
        if not isinstance(t, torch.Tensor):
            return t
        if torch._C._functorch.is_batchedtensor(t):  # under vmap: the rows of every replica
            bdim = torch._C._functorch.maybe_get_bdim(t)
            t = torch._C._functorch.get_unwrapped(t).movedim(bdim, 0)
        if t.is_contiguous():
            return t
        copies.append((t, t.contiguous()))
        return copies[-1][1]

    fn(*pytree.tree_map(physical, args), **pytree.tree_map(physical, kwargs))
    for t, c in copies:
        if not _expanded(t):  # torch writes no broadcast operand in place: it was only read
            t.copy_(c)


def _expanded(t: torch.Tensor) -> bool:
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True))


# Seeded ops that draw nothing when their dropout probability (this argument) is 0.
_DROPOUT_P = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (3, "dropout_p"),
    aten.native_dropout.default: (1, "p"),
}


def is_random(target) -> bool:
    """Whether ``target`` can draw random numbers. torch tags every such aten overload
    ``nondeterministic_seeded``, including those without a ``Generator`` argument
    (``rand_like``, ``randn_like``, ``randint_like``); PopXL replicas draw independently."""
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def draws_random(op: Op) -> bool:
    """Whether the captured ``op`` draws random numbers: its target can (``is_random``), and
    it is not an attention or dropout op whose dropout probability is 0."""
    target = op.attrs.target
    if not is_random(target):
        return False
    if target in _DROPOUT_P:
        pos, name = _DROPOUT_P[target]
        args, kwargs = op.attrs.args, op.attrs.kwargs
        p = args[pos] if len(args) > pos else kwargs.get(name, 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return True


def _ok_torch(f, a, R: int) -> bool:
    """Whether ``f`` runs in an explicitly batched fragment: by a stacked rule, or alone
    through torch's batching rule (Note [one op through torch's batching rule])."""
    return _stacked_rule(f, a, R) or _one_op_vmap_ok(f, a)


def _stacked_rule(f, a, R: int) -> bool:
    """Whether ``f`` has a stacked rule of this project for its inputs."""
    target = f.op.attrs.target
    if f in a.sum_reads:
        return True  # rt.sum_read finishes it on either layout
    if f in a.sum_adds:  # acc += (sum over replicas of x): x.sum(0) on stacked values
        return target in _ELEMENTWISE
    if draws_random(f.op):  # Note [random ops on stacked rows]
        if "generator" in f.op.attrs.kwargs:
            return False
        return target in _RANDOM_ELEMENTWISE or _random_factory(f.op)
    batched = [a.b(n) for n in f.ins]
    if getattr(target, "namespace", "") == "torch_popxl":
        return opdef_rule(f.op, batched, R) is not None
    if not any(batched):
        return getattr(target, "namespace", "") == "aten"  # unbatched: runs as is
    if target in _ELEMENTWISE:  # any ranks: Note [broadcasting on stacked values]
        args = f.op.attrs.args  # a tensor standing for a Scalar must stay 0-d: shared
        return not any(i < len(args) and isinstance(args[i], Slot) and batched[args[i].index]
                       for i in scalar_tensor_args(target))  # fmt: skip
    if target in PER_ELEMENT:
        return per_element_ok(f.op, batched)
    if target is aten.mm.default or target in _VIEWS or target in _SUMS:
        return True
    if target is aten.addmm.default:
        return True
    if target in _NLL:
        # per replica: a [N, C] input, [N] targets, no class weights, mean or sum reduction
        x = f.op.attrs.args[0 if target is aten.nll_loss_forward.default else 1]
        return (isinstance(x, Slot) and f.op.inputs[x.index].rank == 2
                and args_weight_none(f.op, target) and f.op.attrs.args[_NLL[target]] in (1, 2))  # fmt: skip
    if target is aten.t.default:
        return f.op.inputs[0].rank == 2
    if target is aten.permute.default:
        return True
    if target in _DIM1 or target in _SOFTMAX_BACKWARD:
        return True
    if target in (aten.select_backward.default, aten.slice_backward.default):
        return batched[0]
    if target in _CNN:
        return _CNN[target](f, batched)
    if target in _POOL:
        return f.op.inputs[0].rank in (3, 4) and not f.op.attrs.kwargs
    if target in _INDEXED:  # a per-replica index would need a gather per row
        index = f.op.attrs.args[2]
        return isinstance(index, Slot) and not batched[index.index] and not f.op.attrs.kwargs
    if target in _TRANSFORMER:
        return _TRANSFORMER[target](f, batched)
    return opdef_rule(f.op, batched, R) is not None


# Note [broadcasting on stacked values]
#     Per replica, an elementwise op broadcasts its operands by aligning trailing dims. On
#     stacked values a batched operand carries the replica dim in front, so a batched operand
#     of lower per-replica rank than the op's result would align its replica dim with one of
#     the result's own dims (Adam's ``m / (1 - beta1 ** step)`` with a per-replica step counter,
#     a per-replica bias ``[10]`` added to ``[32, 10]`` logits): wrong, or an error. Padding it
#     with unit dims after the replica dim (``x[:, None]``, a view) restores the per-replica
#     alignment; replica-invariant operands are stored without the replica dim and align by
#     their trailing dims as they do per replica. The result's rank is the largest operand
#     rank, so the operand an in-place op writes is never padded.
def rank_padding(f, plan) -> dict[int, int]:
    """``{input index: unit dims to insert after the replica dim}`` for the batched operands of
    an explicitly batched elementwise op ``f`` (Note [broadcasting on stacked values])."""
    if f.kind != "torch" or f.op.attrs.target not in _ELEMENTWISE:
        return {}
    if f in plan.sum_adds or f in plan.sum_reads:
        return {}  # emitted on the replica sum, which has no replica dim
    top = max((t.rank for t in f.op.inputs), default=0)
    return {
        i: top - t.rank
        for i, (t, n) in enumerate(zip(f.op.inputs, f.ins, strict=True))
        if t.rank < top and plan.b(n)
    }


def opdef_rule(op: Op, batched: list[bool], R: int):
    """The stacked form of a ``torch_popxl`` op from its definition, or None."""
    opdef = opdefs.lookup(op)
    return None if opdef is None else opdef.rule("explicit")(op, batched, R)


def _runtime_explicit(f) -> bool:
    """A runtime op whose definition brings its stacked form (its ``explicit`` rule)."""
    return f.kind == "runtime" and f.op.kind.has("explicit")


def _runtime_stacked(f) -> bool:
    """A runtime op whose emission handles stacked values and folded loops itself (its
    definition's ``lower_stacked`` rule: the host transfers)."""
    return (
        f.kind == "runtime"
        and f.op.kind.has("lower_stacked")
        and f.op.kind.rule("lower_stacked")(f.op)
    )


def _kind_name(f) -> str:
    """A flat op's kind in words: a runtime op's definition name."""
    return f.op.kind.name if f.kind == "runtime" else f.kind


def batchable(flat, analysis, R: int) -> bool:
    """Whether every op of ``flat`` has an explicit-batching rule (Note [explicit batching])."""
    return vmap_reason(flat, analysis, R) is None


def vmap_reason(flat, analysis, R: int) -> str | None:
    """The first op of ``flat`` without an explicit-batching rule, in words, or None when the
    whole fragment has one (the benchmarks report it: a fragment with a reason runs under vmap)."""
    for f in flat:
        reason = None
        if f.kind == "torch":
            if not _ok_torch(f, analysis, R):
                reason = f"no explicit rule for {f.op.attrs.target}"
        elif _runtime_explicit(f):
            if opdef_rule(f.op, [analysis.b(n) for n in f.ins], R) is None:
                reason = f"no explicit rule for {f.op.kind}"
        elif f.kind not in _FLAT_KINDS and not _runtime_stacked(f):
            reason = f"no explicit rule for the {_kind_name(f)!r} flat op"
        elif f.kind == "loop":
            reason = vmap_reason(f.body, analysis, R)
        if reason is not None:
            if _DEBUG:
                print("explicit batching:", reason)
            return reason
    return None


def _addmm_stacked(bias, bias_b: bool, x, w, beta=1, alpha=1):
    """``aten.addmm`` on stacked operands (``x``/``w`` are ``[R, M, K]``/``[R, K, N]`` when
    batched). The common case, batched activations times a replica-invariant weight plus an
    invariant bias, is one ``addmm`` over all replicas' rows."""
    if x.dim() == 3 and w.dim() == 2 and not bias_b:
        if beta == 1 and alpha == 1 and bias.dim() == 1:  # Note [gemm kernel]
            return gemm(x, w, bias)
        R, M, K = x.shape
        return torch.addmm(bias, x.reshape(R * M, K), w, beta=beta, alpha=alpha).view(R, M, -1)
    if bias_b and bias.dim() == 2:  # a per-replica row vector broadcasts over the rows
        bias = bias.unsqueeze(1)
    prod = gemm(x, w) if w.dim() == 2 else torch.matmul(x, w)
    if alpha != 1:
        prod = prod * alpha
    return prod + (bias if beta == 1 else bias * beta)


def args_weight_none(op, target) -> bool:
    """Whether an nll_loss op has no class weights (the stacked form handles none)."""
    weight_pos = 2 if target is aten.nll_loss_forward.default else 3
    return op.attrs.args[weight_pos] is None


def _nll_forward_stacked(x, target, weight, reduction: int, ignore_index: int):
    """``aten.nll_loss_forward`` per replica on stacked ``x`` ``[R, N, C]`` and ``target``
    ``[R, N]``: every replica's per-sample losses in one call, then each replica's own
    reduction (``total_weight`` is each replica's count of counted samples)."""
    R, N, C = x.shape
    if R == 1:  # one replica: aten's own reduction, bit for bit as eager
        out, total_weight = aten.nll_loss_forward(x[0], target[0], None, reduction,
                                                  ignore_index)  # fmt: skip
        return out.unsqueeze(0), total_weight.unsqueeze(0)
    # aten's unreduced kernel takes only int64 targets (the per-replica call accepts int32 too)
    target = target.long()
    losses = aten.nll_loss_forward(x.reshape(R * N, C), target.reshape(R * N), None, 0,
                                   ignore_index)[0].view(R, N)  # fmt: skip
    total_weight = (target != ignore_index).sum(-1).to(x.dtype)
    out = losses.sum(-1)
    return (out / total_weight if reduction == 1 else out), total_weight


def _nll_backward_stacked(grad, x, target, weight, reduction: int, ignore_index: int,
                          total_weight):  # fmt: skip
    """``aten.nll_loss_backward`` per replica on stacked values: the per-replica scale
    (``grad / total_weight`` for a mean) becomes a per-sample gradient of one unreduced call."""
    R, N, C = x.shape
    target = target.long()
    scale = grad / total_weight if reduction == 1 else grad
    per_sample = scale.reshape(R, 1).expand(R, N).reshape(R * N)
    return aten.nll_loss_backward(per_sample, x.reshape(R * N, C), target.reshape(R * N), None, 0,
                                  ignore_index, x.new_ones(())).view(R, N, C)  # fmt: skip


# Note [fold the accumulation loop]
#     Explicitly batched ops treat the leading dim as independent rows: nothing an aten rule
#     above computes mixes replicas. So a gradient-accumulation loop whose iterations only
#     differ in the micro-batch they load, and whose only effect besides host IO is adding to
#     replica-sum accumulators, can run all ``n`` iterations as one pass over ``[n * R, ...]``
#     rows (iteration-major): the micro-batches of every iteration and replica become one
#     matmul, per-row statistics (a loss's mean, anything per micro-batch) stay per iteration
#     and replica, and ``acc += sum_r x_r`` summed over iterations is ``acc += sum_{i,r} x_ir``.
#     Folding is refused when anything could observe the iterations one at a time: loop-carried
#     results, in-place writes other than those below, collectives, remote memory, values
#     forced per replica, or a replica sum used for anything but an accumulation. A
#     per-replica value from outside the loop (a weight whose state is per replica) is
#     repeated for every iteration first. The sums are taken in a different order than the
#     loop's, so results agree with the reference executor to rounding, as the replica sums
#     already do.
#     In-place writes that still fold (``fold_plan``): a write into a value the iteration
#     itself created (a dropout mask drawn into an ``empty_like``) touches only that
#     iteration's rows; batch norm's running statistics are updated iteration by iteration,
#     in order, from each iteration's own rows (``_batch_norm_stacked`` gives them their own
#     calls), while everything else runs once over all rows; and a counter bumped by a
#     loop-invariant amount (``num_batches_tracked += 1``) is bumped ``n`` times
#     (``FoldPlan.repeated``). Nothing else in the body may read a value written that way
#     (batch norm's backward in training reads only its saved statistics). Every row of a
#     folded random op still draws its own values (dropout: each micro-batch and replica its
#     own mask).
_FOLD_KINDS = {"torch", "alias", "clone", "mm_replica_sum"}  # and the host transfers
_FOLD_VIEWS = _VIEWS | {aten.t.default, aten.permute.default}
_COUNTERS = {aten.add_.Tensor, aten.add_.Scalar}
_RUNNING_STATS = (3, 4)  # batch norm's (and its backward's) running mean and variance


def _written_names(f) -> list[str]:
    """The value names ``f`` writes in place (Note [one effects query] in ir/walk.py: batch
    norm's running statistics included, which its schema does not declare)."""
    return [f.ins[i] for i in sorted(effects(f.op).writes)]


@dataclass(frozen=True)
class FoldPlan:
    """How a foldable loop runs as one pass: the ops to run once per iteration (counters)
    and the values from outside the loop it writes in place (not repeated per iteration)."""

    repeated: frozenset = frozenset()
    written_outside: frozenset[str] = frozenset()


def outside_rows(loop, plan, written: frozenset[str] = frozenset()) -> list[str]:
    """The per-replica values a folded ``loop`` reads from outside it: they have R rows and are
    repeated for every iteration before the folded pass (except those the loop ``written``
    in place, which keep their R rows: Note [fold the accumulation loop])."""
    defined = {n for f in loop.body for n in f.outs}
    found: dict[str, None] = {}
    for f in loop.body:
        found.update((n, None) for n in f.ins
                     if plan.b(n) and n not in defined and plan.root_of(n) not in written)  # fmt: skip
    return list(found)


def _write_obstacle(f, created: set[str], plan) -> str | None:
    """Why ``f``'s in-place writes keep its loop unfolded, or None (the writes that fold:
    Note [fold the accumulation loop])."""
    target, args = f.op.attrs.target, f.op.attrs.args
    outside = [n for n in _written_names(f) if plan.root_of(n) not in created]
    if not outside:
        return None
    if target is aten.native_batch_norm.default:
        stats = {f.ins[args[i].index] for i in _RUNNING_STATS if isinstance(args[i], Slot)}
        return None if set(outside) <= stats else "writes in place"
    if target in _COUNTERS and outside == [f.ins[args[0].index]]:
        other = args[1]
        if not isinstance(other, Slot) or plan.root_of(f.ins[other.index]) not in created:
            return None
    return "writes in place"


def _reads_written(f, written: set[str], plan) -> bool:
    """Whether ``f`` reads a value its folded loop writes in place, other than batch norm's
    backward reading the running statistics it ignores in training."""
    ignored: set[int] = set()
    if f.kind == "torch" and f.op.attrs.target is aten.native_batch_norm_backward.default:
        args = f.op.attrs.args
        if args[7] is True:  # training
            ignored = {args[i].index for i in _RUNNING_STATS if isinstance(args[i], Slot)}
    return any(plan.root_of(n) in written for i, n in enumerate(f.ins) if i not in ignored)


def fold_plan(loop, plan) -> FoldPlan | str:
    """A ``FoldPlan`` for an explicitly batched ``loop`` that can run as one pass, else why
    it cannot (Note [fold the accumulation loop])."""
    if loop.results:
        return "it carries values from one iteration to the next"
    if loop.count < 2:
        return "it runs once"
    body = loop.body
    # One pass takes each stream's next ``count`` entries in order: a stream used by two host
    # ops of an iteration would need its entries interleaved.
    streams = [(f.op.kind.name, f.source.attrs.stream._index) for f in body
               if _runtime_stacked(f)]  # fmt: skip
    if len(set(streams)) != len(streams):
        return "it loads or stores one host stream more than once per iteration"
    sums: set[str] = set()  # replica sums over the leading dim: only ever accumulated
    created: set[str] = set()  # values the body itself creates
    writers: dict[int, set[str]] = {}  # id(op) -> the outside roots it writes in place
    repeated = set()
    for f in body:
        what = f"the {_kind_name(f)} op {f.op.attrs.target if f.kind == 'torch' else ''}".rstrip()
        new = [n for n in f.outs if n not in f.ins and n not in created]
        if f.kind not in _FOLD_KINDS and not _runtime_stacked(f):
            return f"{what} (not foldable)"
        if any(n in plan.force_batched for n in f.outs):
            return f"{what} makes a value per replica"
        if f.kind == "mm_replica_sum":
            sums.add(f.outs[0])
            created.update(new)
            continue
        target = f.op.attrs.target if f.kind == "torch" else None
        summed_ins = [n for n in f.ins if n in sums]
        created.update(new)
        if f.kind == "torch":
            if getattr(target, "namespace", "") != "aten" or f in plan.sum_reads:
                return f"{what} (not an aten op)"
            if f in plan.sum_adds:
                addend = f.ins[plan.sum_adds[f]]
                if f.presummed and addend not in sums:
                    return f"{what} adds a sum not taken in the loop"
                if not f.presummed and not plan.b(addend):
                    return f"{what} adds a replica-invariant value"
                continue
            if _written_names(f):
                why = _write_obstacle(f, created, plan)
                if why is not None:
                    return f"{what} {why}"
                outside = {plan.root_of(n) for n in _written_names(f)} - created
                if outside:
                    writers[id(f)] = outside
                    if target in _COUNTERS:
                        repeated.add(f)
            if f.rows_summed:  # its weight and bias gradients are replica sums
                sums.update(n for n, p in zip(f.outs, f.op.attrs.out_paths, strict=True) if p[0])
                continue
        if summed_ins:
            if len(f.ins) != 1 or not (f.kind in ("alias", "clone") or target in _FOLD_VIEWS):
                return f"{what} uses a replica sum"
            sums.update(f.outs)
            continue
        if any(plan.b(n) for n in f.ins) and not all(plan.b(n) for n in f.outs):
            return f"{what} reduces over the replicas"
    written = set().union(*writers.values()) if writers else set()
    for f in body:
        if id(f) not in writers and written and _reads_written(f, written, plan):
            return f"the {_kind_name(f)} op reads a value the loop updates in place"
    return FoldPlan(frozenset(repeated), frozenset(written))


def _shift(d: int) -> int:
    return d + 1 if d >= 0 else d


def emit_torch(em, f, ind: str) -> None:
    """Emit ``f`` on stacked tensors (the caller checked ``batchable``)."""
    target = f.op.attrs.target
    args = list(f.op.attrs.args)
    kwargs = dict(f.op.attrs.kwargs)
    a = em.a
    R = em.rows  # the leading dim: the replicas, times the iterations of a folded loop
    batched = [a.b(n) for n in f.ins]
    # Note [operands a stacked rule needs with rows]: the declared operands stored once are
    # expanded here, for every rule; past this point they count as stacked
    stacked = any(batched) or draws_random(f.op)  # a random op draws every replica's values
    expand = needs_rows(f.op) - {i for i, b in enumerate(batched) if b} if stacked else set()
    assert not expand & effects(f.op).writes, f"{target} would write an expanded operand"
    batched = [b or i in expand for i, b in enumerate(batched)]

    def lit(x):
        if isinstance(x, Slot) and x.index in expand:
            s = em.literal(x, f)
            return f"{s}.expand({R}, *{s}.shape)"
        if isinstance(x, list):
            return "[" + ", ".join(lit(y) for y in x) + "]"
        if isinstance(x, tuple):
            return "(" + "".join(lit(y) + ", " for y in x) + ")"
        return em.literal(x, f)

    if f in em.fold_repeated:  # Note [fold the accumulation loop]: once per iteration
        em.lines.append(f"{ind}for _ in range({em.fold}):")
        em._torch_plain(f, ind + "    ")
        return
    if not _stacked_rule(f, a, em.p.R):  # Note [one op through torch's batching rule]
        _emit_one_op_vmap(em, f, ind)
        return
    out = f.outs[0] if f.outs else None
    is_popxl = getattr(target, "namespace", "") == "torch_popxl"
    stacked_form = opdef_rule(f.op, batched, R) if is_popxl and f not in a.sum_reads else None
    if stacked_form is not None:  # the op's own rule (batchable() checked it has one)
        call_args = [lit(v) for v in args] + [f"{k}={lit(v)}" for k, v in kwargs.items()]
        call = f"{em.p.literal(stacked_form)}({', '.join(call_args)})"
        em.lines.append(f"{ind}{out} = {call}" if out is not None else f"{ind}{call}")
        return
    if draws_random(f.op) and _random_factory(f.op):  # a size: the rows' values in one draw
        rendered = [f"[{R}, *{lit(args[0])}]", *[lit(v) for v in args[1:]]]
        rendered += [f"{k}={lit(v)}" for k, v in kwargs.items()]
        _emit_outputs(em, f, ind, f"{em.p.aten(target)}({', '.join(rendered)})")
        return
    if draws_random(f.op):  # Note [random ops on stacked rows]
        rendered = [lit(v) for v in args] + [f"{k}={lit(v)}" for k, v in kwargs.items()]
        _emit_outputs(em, f, ind, f"{em.p.aten(target)}({', '.join(rendered)})")
        return
    if not any(batched) or target in _ELEMENTWISE or target in PER_ELEMENT or f in a.sum_reads:
        em._torch_plain(f, ind)
        return
    if target in _NLL:
        rendered = [lit(v) for v in args] + [f"{k}={lit(v)}" for k, v in kwargs.items()]
        if target is aten.nll_loss_forward.default:
            em.lines.append(
                f"{ind}_r = {em.p.literal(_nll_forward_stacked)}({', '.join(rendered)})"
            )
            for o, path in zip(f.outs, f.op.attrs.out_paths, strict=True):
                em.lines.append(f"{ind}{o} = _r{''.join(f'[{i}]' for i in path)}")
        else:
            em.lines.append(
                f"{ind}{out} = {em.p.literal(_nll_backward_stacked)}({', '.join(rendered)})"
            )
        return
    x = lit(args[0])
    if target is aten.addmm.default:
        bias_b = isinstance(args[0], Slot) and batched[args[0].index]
        rest = [lit(v) for v in args[1:]] + [f"{k}={lit(v)}" for k, v in kwargs.items()]
        call = ", ".join([x, repr(bias_b), *rest])
        em.lines.append(f"{ind}{out} = {em.p.literal(_addmm_stacked)}({call})")
    elif target is aten.mm.default:
        # batched rows times an invariant matrix: one GEMM over all replicas' rows
        fn = "torch.bmm" if all(batched) else "GEMM" if batched[0] else "torch.matmul"
        em.lines.append(f"{ind}{out} = {fn}({x}, {lit(args[1])})")
    elif target is aten.t.default:
        em.lines.append(f"{ind}{out} = {x}.transpose(-1, -2)")
    elif target is aten.permute.default:
        rank = f.op.inputs[0].rank
        perm = [0] + [(d % rank) + 1 for d in args[1]]
        em.lines.append(f"{ind}{out} = {x}.permute({perm!r})")
    elif target in _VIEWS:
        em.lines.append(f"{ind}{out} = STACKED_VIEW({x}, {lit(args[1])}, {R})")
    elif target in _SUMS:
        per_replica_dims = f.op.inputs[0].rank
        dims = args[1] if len(args) > 1 else kwargs.pop("dim", None)
        if dims is None or dims == [] or target in _FULL_REDUCTIONS:
            dims = list(range(per_replica_dims))
        keep = args[2] if len(args) > 2 else kwargs.pop("keepdim", False)
        if per_replica_dims == 0:
            # A 0-d value reduces to itself (dim 0 / -1 name it; keepdim keeps it 0-d). An
            # empty dims tuple would reduce the replica dim too: reduce a unit dim instead,
            # which keeps the op's dtype rule (a sum of ints is int64).
            x, dims, keep = f"{x}.unsqueeze(1)", [0], False
        else:
            dims = [d % per_replica_dims for d in dims]
        dims = [_shift(d) for d in dims]
        extra = "".join(f", {k}={lit(v)}" for k, v in kwargs.items())
        fn = {aten.amax.default: "torch.amax", aten.mean.dim: "torch.mean",
              aten.mean.default: "torch.mean"}.get(target, "torch.sum")  # fmt: skip
        em.lines.append(f"{ind}{out} = {fn}({x}, {tuple(dims)!r}, keepdim={keep!r}{extra})")
    elif target in _DIM1 or target in _SOFTMAX_BACKWARD:
        # every tensor argument must be stacked; the dim moves past the replica dim
        dim_pos = 2 if target in _SOFTMAX_BACKWARD else 1
        if len(args) <= dim_pos:  # slice's dim has a default (0), left out of the record
            args = [*args, kwargs.pop("dim", 0)]
        rendered = [lit(v) for v in args]
        rendered[dim_pos] = repr(_shift(args[dim_pos]))
        rendered += [f"{k}={lit(v)}" for k, v in kwargs.items()]
        em.lines.append(f"{ind}{out} = {em.p.aten(target)}({', '.join(rendered)})")
    elif target in _CNN:
        rendered = [lit(v) for v in args]
        flags = [isinstance(v, Slot) and batched[v.index] for v in args]
        summed = ", summed=True" if f.rows_summed else ""
        shared = _shared_taps(em, f, ind)
        call = f"{em.p.literal(_CNN_STACKED[target])}({', '.join(rendered)}, flags={flags!r}"
        _emit_outputs(
            em, f, ind, f"{call}{summed}{'' if shared is None else ', weights=' + shared})"
        )
        if shared is not None and target is aten.convolution_backward.default:
            em.lines.append(f"{ind}del {shared}")
    elif target in (aten.select_backward.default, aten.slice_backward.default):
        sizes = [R, *args[1]]  # the per-replica input sizes, behind the rows
        trailing = "".join(f", {lit(v)}" for v in args[3:])  # index, or start, end, step
        call = f"{lit(args[0])}, {sizes!r}, {_shift(args[2])!r}{trailing}"
        em.lines.append(f"{ind}{out} = {em.p.aten(target)}({call})")
    elif target in _POOL:
        rendered = [lit(v) for v in args]
        tensors = _POOL[target]
        fn = em.p.literal(_pool_stacked)
        kernel = (
            em.p.literal(_POOL_KERNELS[target]) if target in _POOL_KERNELS else em.p.aten(target)
        )
        call = f"{fn}({kernel}, {tensors!r}, {', '.join(rendered)})"
        _emit_outputs(em, f, ind, call)
    elif target in _INDEXED:
        # the shared index selects along the shifted dim
        rendered = [lit(v) for v in args]
        rendered[1] = repr(_shift(args[1]))
        em.lines.append(f"{ind}{out} = {em.p.aten(target)}({', '.join(rendered)})")
    elif target in _TRANSFORMER:
        _emit_transformer(em, f, ind, target, args, kwargs, batched, lit, R)
    else:  # pragma: no cover - batchable() admits nothing else
        raise AssertionError(f"no explicit rule for {target}")


def _index_fill_tensor(x, dim: int, index, value):
    """``aten.index_fill.int_Tensor`` as an ``index_copy`` of the expanded value: the same
    result, and under vmap a batched 0-d value fills each row with its own value (torch
    2.14's batching rule for ``index_fill.int_Tensor`` fills every row with the last row's;
    trace's gradient is one such fill)."""
    if x.dim() == 0:
        return aten.index_fill.int_Tensor(x, dim, index, value)
    index = index.reshape(-1)
    shape = list(x.shape)
    shape[dim % x.dim()] = index.numel()
    return x.index_copy(dim % x.dim(), index, value.to(x.dtype).expand(shape))


def _masked_index_put(op):
    """``op`` (``index_put`` or ``index_put_``) under one boolean mask, with values that
    broadcast over the selected elements, as a ``where`` (a ``masked_fill`` for one value):
    the same result, and torch's batching rule for ``index_put`` refuses boolean masks (a
    selection's size depends on the data; ``x[mask] = 0``, as Gemma 3 writes its token ids,
    or ``x[mask] += v`` does not). Other index forms run as ``op``."""

    def form(x, indices, values, accumulate=False):
        where = _under_one_mask(x, indices, values)
        if where is None:
            return op(x, indices, values, accumulate)
        mask, values = where
        if not accumulate and values.dim() == 0:
            fill = x.masked_fill_ if op is aten.index_put_.default else x.masked_fill
            return fill(mask, values)
        result = torch.where(mask, x + values if accumulate else values, x)
        return x.copy_(result) if op is aten.index_put_.default else result

    return form


def _under_one_mask(x, indices, values):
    """(the mask shaped to broadcast over ``x``, the values shaped to broadcast over ``x``)
    when ``indices`` is one boolean mask over dims of ``x`` and ``values`` fills every
    selected element alike (its shape broadcasts over the dims after the mask); else None."""
    given = [(k, i) for k, i in enumerate(indices) if i is not None]
    if len(given) != 1 or values.dtype != x.dtype or x.dtype == torch.bool:
        return None
    at, mask = given[0]
    if mask.dtype != torch.bool or mask.shape != x.shape[at : at + mask.dim()]:
        return None
    rest = x.shape[at + mask.dim() :]
    while values.dim() > len(rest) and values.shape[0] == 1:
        values = values[0]  # (the selection's own dim, of size 1)
    if values.dim() > len(rest):
        return None
    if any(v not in (1, r) for v, r in zip(reversed(values.shape), reversed(rest), strict=False)):
        return None
    return mask.reshape((1,) * at + mask.shape + (1,) * len(rest)), values


# aten overloads the generated code calls through another form (``Program.aten``)
SAFE_FORMS = {
    aten.index_fill.int_Tensor: _index_fill_tensor,
    aten.index_put.default: _masked_index_put(aten.index_put.default),
    aten.index_put_.default: _masked_index_put(aten.index_put_.default),
}


def _emit_outputs(em, f, ind: str, call: str) -> None:
    paths = f.op.attrs.out_paths
    if len(paths) == 1 and paths[0] == ():
        em.lines.append(f"{ind}{f.outs[0]} = {call}")
        return
    em.lines.append(f"{ind}_r = {call}")
    for o, path in zip(f.outs, paths, strict=True):
        em.lines.append(f"{ind}{o} = _r{''.join(f'[{i}]' for i in path)}")


def _emit_transformer(em, f, ind, target, args, kwargs, batched, lit, R) -> None:
    """The stacked forms of ``_TRANSFORMER``'s ops (their conditions were checked; the
    operands they need with rows have them: Note [operands a stacked rule needs with rows])."""
    rendered = [lit(v) for v in args]

    def flag(v) -> bool:
        return isinstance(v, Slot) and batched[v.index]

    if target is aten.embedding.default:
        # the weight is replica-invariant; an embedding looks up any index shape
        _emit_outputs(em, f, ind, f"{em.p.aten(target)}({', '.join(rendered)})")
    elif target is aten.native_layer_norm.default:
        affine_b = flag(args[2]) or flag(args[3])
        call = f"{em.p.literal(_layer_norm_stacked)}({', '.join(rendered)}, {affine_b!r})"
        _emit_outputs(em, f, ind, call)
    elif target is aten.native_layer_norm_backward.default:
        affine_b = flag(args[5]) or flag(args[6])
        call = f"{em.p.literal(_layer_norm_backward_stacked)}({', '.join(rendered)}, {affine_b!r})"
        _emit_outputs(em, f, ind, call)
    elif target is aten.embedding_dense_backward.default:
        call = f"{em.p.literal(_embedding_backward_stacked)}({', '.join(rendered)})"
        _emit_outputs(em, f, ind, call)
    elif target in (aten.split.Tensor, aten.unsafe_split.Tensor):
        dim = args[2] if len(args) > 2 else 0
        call = f"torch.split({rendered[0]}, {rendered[1]}, {_shift(dim)})"
        _emit_outputs(em, f, ind, call)
    elif target is aten.flip.default:
        dims = [_shift(d) for d in args[1]]
        _emit_outputs(em, f, ind, f"{em.p.aten(target)}({rendered[0]}, {dims!r})")
    elif target is aten.unbind.int:
        dim = args[1] if len(args) > 1 else 0
        _emit_outputs(em, f, ind, f"torch.unbind({rendered[0]}, {_shift(dim)})")
    elif target in (aten.constant_pad_nd.default, aten.fill_.Tensor, aten.fill.Tensor):
        _emit_outputs(em, f, ind, f"{em.p.aten(target)}({', '.join(rendered)})")
    elif target in _NEW_FACTORIES:
        rest = [f"[{R}, *{rendered[1]}]", *rendered[2:]]
        rest += [f"{k}={lit(v)}" for k, v in kwargs.items()]
        _emit_outputs(em, f, ind, f"{em.p.aten(target)}({rendered[0]}, {', '.join(rest)})")
    elif target is aten.transpose.int:
        _emit_outputs(em, f, ind, f"{rendered[0]}.transpose({_shift(args[1])}, {_shift(args[2])})")
    elif target is aten.expand.default:
        call = f"{em.p.literal(_expand_stacked)}({rendered[0]}, {rendered[1]})"
        _emit_outputs(em, f, ind, call)
    elif target in _ATTENTION:
        tensors = ", ".join(rendered[: _ATTENTION[target]])
        rest = rendered[_ATTENTION[target] :]
        rest += [f"{k}={lit(v)}" for k, v in kwargs.items()]
        rest.append(f"mask_batched={flag(kwargs.get('attn_mask'))!r}")
        fn = em.p.literal(_attention_stacked)
        call = f"{fn}({em.p.aten(target)}, [{tensors}], {', '.join(rest)})"
        _emit_outputs(em, f, ind, call)
    elif target is aten.bmm.default:  # matmul broadcasts an invariant operand over the rows
        _emit_outputs(em, f, ind, f"torch.matmul({rendered[0]}, {rendered[1]})")
    elif target in (aten.cat.default, aten.stack.default):
        dim = args[1] if len(args) > 1 else 0
        if target is aten.stack.default and dim < 0:  # counts the new dim: per replica rank + 1
            dim += f.op.outputs[0].rank
        fn = "torch.cat" if target is aten.cat.default else "torch.stack"
        _emit_outputs(em, f, ind, f"{fn}({rendered[0]}, {_shift(dim)})")


# Note [convolutions and batch norm on stacked rows]
#     A convolution with a replica-invariant weight treats every image alike: the rows of its
#     per-replica ``[N, C, *S]`` input fold into the batch dim, one call for all replicas. Its
#     weight and bias gradients are per replica (each replica's own images), so they are one
#     call per row; the input gradient folds like the forward. Batch norm normalises each
#     channel over the batch and spatial dims of ONE replica. Where a row is large (at least
#     ``_BN_ROW_NUMEL`` elements) it runs one call per row, each reading its row in place and
#     writing its results into its row of the stacked outputs (the ``out`` forms): no copy.
#     Where rows are small and many, the calls would cost more than the data, so the rows fold
#     into the channel dim instead (``[rows, N, C, *S]`` -> ``[N, rows * C, *S]``, a copy
#     each way): per-replica statistics become per-channel ones of the folded tensor, the
#     affine parameters and running statistics are per row (``[rows * C]``; the running
#     statistics are views of the stacked variables, so the kernel's in-place update reaches
#     them), and per-channel results come back as ``[rows, C]``.
_BN_ROW_NUMEL = 16384  # measured: a call per row and the fold's copies cost the same here


def _conv_ok(f, batched) -> bool:
    args = f.op.attrs.args  # input, weight, bias, ...
    x, w, b = args[0], args[1], args[2]
    return (isinstance(x, Slot) and batched[x.index] and isinstance(w, Slot)
            and not batched[w.index] and (b is None or not batched[b.index])
            and f.op.inputs[x.index].rank == f.op.inputs[w.index].rank
            and not f.op.attrs.kwargs)  # fmt: skip


def _conv_backward_ok(f, batched) -> bool:
    args = f.op.attrs.args  # grad, input, weight, bias_sizes, ...
    g, x, w = args[0], args[1], args[2]
    return (all(isinstance(v, Slot) for v in (g, x, w))
            and not batched[w.index] and f.op.inputs[x.index].rank == f.op.inputs[w.index].rank
            and not f.op.attrs.kwargs)  # fmt: skip


def _batch_norm_ok(f, batched) -> bool:
    args = f.op.attrs.args  # (grad,) input, ...
    first = 1 if f.op.attrs.target is aten.native_batch_norm_backward.default else 0
    xs = args[: first + 1]  # given rows where stored once (Note [operands a stacked rule needs
    # with rows])
    if not (all(isinstance(v, Slot) for v in xs) and f.op.inputs[args[first].index].rank >= 2
            and not f.op.attrs.kwargs):  # fmt: skip
        return False
    if not first and args[5]:  # training updates the running statistics: they are per row
        return all(not isinstance(v, Slot) or batched[v.index] for v in args[3:5])
    return True


def _fold_batch(x):
    rows, n = x.shape[:2]
    return x.reshape(rows * n, *x.shape[2:])


def _conv_stacked(x, w, b, *rest, flags, weights=None):
    """``aten.convolution`` on stacked rows with an invariant weight: one call (``weights``:
    its gathered taps, Note [one gather of a convolution's taps])."""
    out = _convolution(_fold_batch(x), w, b, *rest, weights=weights)
    return out.view(x.shape[0], x.shape[1], *out.shape[1:])


def _conv_backward_stacked(grad, x, w, bias_sizes, *rest, flags, summed=False, weights=None):
    """``aten.convolution_backward`` on stacked rows: the input gradient in one call, the
    weight and bias gradients per row (Note [convolutions and batch norm on stacked rows]),
    or, ``summed``, their sums over the rows from the same one call (Note [convolution weight
    gradients summed over replicas] in lower.py). ``weights``: as for ``_conv_stacked``."""
    *conv, mask = rest
    if summed:
        grad_x, grad_w, grad_b = _convolution_backward(
            _fold_batch(grad), _fold_batch(x), w, bias_sizes, *conv, mask, weights=weights
        )
        return (None if grad_x is None else grad_x.view(x.shape)), grad_w, grad_b
    grad_x = grad_w = grad_b = None
    if mask[0]:
        grad_x = _convolution_backward(_fold_batch(grad), _fold_batch(x), w, bias_sizes,
                                       *conv, [True, False, False], weights=weights)[0]  # fmt: skip
        grad_x = grad_x.view(x.shape)
    if mask[1] or mask[2]:
        per_row = [_convolution_backward(grad[r], x[r], w, bias_sizes, *conv,
                                         [False, mask[1], mask[2]])
                   for r in range(x.shape[0])]  # fmt: skip
        grad_w = torch.stack([p[1] for p in per_row]) if mask[1] else None
        grad_b = torch.stack([p[2] for p in per_row]) if mask[2] else None
    return grad_x, grad_w, grad_b


# Note [convolutions with one output position]
#     Where a convolution's output has a single position (resnet's last stage on 32x32
#     images: 3x3 kernels over 1x1 images, and the stride-2 convolutions into it), every
#     output reads the same window of its image through the same kernel taps, so the
#     convolution is one matmul of the images' windows ``[N, C_in * window]`` with those taps
#     of the weight ``[C_out, C_in * window]``; its gradients are the two matmuls of that
#     product (the taps that only see padding get zero). oneDNN runs these shapes at a
#     tenth of its usual rate (the backward of a 512-channel 3x3 convolution over 32 1x1
#     images: 12 ms, where the matmuls and the taps' scatter take 1.4 ms on one core). Only
#     plain convolutions (not transposed, one group, no dilation) take this form.
def _one_position(x_shape, w_shape, stride, padding, dilation, transposed, output_padding,
                  groups):  # fmt: skip
    """``(input window, kernel taps)`` as index tuples when a convolution has one output
    position (Note [convolutions with one output position]), else None."""
    spatial = len(x_shape) - 2
    if (transposed or groups != 1 or len(w_shape) != len(x_shape)
            or not len(stride) == len(padding) == len(dilation) == spatial):  # fmt: skip
        return None
    window, taps = [slice(None)] * 2, [slice(None)] * 2
    for size, k, s, p, d in zip(x_shape[2:], w_shape[2:], stride, padding, dilation,
                                strict=True):  # fmt: skip
        if d != 1 or not 0 <= p < k or (size + 2 * p - k) // s + 1 != 1:
            return None
        seen = min(size, k - p)  # input positions 0.. meet taps p..
        window.append(slice(0, seen))
        taps.append(slice(p, p + seen))
    return tuple(window), tuple(taps)


def _taps(w, taps):
    """The flat indices of the kernel ``taps`` within ``w``'s ``prod(kernel)`` positions, or
    None when they are all of them."""
    kernel = w.shape[2:]
    index = torch.arange(math.prod(kernel), device=w.device).view(kernel)[taps[2:]]
    return None if index.numel() == math.prod(kernel) else index


def _tap_weights(w, taps):
    """``w[taps]`` as ``[C_out, C_in * taps]``; gathered along the flattened kernel dim
    (``index_select``: a strided slice copy of 2-element rows is ten times slower)."""
    index = _taps(w, taps)
    if index is None:
        return w.reshape(w.shape[0], -1)
    flat = w.reshape(w.shape[0] * w.shape[1], -1)
    return flat.index_select(1, index.reshape(-1)).view(w.shape[0], -1)


def _scatter_taps(cols, index, w):
    """``[C_out, C_in * taps]`` gradients of the kernel taps ``index`` as ``w``'s gradient,
    zero at the other taps. One tap: ``index_copy_``; several: ``scatter_``, which writes
    each row's taps in one go where ``index_copy_`` makes a strided pass over the whole
    gradient per tap (resnet18's 4-tap stride-2 convolution: 0.93 -> 0.31 ms, one core)."""
    flat = w.new_zeros(w.shape[0] * w.shape[1], math.prod(w.shape[2:]))
    index = index.reshape(-1)
    values = cols.view(flat.shape[0], -1)
    if index.numel() == 1:
        return flat.index_copy_(1, index, values).view(w.shape)
    return flat.scatter_(1, index.expand(flat.shape[0], -1), values).view(w.shape)


# Note [one gather of a convolution's taps]
#     A one-position convolution (Note [convolutions with one output position]) whose kernel
#     has taps that only see padding gathers the others from its weight: forward, and again
#     for the input gradient. The gather reads the whole weight (a 3x3 kernel's centre tap is
#     every ninth element: every cache line), about 0.3 ms for a 512x512x3x3 weight out of
#     cache, four times a step on resnet18. The explicit emitter gathers once, at the
#     forward, into a value the backward of the same weight and taps in the same block then
#     reads (``_Emitter.shared_taps``: (weight root, taps) -> value name); an op that writes
#     the weight in between drops the entry (lower.py, ``_Emitter.block``), and the backward
#     releases it.
def _shared_taps(em, f, ind: str) -> str | None:
    """Note [one gather of a convolution's taps]: the name of the gathered taps this
    convolution (forward: emitted here) or its backward reads, or None."""
    if f.op.attrs.target not in (aten.convolution.default, aten.convolution_backward.default):
        return None
    args = f.op.attrs.args
    backward = f.op.attrs.target is aten.convolution_backward.default
    x, w = (args[1], args[2]) if backward else (args[0], args[1])
    conv = args[4:10] if backward else args[3:9]
    if backward and not args[10][0]:  # the gathered taps serve the input gradient only
        return None
    found = _one_position(f.op.inputs[x.index].shape, f.op.inputs[w.index].shape, *conv)
    w_shape = f.op.inputs[w.index].shape
    if found is None or math.prod(w_shape[2:]) == math.prod(
        len(range(*t.indices(k))) for t, k in zip(found[1][2:], w_shape[2:], strict=True)
    ):  # every tap: the weight itself, no gather
        return None
    # the weight and which of its taps (one weight may serve convolutions of other taps)
    key = (em.a.root_of(f.ins[w.index]), tuple((t.start, t.stop) for t in found[1][2:]))
    if backward:
        return em.shared_taps.pop(key, None)
    name = em.p.fresh()
    gather = em.p.literal(_tap_weights)
    em.lines.append(f"{ind}{name} = {gather}({f.ins[w.index]}, {em.p.literal(found[1])})")
    stale = em.shared_taps.pop(key, None)
    if stale is not None:
        em.lines.append(f"{ind}del {stale}")
    em.shared_taps[key] = name
    return name


# Note [convolutions channels last]
#     oneDNN computes a convolution over channels-last (NHWC) images in place, but an NCHW one
#     through its blocked layout: it reorders the input, and the output back, on every call,
#     and the backward reorders the output gradient twice and the input gradient back (on the
#     dropout CNN's 26x26 activations about a quarter of the convolutions' time, one core).
#     A single-channel image is both layouts at once, so a conv net on such images (MNIST)
#     runs its stacked convolutions over images of at least ``_CHANNELS_LAST_POSITIONS``
#     positions channels-last: the input is given channels-last strides (a view: oneDNN reads
#     ambiguous strides as NCHW), and the activations stay in that layout from one
#     convolution to the next (batch norm, ReLU, pooling and the gradients of each keep the
#     layout of their input). An NCHW image with more channels stays NCHW, and so does the
#     net after it: the channels-last kernels sum in another order, and a chaotic net
#     (resnet18 on random labels, tests/test_compile_ported_examples.py) would then drift
#     from eager's NCHW numbers by more than rounding; resnet18 at 32x32 gained nothing from
#     the layout either. On smaller images (4x4, 2x2) oneDNN's channels-last kernels are
#     slower, up to twice, than its blocked ones, so those run NCHW, converted back where a
#     channels-last activation reaches them (oneDNN takes a channels-last input as a request
#     for that layout). A view that the layout does not allow is a copy (Note [recorded views
#     meet other layouts] in capture.py).
_CHANNELS_LAST_POSITIONS = 64  # measured: 8x8 images gain 4-8 %, 4x4 ones lose 0-60 %


def _is_channels_last(x) -> bool:
    """Whether ``x`` is 4-d images with channels-last strides (more than one channel)."""
    return (x.dim() == 4 and x.shape[1] > 1 and x.stride(1) == 1
            and x.is_contiguous(memory_format=torch.channels_last))  # fmt: skip


def _conv_layout(x):
    """4-d CPU images in the layout their convolution runs in (Note [convolutions channels
    last]): channels-last where they are (or have one channel) and are large enough."""
    if x.device.type != "cpu" or x.dim() != 4:
        return x
    if math.prod(x.shape[2:]) < _CHANNELS_LAST_POSITIONS:
        return x.contiguous()
    if x.shape[1] == 1 or _is_channels_last(x):
        return _channels_last(x)
    return x


def _like(grad, x):
    """The output gradient of a convolution over ``x`` (in its layout) in the same layout."""
    if x.device.type != "cpu" or x.dim() != 4:
        return grad
    if x.stride(1) == 1 and x.is_contiguous(memory_format=torch.channels_last):
        return _channels_last(grad)
    return grad.contiguous()


def _channels_last(x):
    """4-d images as channels-last: a view where they already are, or have one channel."""
    _, c, h, w = x.shape
    strides = (c * h * w, 1, w * c, c)
    if x.stride() == strides:
        return x
    if x.is_contiguous(memory_format=torch.channels_last):  # size-1 dims: the same elements
        return x.as_strided(x.shape, strides)
    return x.contiguous(memory_format=torch.channels_last)


def _convolution(x, w, b, *conv, weights=None):
    """``aten.convolution``, as a matmul where it has one output position (Note
    [convolutions with one output position]); ``weights``: ``_tap_weights(w, taps)`` when
    already gathered."""
    found = _one_position(x.shape, w.shape, *conv)
    if found is None:
        return aten.convolution(_conv_layout(x), w, b, *conv)
    window, taps = found
    cols = x[window].reshape(x.shape[0], -1)
    weights = (_tap_weights(w, taps) if weights is None else weights).t()
    out = gemm(cols, weights, b)  # Note [gemm kernel]: twice torch.mm's rate on these
    return out.view(x.shape[0], w.shape[0], *[1] * (x.dim() - 2))


def _convolution_backward(grad, x, w, bias_sizes, *rest, weights=None):
    """``aten.convolution_backward``, as matmuls where the convolution has one output
    position (Note [convolutions with one output position]); ``weights`` as for
    ``_convolution``."""
    *conv, mask = rest
    found = _one_position(x.shape, w.shape, *conv)
    if found is None:
        x = _conv_layout(x)
        return aten.convolution_backward(_like(grad, x), x, w, bias_sizes, *rest)
    window, taps = found
    g = grad.reshape(grad.shape[0], -1)  # [N, C_out]
    grad_x = grad_w = grad_b = None
    if mask[0]:
        cols = gemm(g, _tap_weights(w, taps) if weights is None else weights)
        if x[window].shape == x.shape:
            grad_x = cols.view(x.shape)
        else:
            grad_x = x.new_zeros(x.shape)
            grad_x[window] = cols.view(grad_x[window].shape)
    if mask[1]:
        cols = gemm(g.t(), x[window].reshape(x.shape[0], -1))
        index = _taps(w, taps)
        grad_w = cols.view(w.shape) if index is None else _scatter_taps(cols, index, w)
    if mask[2]:
        grad_b = g.sum(0)
    return grad_x, grad_w, grad_b


def _channels_in(x):  # [rows, N, C, *S] -> [N, rows * C, *S]
    rows, n, c = x.shape[:3]
    return x.transpose(0, 1).reshape(n, rows * c, *x.shape[3:])


def _channels_out(y, rows: int):  # [N, rows * C, *S] -> [rows, N, C, *S]
    return y.view(y.shape[0], rows, -1, *y.shape[2:]).transpose(0, 1).contiguous()


def _per_channel(p, rows: int, batched: bool):  # [C] or [rows, C] -> [rows * C]
    """A shared ``[C]`` is copied once per row by ``cat`` (``repeat`` costs twenty times as
    much on these small vectors, about 50 calls a step on resnet18)."""
    if p is None or p.numel() == 0:  # eval mode's empty saved statistics stay empty, 1-d
        return None if p is None else p.reshape(0)
    return p.reshape(-1) if batched else torch.cat([p] * rows)


def _per_row_channels(t, rows: int):  # [rows * C] -> [rows, C]
    return None if t is None else t.view(rows, t.numel() // rows)


def _batch_norm_stacked(x, w, b, mean, var, training, momentum, eps, *, flags):
    """``aten.native_batch_norm`` per replica on stacked rows (Note [convolutions and batch
    norm on stacked rows]). In a folded loop (Note [fold the accumulation loop]) the running
    statistics keep their R rows while ``x`` has one block of R rows per iteration: each
    block is normalised by its own calls, in order, so the statistics see every iteration's
    update as the loop would have made it."""
    rows = x.shape[0]
    per = mean.shape[0] if training and mean is not None and flags[3] else rows
    if x[0].numel() >= _BN_ROW_NUMEL:
        return _batch_norm_rows(x, w, b, mean, var, training, momentum, eps, flags)
    out = torch.empty_like(x)
    saved = []
    for i in range(0, rows, per):
        part = slice(i, i + per)
        stats = [_per_channel(t, per, flag) for t, flag in ((mean, flags[3]), (var, flags[4]))]
        y, save_mean, save_invstd = aten.native_batch_norm(
            _channels_in(x[part]), _per_channel(_rows(w, part, flags[1]), per, flags[1]),
            _per_channel(_rows(b, part, flags[2]), per, flags[2]), *stats, training,
            momentum, eps,
        )  # fmt: skip
        for orig, flat in zip((mean, var), stats, strict=True):
            # a (per-row) running statistic that was not a view of its variable: write it back
            if training and orig is not None and flat.data_ptr() != orig.data_ptr():
                orig.copy_(flat.view(orig.shape))
        out[part].copy_(y.view(y.shape[0], per, -1, *y.shape[2:]).transpose(0, 1))
        saved.append((_per_row_channels(save_mean, per), _per_row_channels(save_invstd, per)))
    if len(saved) == 1:
        return out, *saved[0]
    return out, *(torch.cat(s) for s in zip(*saved, strict=True))


def _row(p, i: int, batched: bool):
    """Row ``i`` of a per-row parameter or statistic (whose rows repeat every ``len(p)``
    rows: the running statistics of a folded loop); a shared one as it is."""
    return p[i % p.shape[0]] if batched and p is not None else p


def _batch_norm_rows(x, w, b, mean, var, training, momentum, eps, flags):
    """``_batch_norm_stacked`` as one call per row, in row order, each writing into its row
    of the outputs (Note [convolutions and batch norm on stacked rows])."""
    rows = x.shape[0]
    channels = x.shape[2] if training else 0  # evaluation saves no statistics
    out = torch.empty_like(x)
    save_mean, save_invstd = x.new_empty(rows, channels), x.new_empty(rows, channels)
    for i in range(rows):
        aten.native_batch_norm.out(
            x[i], _row(w, i, flags[1]), _row(b, i, flags[2]), _row(mean, i, flags[3]),
            _row(var, i, flags[4]), training, momentum, eps,
            out=out[i], save_mean=save_mean[i], save_invstd=save_invstd[i],
        )  # fmt: skip
    return out, save_mean, save_invstd


def _rows(p, part: slice, batched: bool):
    """A per-row parameter's rows of one block (a shared one as it is)."""
    return p[part] if batched and p is not None and p.numel() else p


def _batch_norm_backward_stacked(grad, x, w, mean, var, save_mean, save_invstd, training, eps,
                                 mask, *, flags):  # fmt: skip
    """``aten.native_batch_norm_backward`` per replica on stacked rows. Training reads only
    the saved statistics (the running ones may have fewer rows in a folded loop)."""
    rows = x.shape[0]
    if training:
        mean = var = None
    if x[0].numel() >= _BN_ROW_NUMEL:
        channels = x.shape[2]
        grads = (torch.empty_like(x), x.new_empty(rows, channels), x.new_empty(rows, channels))
        for i in range(rows):
            aten.native_batch_norm_backward.out(
                grad[i], x[i], _row(w, i, flags[2]), _row(mean, i, flags[3]),
                _row(var, i, flags[4]), _row(save_mean, i, flags[5]),
                _row(save_invstd, i, flags[6]), training, eps, mask,
                out0=grads[0][i], out1=grads[1][i], out2=grads[2][i],
            )  # fmt: skip
        return tuple(g if m else None for g, m in zip(grads, mask, strict=True))
    grad_x, grad_w, grad_b = aten.native_batch_norm_backward(
        _channels_in(grad), _channels_in(x), _per_channel(w, rows, flags[2]),
        _per_channel(mean, rows, flags[3]), _per_channel(var, rows, flags[4]),
        _per_channel(save_mean, rows, flags[5]), _per_channel(save_invstd, rows, flags[6]),
        training, eps, mask,
    )  # fmt: skip
    grad_x = None if grad_x is None else _channels_out(grad_x, rows)
    return grad_x, _per_row_channels(grad_w, rows), _per_row_channels(grad_b, rows)


_CNN = {
    aten.convolution.default: _conv_ok,
    aten.convolution_backward.default: _conv_backward_ok,
    aten.native_batch_norm.default: _batch_norm_ok,
    aten.native_batch_norm_backward.default: _batch_norm_ok,
}
_CNN_STACKED = {
    aten.convolution.default: _conv_stacked,
    aten.convolution_backward.default: _conv_backward_stacked,
    aten.native_batch_norm.default: _batch_norm_stacked,
    aten.native_batch_norm_backward.default: _batch_norm_backward_stacked,
}


_ATTENTION = {  # the number of leading tensor arguments
    aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 6,
}


# Note [operands a stacked rule needs with rows]
#     A stacked rule runs one call over every replica's rows, and an operand stored once
#     (replica-invariant: a replicated weight, a gradient all-reduced over the replicas) has
#     no leading rows. Where a rule's helper reads an operand as rows (a kernel would index
#     past an invariant one, or broadcast its first dim against the rows: NaN gradients in a
#     tensor-parallel GPT-2 block once), the rule declares that operand here, once, by its
#     argument position (a list argument: every element; ``_EVERY``: every tensor argument).
#     ``emit_torch``, the one place that emits the rules, expands each declared operand that
#     is stored once to the rows (``expand``: a view, no copy; the helpers read strided
#     operands) before any rule sees it, and the rule then counts it as stacked. An operand a
#     rule handles either way (a convolution's weight, layer norm's affine parameters, an
#     attention mask) is left out: it stays one copy. A rule with a single tensor operand
#     needs nothing: a rule runs stacked only when an operand is. No declared operand may be
#     written in place (an expanded view cannot be), which ``emit_torch`` checks.
#     tests/test_explicit_invariant_operands.py gives every declared rule each of its operands
#     stored once in turn, against the op run per replica in eager torch.
_EVERY = "every tensor argument"
_ROWS: dict[Any, tuple[int, ...] | str] = {
    **dict.fromkeys(_RANDOM_ELEMENTWISE, _EVERY),  # every row draws its own values
    **dict.fromkeys(_DIM1 | _SOFTMAX_BACKWARD, _EVERY),  # gather's index, scatter's source
    **_POOL,
    **dict.fromkeys(_INDEXED, (0, 3)),  # self and source; the index must be invariant
    aten.nll_loss_forward.default: (0, 1),
    aten.nll_loss_backward.default: (0, 1, 2, 6),
    aten.convolution.default: (0,),
    aten.convolution_backward.default: (0, 1),
    aten.native_batch_norm.default: (0,),
    aten.native_batch_norm_backward.default: (0, 1),
    aten.native_layer_norm.default: (0,),
    aten.native_layer_norm_backward.default: (0, 1, 3, 4),
    aten.embedding_dense_backward.default: (0, 1),
    aten.cat.default: (0,),
    aten.stack.default: (0,),
    **{target: tuple(range(n)) for target, n in _ATTENTION.items()},
}


def needs_rows(op: Op) -> set[int]:
    """The input indices of ``op`` its stacked rule reads as rows (Note [operands a stacked
    rule needs with rows])."""
    positions = _ROWS.get(op.attrs.target, ())
    args, kwargs = op.attrs.args, op.attrs.kwargs
    if isinstance(positions, str):  # _EVERY
        leaves = pytree.tree_flatten((list(args), dict(kwargs)))[0]
    else:
        leaves = pytree.tree_flatten([args[i] for i in positions if i < len(args)])[0]
    return {v.index for v in leaves if isinstance(v, Slot)}


def _attention_stacked(fn, tensors, *args, mask_batched: bool = False, **kwargs):
    """Flash attention (forward or backward) on stacked rows: per-replica ``[B, H, S, D]``
    (and ``[B, H, S]`` logsumexp) values fold their rows into the batch dim; every output
    gets its rows back. Each sequence attends only within itself, so the fold is exact. A
    mask with one row per sequence is repeated (invariant) or folded (per replica) alike; one
    that broadcasts over the batch stays as it is."""
    rows, batch = tensors[0].shape[:2]
    mask = kwargs.get("attn_mask")
    if mask is not None and (mask_batched or (mask.dim() == 4 and mask.shape[0] == batch > 1)):
        if not mask_batched:
            mask = mask.expand(rows, *mask.shape)
        kwargs["attn_mask"] = mask.expand(rows, batch, *mask.shape[2:]).reshape(
            rows * batch, *mask.shape[2:]
        )
    out = fn(*[t.reshape(-1, *t.shape[2:]) for t in tensors], *args, **kwargs)
    return tuple(o.view(rows, -1, *o.shape[1:]) for o in out)


def _pool_stacked(fn, tensors, *args):
    """A 2-d pooling op (forward or backward) on stacked rows: per-replica ``[N, C, H, W]``
    values fold the rows into the batch dim; per-replica ``[C, H, W]`` ones are a batch
    already. Outputs get their rows back."""
    x = args[tensors[0]]
    if x.dim() == 4:  # [rows, C, H, W]: the rows are the batch
        return fn(*args)
    rows, n = x.shape[:2]
    args = list(args)
    for i in tensors:
        args[i] = args[i].reshape(rows * n, *args[i].shape[2:])
    out = fn(*args)
    if isinstance(out, tuple):
        return tuple(o.view(rows, n, *o.shape[1:]) for o in out)
    return out.view(rows, n, *out.shape[1:])


# Note [max pooling channels last]
#     On CPU, ATen's max pooling kernel for contiguous (NCHW) images walks each plane's windows
#     one output at a time; its channels-last kernel vectorises over the channels and is about
#     seven times faster on a conv net's activations, the layout change included. The indices
#     it returns are the same positions within each image's plane, ties and NaNs resolved
#     alike (tests/test_compile_conv.py compares both against eager). Images that come in
#     NCHW get their results back in NCHW; a convolution's channels-last output (Note
#     [convolutions channels last]) keeps its layout, results and gradient alike: the
#     backward's channels-last kernel wants its output gradient and indices in that layout
#     too (given NCHW ones it runs the plane-walking kernel and copies into the image).
def _max_pool_channels_last(x, *args):
    """``aten.max_pool2d_with_indices`` through the channels-last kernel on CPU (Note [max
    pooling channels last])."""
    if x.device.type != "cpu" or x.dim() != 4 or _is_channels_last(x):
        return aten.max_pool2d_with_indices(x, *args)
    out, indices = aten.max_pool2d_with_indices(
        x.contiguous(memory_format=torch.channels_last), *args
    )
    return out.contiguous(), indices.contiguous()


def _max_pool_backward_channels_last(grad, x, *args):
    """``aten.max_pool2d_with_indices_backward`` in the layout of a channels-last image (Note
    [max pooling channels last])."""
    if x.device.type == "cpu" and _is_channels_last(x):
        grad, args = _channels_last(grad), (*args[:-1], _channels_last(args[-1]))
    return aten.max_pool2d_with_indices_backward(grad, x, *args)


_POOL_KERNELS = {
    aten.max_pool2d_with_indices.default: _max_pool_channels_last,
    aten.max_pool2d_with_indices_backward.default: _max_pool_backward_channels_last,
}


def _expand_stacked(x, size):
    """``aten.expand`` per replica on stacked ``x``: new leading dims go after the rows."""
    extra = len(size) - (x.dim() - 1)
    if extra > 0:
        x = x.reshape(x.shape[0], *([1] * extra), *x.shape[1:])
    return x.expand(x.shape[0], *size)


def _per_row(p, x, shape):
    """A per-replica affine parameter ``[rows, *shape]`` broadcastable against ``x``."""
    if p is None:
        return None
    return p.reshape(p.shape[0], *[1] * (x.dim() - 1 - len(shape)), *p.shape[1:])


def _layer_norm_stacked(x, shape, weight, bias, eps, affine_batched):
    """``aten.native_layer_norm`` on stacked rows (the trailing dims are normalised, so rows
    stay independent); per-replica ``weight``/``bias`` are applied per row."""
    if not affine_batched:
        return aten.native_layer_norm(x, shape, weight, bias, eps)
    out, mean, rstd = aten.native_layer_norm(x, shape, None, None, eps)
    if weight is not None:
        out = out * (_per_row(weight, x, shape) if weight.dim() > len(shape) else weight)
    if bias is not None:
        out = out + (_per_row(bias, x, shape) if bias.dim() > len(shape) else bias)
    return out, mean, rstd


def _layer_norm_backward_stacked(grad, x, shape, mean, rstd, weight, bias, mask, affine_batched):
    """``aten.native_layer_norm_backward`` per replica on stacked rows: the input gradient
    is per row already; the weight and bias gradients are each row's own sums."""
    if affine_batched:  # the input gradient reads the weight only, as a scale of grad
        scaled = grad
        if weight is not None:
            scaled = grad * (_per_row(weight, x, shape) if weight.dim() > len(shape) else weight)
        grad_x = aten.native_layer_norm_backward(scaled, x, shape, mean, rstd, None, None,
                                                 [mask[0], False, False])[0]  # fmt: skip
    else:
        grad_x = aten.native_layer_norm_backward(grad, x, shape, mean, rstd, weight, bias,
                                                 [mask[0], False, False])[0]  # fmt: skip
    dims = tuple(range(1, grad.dim() - len(shape)))
    grad_w = grad_b = None
    if mask[1] and weight is not None:
        prod = grad * ((x - mean) * rstd)
        grad_w = prod.sum(dims) if dims else prod
    if mask[2] and bias is not None:
        grad_b = grad.sum(dims) if dims else grad.clone()
    return grad_x, grad_w, grad_b


def _embedding_backward_stacked(grad, ids, num_weights, padding_idx, scale):
    """``aten.embedding_dense_backward`` per replica on stacked rows: every row's gradient
    table, as one ``index_add_`` into ``[rows * num_weights, D]``."""
    rows, width = grad.shape[0], grad.shape[-1]
    ids = ids.long()
    offsets = torch.arange(rows, device=ids.device).view(rows, *[1] * (ids.dim() - 1))
    flat_grad = grad.reshape(-1, width)
    if padding_idx >= 0:  # the padding row gets no gradient
        flat_grad = flat_grad * (ids.reshape(-1, 1) != padding_idx).to(grad.dtype)
    table = grad.new_zeros(rows * num_weights, width)
    table.index_add_(0, (ids + offsets * num_weights).reshape(-1), flat_grad)
    return table.view(rows, num_weights, width)


# Note [one op through torch's batching rule]
#     An aten op without a stacked rule of this project (``roll``, ``as_strided``, a
#     convolution with a per-replica weight) need not send its whole fragment to vmap: inside
#     an explicitly batched fragment it runs alone under ``torch.func.vmap`` over the rows,
#     per-replica tensors batched on their leading dim and replica-invariant ones shared, so
#     torch's own batching rule for it computes every replica's result in one call (a view
#     stays a view of the stacked rows, an in-place op writes its stacked target). The rest of
#     the fragment keeps its stacked forms. The vmapped call is traced once (per input layout)
#     into the stacked ops torch's rule produces, so later steps pay no vmap dispatch. Taken
#     only for an op torch has a batching rule for (its ``FuncTorchBatched`` kernel, or the
#     project's, Note [aten batching rules]), that draws no random numbers, and whose every
#     output is per replica (as the analysis makes the outputs of an op with a per-replica
#     input); any other op keeps its fragment on the vmap path. An op torch has no batching
#     rule for (``affine_grid_generator``), or one vmap decomposes
#     (``FuncTorchBatchedDecomposition``: ``binary_cross_entropy_with_logits``), runs once per
#     replica on its rows instead, the results stacked (``_OneOpVmap.per_slice``): a
#     decomposition rounds differently from the op's kernel, and a last bit can be all the
#     difference (affine_grid's decomposed grid lands grid_sample a hair off the pixel
#     centres its kernel hits, and grid_sample's gradient there jumps by 40 %: the spatial
#     transformer tutorial). Only an op that writes or aliases an input (``tril_``), where
#     stacking would break what it returns, runs torch's decomposition under vmap
#     (``_batching_form``). The fragment's ``vmapped_ops`` lists the ops that took this
#     path (bench_generality.py prints them); one whose trace failed runs under vmap at every
#     step, and ``explain()`` says so.
_BATCHING_KEY = "FuncTorchBatched"


def _one_op_vmap_ok(f, a) -> bool:
    """Whether ``f`` can run alone through torch's batching rule in an explicitly batched
    fragment (Note [one op through torch's batching rule])."""
    target = f.op.attrs.target
    if (not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten"
            or f in a.sum_adds or f in a.sum_reads or draws_random(f.op)
            or target in PER_ELEMENT):  # fmt: skip
        return False
    if not any(a.b(n) for n in f.ins) or not all(a.b(n) for n in f.outs):
        return False
    return _batching_form(target) is not None


def _batching_form(target):
    """What runs ``target`` under vmap (Note [one op through torch's batching rule]): the op
    itself where torch or the project has a batching rule for it, ``PER_SLICE`` where it is
    functional (run on each replica's rows), else torch's decomposition of it, else None."""
    if target in COVERED or torch._C._dispatch_has_kernel_for_dispatch_key(
        target.name(), _BATCHING_KEY
    ):
        return SAFE_FORMS.get(target, target)  # as the generated code calls it
    schema = target._schema
    if not schema.is_mutable and not any(r.alias_info for r in schema.returns):
        return PER_SLICE
    return decomposition_table.get(target)


PER_SLICE = object()  # ``_batching_form``: the op itself, once per replica


_MAX_TRACES = 4  # layouts traced per op before it keeps calling vmap


def _trace_fake(fn, tensors):
    """``fn`` traced on fake tensors shaped like ``tensors``."""
    return trace_fake(fn, *tensors)


class _OneOpVmap:
    """``target`` called on its captured arguments under ``torch.func.vmap`` over the rows of
    its per-replica tensors (``in_dims`` 0; None for replica-invariant ones). The vmapped call
    is traced once per input layout into the stacked ops torch's batching rule produces (as a
    whole fragment is: Note [vmap traced once] in executor.py), which later calls with that
    layout run without vmap's dispatch; an input's shape, strides, storage offset, dtype and
    device are its layout, so a recorded view's strides and offsets stay true."""

    def __init__(self, target, args, kwargs, batched: list[bool], device):
        leaves, self.spec = pytree.tree_flatten((list(args), dict(kwargs)))
        self.slots = [i for i, v in enumerate(leaves) if isinstance(v, Slot)]
        self.leaves = [device if isinstance(v, torch.device) else v for v in leaves]
        self.name = str(target)
        form = _batching_form(target)
        self.per_slice = form is PER_SLICE
        self.reads_offsets = any(a.name == "storage_offset" for a in target._schema.arguments)
        self.target = target if self.per_slice or form is None else form
        self.in_dims = tuple(0 if batched[leaves[i].index] else None for i in self.slots)
        self.vmapped = (
            self._slices if self.per_slice else torch.func.vmap(self._one, in_dims=self.in_dims)
        )
        self.traces: dict[tuple, Any] = {}
        self.failed: str | None = None  # why a trace failed (it then runs under vmap)
        self.none_at: tuple[int, ...] = ()  # the positions of None in a tuple result

    def call(self, *tensors):
        key = tuple((t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)
                    for t in tensors)  # fmt: skip
        graph = self.traces.get(key)
        if graph is None and len(self.traces) < _MAX_TRACES:
            try:
                graph = _trace_fake(self.vmapped, tensors)
            except Exception as e:  # noqa: BLE001 - any failure keeps calling vmap (reported)
                graph = self.vmapped
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                self.failed = f"{type(e).__name__}: {first[:200]}"
            self.traces[key] = graph
        out = (graph or self.vmapped)(*tensors)
        if self.none_at:
            out = list(out)
            for i in self.none_at:
                out.insert(i, None)
            return tuple(out)
        return out

    def _one(self, *tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.slots, tensors, strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.target(*args, **kwargs)
        if not isinstance(out, tuple):
            return out
        # A plain tuple of tensors: a decomposition's named tuple type (made at run time by
        # torch's out_wrapper) is not importable from the traced graph's code, and vmap
        # returns tensors only (a backward's gradient left out by its output mask is None).
        self.none_at = tuple(i for i, o in enumerate(out) if o is None)
        return tuple(o for o in out if o is not None)

    def _slices(self, *tensors):
        """The op on each replica's rows, the results stacked (``per_slice``)."""
        rows = next(t.shape[0] for t, d in zip(tensors, self.in_dims, strict=True) if d == 0)
        # (an op that takes a storage offset, ``as_strided_copy``, reads each replica's rows in a
        # storage of their own, as one replica's tensor is; the others read them in place)
        own = self.reads_offsets
        outs = [
            self._one(*[(t[r].clone() if own else t[r]) if d == 0 else t
                        for t, d in zip(tensors, self.in_dims, strict=True)])
            for r in range(rows)
        ]  # fmt: skip
        if isinstance(outs[0], tuple):
            return tuple(torch.stack(list(o)) for o in zip(*outs, strict=True))
        return torch.stack(outs)

    def __call__(self, *tensors):
        return self.call(*tensors)


def _emit_one_op_vmap(em, f, ind: str) -> None:
    """``f`` through torch's batching rule (Note [one op through torch's batching rule]): its
    tensors are passed as they are (no rank padding: vmap aligns each replica's own)."""
    attrs = f.op.attrs
    batched = [em.a.b(n) for n in f.ins]
    fn = _OneOpVmap(attrs.target, attrs.args, attrs.kwargs, batched, em.p.device)
    leaves, _ = pytree.tree_flatten((list(attrs.args), dict(attrs.kwargs)))
    names = [f.ins[v.index] for v in leaves if isinstance(v, Slot)]
    em.one_op_vmaps.append(fn)
    _emit_outputs(em, f, ind, f"{em.p.literal(fn)}({', '.join(names)})")


def _random_factory(op: Op) -> bool:
    """A random factory (``rand``, ``randn``, ``randint``): no tensor argument, its first
    argument the result's ``size``; on stacked rows it draws ``[rows, *size]``."""
    schema = op.attrs.target._schema.arguments
    return not op.inputs and bool(schema) and schema[0].name == "size"
