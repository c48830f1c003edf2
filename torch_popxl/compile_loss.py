"""The loss of a compiled training step, split into per-micro-batch parts (``popxl.compile``).

Note [exact losses over micro-batches]
    The compiled step runs the loss on ``R * GA`` micro-batches, but its specification is the
    eager loop on the whole global batch. A loss that is a mean over samples equals the mean
    of the micro-batch means only while every micro-batch counts the same number of elements;
    a summed loss equals the *sum* of the micro-batch sums; a token mean with ``ignore_index``
    counts a different number of tokens in every micro-batch. So the loss is not treated as
    an opaque scalar: while it is captured, ``LossSplitter`` (a dispatch mode) follows the
    batch data through the loss and records every reduction of batch data to a scalar as a
    *term* (``aten.sum``, ``aten.mean``, a loss op with ``reduction='mean'`` or ``'sum'``,
    ``nll_loss`` whose mean divides by the counted weight ``total_weight``, ``x.sum() /
    mask.sum()``), and checks that the loss is a linear combination of terms with number
    coefficients (``recon + 0.5 * kl``, ``loss / 4``). Each micro-batch then contributes
    ``objective = sum_k c_k * w_k * term_k`` with

    * a sum: ``w = 1`` (the global sum is the sum of the parts),
    * a mean over a fixed number of elements, or a term that does not depend on the batch
      (a weight penalty): ``w = 1 / (R * GA)``,
    * a mean over a counted number of elements (``total_weight``, ``mask.sum()``, or a
      weighted count: a float sum without a gradient, per-sample weights' ``w.sum()``): its
      numerator (the sum) with ``w = 1 / N``, ``N`` the count over the whole global batch
      (reduce both, divide once). Where it is the whole loss (a cross-entropy, a model that
      returns its loss) ``N`` is summed in the step: the numerators are weighted by the
      static bound ``1 / K`` (elements per micro-batch times ``R * GA``, so the summed
      gradients keep a mean's magnitude) and the summed gradients multiplied by ``K / N``
      once. Among other terms (``label_smoothing``, ``ce + 0.1 * mse``) the counts are
      counted on the host before the step (``host_counts``: ``loss_fn`` run eagerly on the
      targets and synthetic outputs, twice, to check that the counts do not depend on the
      outputs) and ``1 / N`` is written to the program.

    The backward is seeded with 1 per micro-batch, the replicas' gradients are summed, and
    the reported loss is the sum of the objectives (times ``K / N``), so the value and the
    gradients are eager's on the global batch up to summation order. A loss that is not such
    a combination (``sqrt(mse)``, a product of two means, ``max`` over the batch) is refused
    when the program is built. With ``R * GA == 1`` the micro-batch is the global
    batch and the loss is used as captured. ``check_decomposition`` also evaluates a separate
    ``loss_fn`` eagerly on the first batch's targets, whole and in parts, so a division by
    the micro-batch's size hidden in a number is read as such (below) or is an error, never
    a silent difference.

Note [counts computed in the forward]
    Hugging Face models compute their losses in ``forward``: GPT2DoubleHeadsModel a token
    mean over the labels that are not -100 and a multiple-choice cross-entropy over rows
    (``out.loss + out.mc_loss``), BertForPreTraining a masked-LM token mean plus a
    next-sentence mean, the question-answering heads ``(start_ce + end_ce) / 2`` whose
    positions outside the sequence are clamped to an ignored index. Each is a counted mean
    whose count depends on the inputs the model was given (its labels), not on ``loss_fn``'s
    targets, so ``host_counts`` cannot count them. The captured graph says how: while the
    loss is captured, ``LossSplitter`` keeps every op that reads only the batch's data and
    constants (``labels != -100``, a pad and a slice of the labels, a clamp of positions;
    an ``nll_loss``'s ``total_weight`` reads only its targets and class weights, so its
    input is replaced by zeros). Where the forward holds a counted mean among other terms,
    ``count_recipe`` keeps the ops between the batch's leaves and each count, and at every
    step they are replayed eagerly on each micro-batch's host arrays: the global count of
    every term, summed over micro-batches (and instances), gives ``inv_counts`` as for a
    ``loss_fn``'s counts. A count that depends on the parameters (tokens routed to an expert)
    has no recipe and is refused. The splitter cannot see every way a forward pairs the
    samples of a micro-batch (a contrastive loss: a product of embeddings of two samples; a
    mixture of experts' load-balancing loss over all tokens: a product of two means over the
    batch), so a program that uses a recipe is checked once when it is built: the model and
    loss run eagerly in eval mode (no dropout) on the first batch, whole and in parts added
    up as the step adds them with the recipe's counts, and every term must agree (to 1e-3 of
    itself, so a term with a small weight, an auxiliary loss, is checked as closely), else
    the loss is refused; where the terms agree only with divisions by the micro-batch's
    rows read as means, it is captured again so (Note [a sum divided by the batch's size]).

Note [reductions over the rows]
    A sum or mean over the rows (dim 0) that keeps other dims is not a number, so it is not a
    term, but it is a statistic of the micro-batch: ``histc`` of routed experts, a router's
    probabilities summed over tokens. Linear ops keep it one (views, sums, a multiplication by
    a number or by a tensor that does not depend on the batch, a sum of two, zeros plus one),
    and where they reduce it to a number it is a term of its kind (a sum: ``w = 1``; a mean
    over rows: ``w = 1 / (R * GA)``), so ``x.mean(0).sum()`` adds up as eager's. Any other op
    on it alone (a product of two, a nonlinear function) is the first op that leaves the sums
    of parts; a loss it reaches as a number is refused, naming that op (Mixtral's
    load-balancing loss: the share of tokens routed to each expert times the mean routing
    probability, over the whole batch). An op that applies it to the rows (``h - h.mean(0)``,
    a hand-written batch norm) normalises them by a statistic of their micro-batch, as
    BatchNorm does (Note [per-replica batch statistics] in compile.py): rows as any other.

Note [a sum divided by the batch's size]
    Some means divide a sum by the batch's size taken as a Python number:
    ``kl_div(reduction='batchmean')`` (``sum / input.size(0)``), a soft-label
    ``cross_entropy`` (``sum / (numel / classes)``: rows, or rows x positions), a hand-written
    ``loss.sum() / x.shape[0]``. Captured on a micro-batch the number is the micro-batch's,
    so the plain reading (a sum times a number) would add ``R * GA`` such means up. A number
    is only a number in the graph, so which reading holds is decided by values: where the
    parts do not add up to the whole in ``check_decomposition``, a division of sums by a
    multiple of the micro-batch's rows is read as a mean over rows (``w = 1 / (R * GA)``) and
    checked again; if that adds up, the loss is captured again with that reading, else it is
    refused. A constant that happens to equal the rows (``loss.sum() / 8``) keeps the plain
    reading, which adds up.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .capture import VALUE_FREE
from .compile_masked import MaskedRows
from .compile_rows import real_rows

__all__ = [
    "MAX_COUNTS",
    "LossDecompositionError",
    "LossSplitter",
    "Split",
    "CountRecipe",
    "add_up",
    "check_decomposition",
    "parts_differ",
    "term_mismatch",
    "host_counts",
]

MAX_COUNTS = 8  # counted means a loss may combine with other terms (host counts)

aten = torch.ops.aten

_MEAN, _SUM = 1, 2  # torch's Reduction enum (0 is 'none')
# ops whose result is a scalar term when their ``reduction`` argument says so
_REDUCING_LOSSES = {
    aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default,
    aten.huber_loss.default, aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default, aten.soft_margin_loss.default,
    aten.multi_margin_loss.default, aten.multilabel_margin_loss_forward.default,
}  # fmt: skip
_NLL = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default}
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
_IN_PLACE = {aten.add_: aten.add, aten.sub_: aten.sub, aten.mul_: aten.mul, aten.div_: aten.div}
# linear ops (views, sums) that keep a reduction over the rows one
_ROW_LINEAR = {
    aten.sum, aten.mean, aten.neg, aten.t, aten.transpose, aten.permute, aten.select,
    aten.slice, aten.unsqueeze, aten.squeeze, aten.expand, aten.view, aten.reshape,
    aten._unsafe_view, aten.clone, aten._to_copy, aten.contiguous, aten.alias,
}  # fmt: skip
_SUMS = {aten.sum.default, aten.sum.dim_IntList}
_MEANS = {aten.mean.default, aten.mean.dim}
# ops that keep a scalar's linear form (a value-preserving cast or view)
_KEEP = {
    aten._to_copy.default, aten.clone.default, aten.alias.default, aten.view.default,
    aten._unsafe_view.default, aten.reshape.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.unsqueeze.default, aten.lift_fresh.default,
}  # fmt: skip


class LossDecompositionError(ValueError):
    """The loss cannot be split into micro-batch parts that add up to eager's; ``why``: the
    reason alone, where ``LossSplitter.split`` found it."""

    def __init__(self, message: str, why: str | None = None):
        super().__init__(message)
        self.why = why


def _cannot_split(why: str, chunks: int) -> LossDecompositionError:
    return LossDecompositionError(_explain(why, chunks), why)


@dataclass
class _Term:
    kind: str  # "sum" | "mean" (fixed count) | "count" (counted: ``count``) | "fixed"
    value: torch.Tensor
    count: torch.Tensor | None = None
    bound: int = 1  # elements per micro-batch the count can reach (its normaliser)
    # a counted mean's numerator: its sum (``value * count``, but finite where count is 0)
    numerator: torch.Tensor | None = None
    forward: bool = False  # recorded while the model's forward ran (not in ``loss_fn``)


@dataclass(frozen=True)
class _Ref:
    """Where a value of a count's recipe comes from: a leaf of the batch (``at``: its index),
    an output of an earlier op of the recipe (``at``: (op, output)), zeros (``at``: (shape,
    dtype)), or a constant tensor (``at``: the tensor)."""

    kind: str  # "leaf" | "out" | "zeros" | "const"
    at: Any


@dataclass(frozen=True)
class CountRecipe:
    """The counts of a loss's counted means from one micro-batch's data alone (Note [counts
    computed in the forward]): the ops of the captured forward and loss between the batch's
    leaves and each count, replayed eagerly on the host."""

    dtypes: tuple[tuple[int, torch.dtype], ...]  # (batch leaf index, its dtype as captured)
    ops: tuple[tuple[Any, Any, Any], ...]  # (op, args, kwargs) with ``_Ref``s for tensors
    counts: tuple[_Ref, ...]  # one per counted mean, in ``Split.counted``'s order

    def __call__(self, leaves: list) -> list[float]:
        """The counts of one micro-batch, ``leaves`` its batch leaves (arrays or tensors)."""
        values: dict[Any, torch.Tensor] = {}
        for i, dtype in self.dtypes:  # (copies: an op of the recipe may write in place)
            values[("leaf", i)] = torch.as_tensor(leaves[i]).to(dtype).clone()

        def value(x):
            if not isinstance(x, _Ref):
                return x
            if x.kind == "zeros":
                return torch.zeros(x.at[0], dtype=x.at[1])
            if x.kind == "const":
                return x.at
            return values[(x.kind, x.at)]

        for k, (func, args, kwargs) in enumerate(self.ops):
            out = func(*pytree.tree_map(value, args), **pytree.tree_map(value, kwargs))
            for j, o in enumerate(pytree.tree_leaves(out)):
                values[("out", (k, j))] = o
        return [float(value(c)) for c in self.counts]


# a term's coefficient: a number, or a scalar tensor that does not depend on the batch (a
# weight computed from the parameters, a buffer): the same in every micro-batch
Coef = float | torch.Tensor


def _nonzero(c: Coef) -> bool:
    return isinstance(c, torch.Tensor) or c != 0.0


@dataclass
class _Form:
    """``const + sum(coef * term)`` over term indices."""

    coefs: dict[int, Coef] = field(default_factory=dict)
    const: Coef = 0.0

    def scaled(self, c: Coef) -> _Form:
        return _Form({k: v * c for k, v in self.coefs.items()}, self.const * c)

    def plus(self, other: _Form, alpha: Coef = 1.0) -> _Form:
        coefs = dict(self.coefs)
        for k, v in other.coefs.items():
            coefs[k] = coefs.get(k, 0.0) + alpha * v
        return _Form(coefs, self.const + alpha * other.const)


def _is_scalar(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 1


def _row_reduction(func, args, out) -> str | None:
    """How ``func`` reduces a float tensor over its rows (dim 0) to a tensor that is not a
    number, "sum" or "mean" (Note [reductions over the rows]); else None."""
    x = args[0] if args else None
    if not (isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.ndim > 0):
        return None
    if func is aten.histc.default:  # counts of values in bins: a sum over every element
        return "sum"
    if func not in (aten.sum.dim_IntList, aten.mean.dim) or len(args) < 2:
        return None
    dims = args[1]
    dims = [dims] if isinstance(dims, int) else list(dims or range(x.ndim))
    if 0 not in [d % x.ndim for d in dims] or out.ndim == 0:
        return None
    return "sum" if func is aten.sum.dim_IntList else "mean"


def _reduction(func, args, kwargs) -> int | None:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "reduction":
            if a.name in kwargs:
                return int(kwargs[a.name])
            if i < len(args):
                return int(args[i])
            return int(a.default_value)
    return None


class LossSplitter(TorchDispatchMode):
    """Follows batch data through the loss and records its terms (Note [exact losses over
    micro-batches]). ``batch`` holds the tensors that hold (or derive from) batch data."""

    def __init__(self, batch, rows: int | None = None, real: torch.Tensor | None = None,
                 *, recipes: bool = False):  # fmt: skip
        super().__init__()
        # Note [a sum divided by the batch's size]: the micro-batch's rows, where a division
        # of sums by a multiple of them is a mean over rows
        self._rows = rows
        self._real = real  # a padded batch's real rows: the rows they count (Note [padded rows])
        self._keep: list[torch.Tensor] = []  # ids below stay valid while these live
        self._batch: set[int] = set()
        self._counts: dict[int, torch.Tensor] = {}  # integer sums of batch data (counts)
        self._summed: dict[int, torch.Tensor] = {}  # id(a float sum) -> what it sums
        self._forms: dict[int, _Form] = {}
        self._opaque: dict[int, str] = {}  # batch scalars that are no linear form, and why
        # Note [reductions over the rows]: id -> "sum" | "mean", how its parts add up
        self._stats: dict[int, str] = {}
        self._zeros: set[int] = set()
        self._derived: dict[int, str] = {}  # nonlinear functions of those alone, and why
        self.terms: list[_Term] = []
        self._untracked = 0
        self.in_forward = False  # the model's forward is running (``_Term.forward``)
        # Note [counts computed in the forward]: the ops that read only the batch and
        # constants, where ``recipes`` and the loss is captured (on fake tensors; eagerly
        # every tensor would be a constant); id(value) -> where it comes from
        leaves = pytree.tree_leaves(batch)
        self.recording = recipes and any(isinstance(t, FakeTensor) for t in leaves)
        self._src: dict[int, _Ref] = {}
        self._ops: list[tuple[Any, Any, Any]] = []
        self._dtypes: dict[int, torch.dtype] = {}
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                self._mark(t)
                self._src[id(t)] = _Ref("leaf", i)
                self._dtypes[i] = t.dtype

    def _mark(self, t: torch.Tensor) -> None:
        self._keep.append(t)
        self._batch.add(id(t))

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """Ops inside pass through unfollowed: values that never reach the loss's value (the
        fill of unselected rows: Note [rows selected by a mask] in compile_masked.py)."""
        self._untracked += 1
        try:
            yield
        finally:
            self._untracked -= 1

    def _term(self, term: _Term, out: torch.Tensor) -> None:
        term.forward = self.in_forward
        self.terms.append(term)
        self._mark(out)
        self._forms[id(out)] = _Form({len(self.terms) - 1: 1.0})

    def _form(self, x) -> _Form | None:
        """``x`` as a linear form: a number, a term combination or a batch-free scalar."""
        if isinstance(x, int | float) and not isinstance(x, bool):
            return _Form(const=float(x))
        if not isinstance(x, torch.Tensor):
            return None
        if id(x) in self._forms:
            return self._forms[id(x)]
        if id(x) not in self._batch and _is_scalar(x) and id(x) not in self._opaque:
            self.terms.append(_Term("fixed", x))  # a penalty: counted once per step
            self._keep.append(x)
            return _Form({len(self.terms) - 1: 1.0})
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recording:
            self._record(func, args, kwargs, out)
        if self._untracked:
            return out
        # (a sum over the rows started from zeros stays one: Note [reductions over the rows])
        same = func in _KEEP or func is aten.detach.default
        if func in _ZEROS or (same and args and id(args[0]) in self._zeros):
            self._keep.append(out)
            self._zeros.add(id(out))
        if func in VALUE_FREE:  # ``ones_like(out)`` seeding ``autograd.grad`` of a batch sum
            return out
        leaves = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        involved = [a for a in leaves if id(a) in self._forms or id(a) in self._opaque]
        if involved:
            self._combine(func, args, kwargs, out, outs)
        elif any(id(a) in self._stats or id(a) in self._derived for a in leaves):
            self._on_stat(func, args, out, leaves, outs)
        elif any(id(a) in self._batch for a in leaves):
            self._reduce(func, args, kwargs, out, outs)
        return out

    def _combine(self, func, args, kwargs, out, outs) -> None:
        """An op on a term combination: a new linear form, or an opaque value."""
        form = None
        name = _IN_PLACE.get(func.overloadpacket, func.overloadpacket)  # (``loss += aux``)
        a0 = args[0] if args else None
        if func in _KEEP and _is_scalar(out):
            form = self._form(a0)
        elif name in (aten.add, aten.sub) and len(args) >= 2:
            fa, fb = self._form(args[0]), self._form(args[1])
            alpha = float(kwargs.get("alpha", 1.0))
            if fa is not None and fb is not None:
                form = fa.plus(fb, alpha if name is aten.add else -alpha)
        elif name is aten.rsub and len(args) >= 2:
            fa, fb = self._form(args[0]), self._form(args[1])
            if fa is not None and fb is not None:
                form = fb.plus(fa, -float(kwargs.get("alpha", 1.0)))
        elif name is aten.neg:
            fa = self._form(a0)
            form = None if fa is None else fa.scaled(-1.0)
        elif name is aten.mul and len(args) == 2:
            for x, c in ((args[0], args[1]), (args[1], args[0])):
                coef = self._coefficient(c)
                fx = None if coef is None else self._forms.get(id(x))
                if fx is not None and coef is not None:
                    form = fx.scaled(coef)
                    break
        elif name is aten.div and len(args) == 2:
            form = self._divide(args[0], args[1], out)
            if form is None and id(out) in self._forms:
                return  # a counted mean, recorded by _divide
        if form is not None and isinstance(out, torch.Tensor):
            self._mark(out)
            self._forms[id(out)] = form
            return
        # the first op that left the linear forms is the reason, wherever it propagates
        why = next((self._opaque[id(a)] for a in pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor) and id(a) in self._opaque),
                   f"{func} applied to a reduction of the batch")  # fmt: skip
        for o in outs:
            self._mark(o)
            self._opaque[id(o)] = why

    def _coefficient(self, c) -> Coef | None:
        """``c`` as a coefficient of terms: a number, or a scalar tensor that does not depend
        on the batch (``exp(-s) * ce + s``, ``loss * self.weight``)."""
        if isinstance(c, int | float) and not isinstance(c, bool):
            return float(c)
        if (isinstance(c, torch.Tensor) and _is_scalar(c) and c.dtype.is_floating_point
                and id(c) not in self._batch and id(c) not in self._opaque):  # fmt: skip
            return c
        return None

    def _divide(self, num, den, out) -> _Form | None:
        if isinstance(den, int | float) and not isinstance(den, bool) and den != 0:
            fn = self._form(num)
            rows = self._rows
            over_rows = (
                rows is not None and rows > 0 and float(den).is_integer() and den % rows == 0
            )
            if fn is not None and over_rows and self._sums_only(fn):
                # Note [a sum divided by the batch's size]; a padded batch's real rows are
                # counted (Note [padded rows])
                if self._real is None:
                    self._term(_Term("mean", out), out)
                else:
                    assert rows is not None
                    real = aten.sum.default(self._real)
                    count = aten.mul.Tensor(real, int(den) // rows)
                    if self.recording:
                        self._record(aten.sum.default, (self._real,), {}, real)
                        self._record(aten.mul.Tensor, (real, int(den) // rows), {}, count)
                    self._term(_Term("count", out, count, int(den), numerator=num), out)
                return None
            return None if fn is None else fn.scaled(1.0 / float(den))
        coef = None if isinstance(den, int | float) else self._coefficient(den)
        if coef is not None:  # a batch-free scalar tensor: a coefficient
            fn = self._forms.get(id(num))
            return None if fn is None else fn.scaled(aten.reciprocal.default(coef))
        if isinstance(den, torch.Tensor) and id(den) not in self._counts:
            self._weighted_count(den)
        if isinstance(den, torch.Tensor) and id(den) in self._counts:
            fn = self._forms.get(id(num))
            # ``x.sum() / mask.sum()``: summed terms over a counted number of elements
            if fn is not None and self._sums_only(fn):
                bound = max(self._counts[id(den)].numel(), 1)
                self._term(_Term("count", out, den, bound, numerator=num), out)
        return None

    def _weighted_count(self, den: torch.Tensor) -> None:
        """A float sum of batch data without a gradient that divides is a count: a weighted
        count such as label smoothing's ``weight[target].sum()`` (class weights), which the
        step adds up over micro-batches like ``mask.sum()``; one of the model's outputs has a
        gradient and stays a term (a ratio of such sums is refused)."""
        form = self._forms.get(id(den))
        if den.requires_grad or form is None or _nonzero(form.const) or len(form.coefs) != 1:
            return
        ((k, c),) = form.coefs.items()
        summed = self._summed.get(id(self.terms[k].value))
        if isinstance(c, float) and c == 1.0 and self.terms[k].kind == "sum" and summed is not None:
            self._counts[id(den)] = summed

    def _sums_only(self, form: _Form) -> bool:
        return (
            not _nonzero(form.const)
            and bool(form.coefs)
            and all(self.terms[k].kind == "sum" for k in form.coefs)
        )

    def _reduce(self, func, args, kwargs, out, outs) -> None:
        """An op on batch data: a term where it reduces the batch to a scalar."""
        for o in outs:
            self._mark(o)
        first = args[0] if args else None
        if func in _NLL:
            red = _reduction(func, args, kwargs)
            value, total_weight = out
            if red == _MEAN:
                # The numerator as its own sum (finite where a micro-batch counts nothing).
                sargs = list(args)
                sargs[3] = _SUM
                numerator = func(*sargs, **kwargs)[0]
                bound = max(args[1].numel(), 1)
                self._term(_Term("count", value, total_weight, bound, numerator), value)
            elif red == _SUM:
                self._term(_Term("sum", value), value)
            return
        if not (isinstance(out, torch.Tensor) and out.ndim == 0):
            kind = _row_reduction(func, args, out)
            if kind is not None:  # Note [reductions over the rows]
                self._stats[id(out)] = kind
            return
        if func in _SUMS and isinstance(first, torch.Tensor):
            if first.dtype.is_floating_point or first.dtype.is_complex:
                self._term(_Term("sum", out), out)
                self._summed[id(out)] = first  # (a weighted count where it divides)
            else:  # counting elements (``mask.sum()``): a count, not a term
                self._counts[id(out)] = first
                self._keep.append(first)
            return
        if func in _MEANS and isinstance(first, torch.Tensor):
            self._term(_Term("mean", out), out)
            return
        if func in _REDUCING_LOSSES:
            red = _reduction(func, args, kwargs)
            if red in (_MEAN, _SUM):
                self._term(_Term("mean" if red == _MEAN else "sum", out), out)
                return
        self._opaque[id(out)] = f"{func} reduces the batch to a number"

    def _on_stat(self, func, args, out, leaves, outs) -> None:
        """An op on a reduction over the rows (Note [reductions over the rows]): linear ones
        keep it one (a term where they give a number); with the rows, a normalisation by a
        statistic of the micro-batch; others leave the sums of parts."""
        for o in outs:
            self._mark(o)
        derived = [self._derived[id(a)] for a in leaves if id(a) in self._derived]
        kinds = {self._stats[id(a)] for a in leaves if id(a) in self._stats}
        batch_free = all(id(a) not in self._batch for a in leaves if id(a) not in self._stats)
        name = _IN_PLACE.get(func.overloadpacket, func.overloadpacket)
        kind = next(iter(kinds)) if len(kinds) == 1 else None
        if name in (aten.mul, aten.div):  # by a number or a batch-free tensor, not by a stat
            linear = (
                batch_free
                and (name is aten.mul or id(args[1]) not in self._stats)
                and (name is aten.div or sum(id(a) in self._stats for a in args) == 1)
            )
        elif name in (aten.add, aten.sub):  # stats of one kind, zeros; a mean's plus a constant
            linear = batch_free and (kind == "mean" or all(
                id(a) in self._stats or id(a) in self._zeros for a in leaves))  # fmt: skip
        else:
            linear = func in _KEEP or name in _ROW_LINEAR
        if not derived and kind is not None and linear and isinstance(out, torch.Tensor):
            if out.ndim == 0:
                self._term(_Term(kind, out), out)
            else:
                self._stats[id(out)] = kind
            return
        if any(id(a) in self._batch and id(a) not in self._stats and id(a) not in self._derived
               for a in leaves):  # fmt: skip
            return  # rows normalised per micro-batch (as BatchNorm's: the documented difference)
        why = derived[0] if derived else (
            f"{func} applied to a reduction of the batch over its rows (dim 0), which the "
            "micro-batches' parts do not add up to: a product or another nonlinear function "
            "of sums or means over the batch (a mixture of experts' load-balancing loss "
            "over all tokens: the share of tokens each expert gets times its mean routing "
            "probability)"
        )  # fmt: skip
        for o in outs:
            if o.ndim == 0:  # a number: not a term
                self._opaque[id(o)] = why
            else:
                self._derived[id(o)] = why

    # ---- counts computed in the forward (Note [counts computed in the forward]) -----------

    def _ref(self, x: torch.Tensor) -> _Ref | None:
        ref = self._src.get(id(x))
        if ref is not None:
            return ref
        if not isinstance(x, FakeTensor):  # a real tensor: a constant of the loss
            return _Ref("const", x.detach())
        constant = getattr(x, "constant", None)  # a constant made during the capture
        return None if constant is None else _Ref("const", constant)

    def _record(self, func, args, kwargs, out) -> None:
        """Keeps ``func`` for the recipes where it reads only the batch's data and constants;
        an ``nll_loss``'s count (``total_weight``) reads only its targets and class weights."""
        if torch.Tag.nondeterministic_seeded in func.tags:
            return
        if func in _NLL and isinstance(args[0], torch.Tensor) and self._ref(args[0]) is None:
            zeros = _Ref("zeros", (tuple(args[0].shape), args[0].dtype))
            args, outputs = (zeros, *args[1:]), {1}  # (its values do not change the count)
        else:
            outputs = None
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        refs = {id(a): self._ref(a) for a in tensors}
        if any(r is None for r in refs.values()):
            return
        rargs, rkwargs = pytree.tree_map(
            lambda a: refs[id(a)] if isinstance(a, torch.Tensor) else a, (args, kwargs)
        )
        if "device" in rkwargs:  # (replayed on the host)
            rkwargs = {**rkwargs, "device": torch.device("cpu")}
        k = len(self._ops)
        self._ops.append((func, rargs, rkwargs))
        for j, o in enumerate(pytree.tree_leaves(out)):
            if isinstance(o, torch.Tensor) and (outputs is None or j in outputs):
                self._keep.append(o)
                self._src[id(o)] = _Ref("out", (k, j))

    def count_recipe(self, counted: list[_Term], chunks: int) -> CountRecipe:
        """The recipe of ``counted``'s counts, or a ``LossDecompositionError`` naming a count
        that depends on more than the batch (on the model's parameters)."""
        outs = []
        for t in counted:
            ref = None if t.count is None else self._src.get(id(t.count))
            if ref is None:
                raise LossDecompositionError(_explain(
                    "the count of a mean over counted elements depends on more than the batch's "
                    "data (on the model's parameters, such as tokens routed to an expert), so "
                    "it cannot be counted before the step", chunks))  # fmt: skip
            outs.append(ref)

        def refs_of(x) -> list[_Ref]:
            return [r for r in pytree.tree_leaves(x) if isinstance(r, _Ref)]

        # the ops the counts read, and every op that writes in place before the last of them
        need: set[int] = set()
        todo = [r.at[0] for r in outs if r.kind == "out"]
        last = max(todo, default=-1)
        todo += [k for k in range(last) if self._ops[k][0]._schema.is_mutable]
        while todo:
            k = todo.pop()
            if k not in need:
                need.add(k)
                todo += [r.at[0] for r in refs_of(self._ops[k][1:]) if r.kind == "out"]
        order = sorted(need)
        new = {k: i for i, k in enumerate(order)}

        def renumber(x):
            if isinstance(x, _Ref) and x.kind == "out":
                return _Ref("out", (new[x.at[0]], x.at[1]))
            return x

        ops = tuple((f, *pytree.tree_map(renumber, (a, kw))) for f, a, kw in
                    (self._ops[k] for k in order))  # fmt: skip
        leaves = {r.at for op in ops for r in refs_of(op[1:]) if r.kind == "leaf"}
        leaves |= {r.at for r in outs if r.kind == "leaf"}
        return CountRecipe(tuple((i, self._dtypes[i]) for i in sorted(leaves)), ops,
                           tuple(renumber(r) for r in outs))  # fmt: skip

    # ---- the split -------------------------------------------------------------------------

    def split(self, loss: torch.Tensor, chunks: int) -> Split:
        """The loss as micro-batch parts, or a ``LossDecompositionError`` saying why not."""
        if id(loss) in self._opaque:
            raise _cannot_split(self._opaque[id(loss)], chunks)
        form = self._forms.get(id(loss))
        if form is None:
            if id(loss) in self._batch:
                raise _cannot_split("it is not reached through a reduction this splitter knows",
                                    chunks)  # fmt: skip
            form = _Form({len(self.terms): 1.0})  # batch-free: counted once
            self.terms.append(_Term("fixed", loss))
        used = {k: c for k, c in form.coefs.items() if _nonzero(c)}
        counted = {id(self.terms[k]) for k in used if self.terms[k].kind == "count"}
        if len(counted) > MAX_COUNTS:
            raise _cannot_split(f"it has {len(counted)} means over counted elements; at most "
                                f"{MAX_COUNTS} are supported", chunks)  # fmt: skip
        return Split([(self.terms[k], c) for k, c in used.items()], form.const)

    def counts(self) -> list[float]:
        """The counts of the counted means, in the order ``Split.parts`` holds them (eager)."""
        return [float(t.count) for t in self.terms if t.kind == "count" and t.count is not None]


@dataclass
class Split:
    """A loss as ``const + sum(coef * term)`` (Note [exact losses over micro-batches])."""

    parts: list[tuple[_Term, Coef]]
    const: Coef

    @property
    def counted(self) -> list[_Term]:
        return [t for t, _ in self.parts if t.kind == "count"]

    @property
    def deferred(self) -> bool:
        """One counted mean alone: its count is summed in the step and the gradients are
        divided by it once; otherwise counts come from the host (``host_counts``)."""
        return (len(self.parts) == 1 and self.parts[0][0].kind == "count"
                and not _nonzero(self.const))  # fmt: skip

    def objective(self, chunks: int, inv_counts=None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """This micro-batch's objective (in ``dtype``: float32, or float64 for a float64
        model, Note [float64 models] in compile_common.py) and, for a deferred counted mean,
        its count; torch ops, so they are captured with the loss. ``inv_counts`` holds one
        over the global count of every counted mean (host counts)."""
        parts, count = self.contributions(chunks, inv_counts, dtype)
        obj: Any = None
        for part in parts:
            obj = part if obj is None else obj + part
        if obj is None:  # a loss of numbers only
            raise LossDecompositionError(_explain("the loss does not depend on the model", chunks))
        if _nonzero(self.const):
            obj = obj + self.const / chunks
        return obj, count

    def contributions(self, chunks: int, inv_counts=None, dtype: torch.dtype = torch.float32
                      ) -> tuple[list[torch.Tensor], torch.Tensor | None]:  # fmt: skip
        """Each term's part of ``objective`` (in ``parts``' order), and a deferred count."""
        out = []
        count = None
        counted = self.counted
        for term, c in self.parts:
            if term.kind == "sum":
                part = term.value.to(dtype) * c
            elif term.kind in ("mean", "fixed"):
                part = term.value.to(dtype) * (c / chunks)
            else:
                assert term.count is not None and term.numerator is not None
                if self.deferred:
                    count = term.count.detach().to(dtype)
                    part = term.numerator.to(dtype) * (c / (term.bound * chunks))
                else:
                    assert inv_counts is not None
                    i = next(j for j, t in enumerate(counted) if t is term)
                    part = term.numerator.to(dtype) * inv_counts[i] * c
            out.append(part)
        return out, count

    def summands(self, dtype: torch.dtype) -> tuple[list[tuple[str, torch.Tensor]], float]:
        """The split as values that add up over the parts of a batch on the host, where no
        gradient is needed (Note [batch-reduced outputs of an inference program]): (kind,
        value) per term, a counted mean as its numerator ("numerator") then its count
        ("count"), each times its coefficient; and the number added once (``const``)."""
        out: list[tuple[str, torch.Tensor]] = []
        for term, c in self.parts:
            if term.kind == "count":
                assert term.count is not None and term.numerator is not None
                out.append(("numerator", term.numerator.to(dtype) * c))
                out.append(("count", term.count.detach().to(dtype)))
            else:  # a mean of a fixed count, or a batch-free value: the same in every part
                out.append(("sum" if term.kind == "sum" else "mean", term.value.to(dtype) * c))
        const = self.const
        if isinstance(const, torch.Tensor):  # (a batch-free tensor: the same in every part)
            out.append(("mean", const.to(dtype)))
            const = 0.0
        return out, float(const)


def add_up(kinds: list[str], values: list, const: float) -> float:
    """``Split.summands``' values of every part (one array of the parts' values per summand,
    in ``kinds``' order) put together as the whole batch's value: sums added, means of a
    fixed count averaged, a counted mean's numerators and counts each added and divided once
    (NaN where nothing is counted, as eager's mean over nothing)."""
    total = const
    for i, (kind, v) in enumerate(zip(kinds, values, strict=True)):
        v = np.asarray(v, dtype=np.float64)
        if kind == "sum":
            total += float(v.sum())
        elif kind == "mean":
            total += float(v.mean())
        elif kind == "numerator":
            count = float(np.asarray(values[i + 1], dtype=np.float64).sum())
            total += float(v.sum()) / count if count else math.nan
    return total


def _explain(why: str, chunks: int) -> str:
    return (
        f"popxl.compile cannot split this loss into the {chunks} micro-batches of a step "
        f"(replication_factor * gradient_accumulation): {why}. The compiled step equals the "
        "eager loop when the loss is a sum of means and sums of the batch with number "
        "coefficients (for example `F.cross_entropy(out, y)`, `bce_sum + kl_sum`, "
        "`mse + 0.1 * l1`, `(x * mask).sum() / mask.sum()`). Rewrite the loss in that form, "
        "or use replication_factor=1 and gradient_accumulation=1."
    )


def _synthetic(outputs, n: int, seed: int):
    """Outputs of ``n`` rows shaped as the captured ``outputs`` (floats in (0.05, 0.95), as
    probabilities and logits both accept), or None where they do not have ``micro`` rows."""
    leaves, spec = pytree.tree_flatten(outputs)
    gen = torch.Generator().manual_seed(seed)
    full = []
    for o in leaves:
        shape = (n, *o.shape[1:])
        if o.dtype.is_floating_point:
            x = torch.rand(shape, generator=gen, dtype=torch.float64).mul(0.9).add(0.05)
            # float32 at least: the check compares sums, which 16-bit rounding would blur
            full.append(x.to(torch.promote_types(o.dtype, torch.float32)))
        else:
            full.append(torch.zeros(shape, dtype=o.dtype))
    return full, spec


def _splits_on_dim0(outputs, micro: int) -> bool:
    leaves = pytree.tree_leaves(outputs)
    return bool(leaves) and all(
        isinstance(o, torch.Tensor) and o.ndim > 0 and o.shape[0] == micro for o in leaves
    )


def _replay(loss_fn, leaves, spec, targets, chunks: int, rows: int | None = None):
    splitter = LossSplitter((leaves, targets), rows, real_rows(loss_fn, targets))
    # selections kept whole, as captured (Note [rows selected by a mask])
    with torch.no_grad(), splitter, MaskedRows(splitter.untracked, always=True):
        loss = loss_fn(pytree.tree_unflatten(leaves, spec), targets)
    return loss, splitter.split(loss, chunks), splitter


_FORWARD_COUNTS = (
    "it combines means over counted elements with other terms, and their counts could not be "
    "counted from the targets (a loss that pairs the samples of the batch with each other, "
    "such as a contrastive loss over the batch, has no micro-batch parts at all)"
)


def host_counts(loss_fn, outputs, targets, chunks: int, expected: int, verify: bool = True
                ) -> list[float]:  # fmt: skip
    """The global count of every counted mean of the loss (Note [exact losses over
    micro-batches]): ``loss_fn`` run eagerly on the whole batch's targets and synthetic
    outputs (a count such as ``total_weight`` or ``mask.sum()`` depends on the targets)."""
    t_leaves = [t for t in pytree.tree_leaves(targets) if t is not None]
    if not t_leaves:  # a model that returns its loss, such as CLIP's two contrastive means
        raise LossDecompositionError(_explain(_FORWARD_COUNTS, chunks))
    n = t_leaves[0].shape[0]
    if not _splits_on_dim0(outputs, n // chunks):
        raise LossDecompositionError(
            _explain("it combines a mean over counted elements with other terms, and the "
                     "model's outputs do not split on dim 0 to count them", chunks))  # fmt: skip
    counts = []
    # ``verify`` (at build): a second replay on other outputs must count the same
    for seed in (0, 1) if verify else (0,):
        leaves, spec = _synthetic(outputs, n, seed)
        _, split, splitter = _replay(loss_fn, leaves, spec, targets, chunks)
        counts.append([float(t.count) for t in split.counted if t.count is not None])
    if len(counts[0]) != expected:
        raise LossDecompositionError(_explain(_FORWARD_COUNTS, chunks))
    if verify and counts[0] != counts[1]:
        raise LossDecompositionError(
            _explain("a mean's count of elements depends on the model's outputs", chunks)
        )
    return counts[0]


def check_decomposition(loss_fn, outputs, targets, chunks: int, over_rows: bool = False
                        ) -> bool:  # fmt: skip
    """``loss_fn`` on ``chunks`` parts of synthetic outputs and the real targets must add up
    (as the compiled step adds them) to ``loss_fn`` on the whole, at build time. Where they
    do not, a division of sums by a number is read as a mean over the micro-batch's rows
    (Note [a sum divided by the batch's size]): True when that reading adds up (the loss must
    then be captured with it), False when the loss adds up as it is (or ``over_rows`` was
    asked for and adds up); a ``LossDecompositionError`` when neither does.

    ``outputs`` are the captured micro-batch outputs (shapes); the check is skipped where they
    do not split on dim 0 or the loss cannot run on synthetic values (the structural split
    still stands).
    """
    t_leaves, t_spec = pytree.tree_flatten(targets)
    micro = t_leaves[0].shape[0] // chunks if t_leaves else 0
    if not _splits_on_dim0(outputs, micro):
        return False
    full, spec = _synthetic(outputs, micro * chunks, 0)

    def parts_total(rows: bool) -> tuple[float, float]:
        """(the loss of the whole batch, the sum of its parts as the step adds them)."""
        with torch.no_grad():
            whole = float(loss_fn(pytree.tree_unflatten(full, spec), targets))
            _, split, _ = _replay(
                loss_fn, full, spec, targets, chunks, micro * chunks if rows else None
            )
            inv = [1.0 / c if c else float("inf") for c in (t.count for t in split.counted)]
            total, count, bound = 0.0, 0.0, 1
            for i in range(chunks):
                part = [x[i * micro : (i + 1) * micro] for x in full]
                tpart = pytree.tree_unflatten(
                    [x[i * micro : (i + 1) * micro] for x in t_leaves], t_spec
                )
                _, psplit, _ = _replay(loss_fn, part, spec, tpart, chunks, micro if rows else None)
                obj, n = psplit.objective(chunks, torch.tensor(inv, dtype=torch.float32))
                total += float(obj)
                if n is not None:
                    count += float(n)
                    bound = psplit.counted[0].bound
        if count:
            total *= bound * chunks / count
        return whole, total

    try:
        whole, total = parts_total(over_rows)
        if not math.isfinite(whole):  # (a mask that selects nothing of synthetic outputs)
            return False
        if _adds_up(whole, total):
            return False
        if not over_rows and _adds_up(*parts_total(True)):
            return True
    except LossDecompositionError:
        raise
    except Exception:  # the loss does not run on synthetic outputs: structural split only
        return False
    raise _parts_differ("targets and synthetic outputs", whole, total, chunks)


def _adds_up(whole: float, total: float) -> bool:
    return abs(total - whole) <= 1e-3 * max(abs(whole), 1e-6) + 1e-6


def _parts_differ(on: str, whole: float, total: float, chunks: int, what: str = "the loss"
                  ) -> LossDecompositionError:  # fmt: skip
    return LossDecompositionError(
        _explain(
            f"on the first batch's {on}, {what} of the whole batch is {whole:.6g} but its "
            f"{chunks} parts add up to {total:.6g}: each part depends on the other samples of "
            "its micro-batch, as a loss that pairs the samples of the batch with each other "
            "does (in-batch negatives, a ratio of sums over the batch such as a "
            "dice score, a product of two means over the batch such as a mixture of experts' "
            "load-balancing loss over all tokens), or the loss divides by another function of "
            "the micro-batch's size than a multiple of its rows (`/ x.shape[0] ** 0.5`)",
            chunks,
        )
    )


def term_mismatch(whole: Split, parts: list[Split], inv: torch.Tensor, chunks: int
                  ) -> tuple[float, float] | None:  # fmt: skip
    """Where a term of a loss computed on the whole batch (``whole``, split as one
    micro-batch) differs from the sum of its parts over ``parts`` as the step adds them
    (``inv``: one over the global counts), (its value, the parts' sum); None where every term
    adds up (Note [counts computed in the forward]). Term by term, so a term with a small
    weight is checked as closely as a large one."""
    want, _ = whole.contributions(1, inv)
    got = [0.0] * len(want)
    for split in parts:
        values, _ = split.contributions(chunks, inv)
        if len(values) != len(want):  # (another structure: compared as a whole)
            w, _ = whole.objective(1, inv)
            total = sum(float(p.objective(chunks, inv)[0]) for p in parts)
            return None if _adds_up(float(w), total) else (float(w), total)
        got = [g + float(v) for g, v in zip(got, values, strict=True)]
    return next(((float(w), g) for w, g in zip(want, got, strict=True)
                 if math.isfinite(float(w)) and not _adds_up(float(w), g)), None)  # fmt: skip


def parts_differ(mismatch: tuple[float, float], chunks: int) -> LossDecompositionError:
    """The error of a loss computed in the model's forward whose parts do not add up."""
    return _parts_differ("data (the model run eagerly in eval mode)", *mismatch, chunks,
                         what="a term of the loss")  # fmt: skip
