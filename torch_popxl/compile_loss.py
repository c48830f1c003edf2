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

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .capture import VALUE_FREE
from .compile_masked import MaskedRows
from .compile_rows import real_rows

__all__ = [
    "MAX_COUNTS",
    "LossDecompositionError",
    "LossSplitter",
    "Split",
    "check_decomposition",
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
_SUMS = {aten.sum.default, aten.sum.dim_IntList}
_MEANS = {aten.mean.default, aten.mean.dim}
# ops that keep a scalar's linear form (a value-preserving cast or view)
_KEEP = {
    aten._to_copy.default, aten.clone.default, aten.alias.default, aten.view.default,
    aten._unsafe_view.default, aten.reshape.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.unsqueeze.default, aten.lift_fresh.default,
}  # fmt: skip


class LossDecompositionError(ValueError):
    """The loss cannot be split into micro-batch parts that add up to eager's."""


@dataclass
class _Term:
    kind: str  # "sum" | "mean" (fixed count) | "count" (counted: ``count``) | "fixed"
    value: torch.Tensor
    count: torch.Tensor | None = None
    bound: int = 1  # elements per micro-batch the count can reach (its normaliser)
    # a counted mean's numerator: its sum (``value * count``, but finite where count is 0)
    numerator: torch.Tensor | None = None


@dataclass
class _Form:
    """``const + sum(coef * term)`` over term indices."""

    coefs: dict[int, float] = field(default_factory=dict)
    const: float = 0.0

    def scaled(self, c: float) -> _Form:
        return _Form({k: v * c for k, v in self.coefs.items()}, self.const * c)

    def plus(self, other: _Form, alpha: float = 1.0) -> _Form:
        coefs = dict(self.coefs)
        for k, v in other.coefs.items():
            coefs[k] = coefs.get(k, 0.0) + alpha * v
        return _Form(coefs, self.const + alpha * other.const)


def _is_scalar(t) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() == 1


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

    def __init__(self, batch, rows: int | None = None, real: torch.Tensor | None = None):
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
        self.terms: list[_Term] = []
        self._untracked = 0
        for t in pytree.tree_leaves(batch):
            if isinstance(t, torch.Tensor):
                self._mark(t)

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
        if self._untracked:
            return out
        if func in VALUE_FREE:  # ``ones_like(out)`` seeding ``autograd.grad`` of a batch sum
            return out
        leaves = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        involved = [a for a in leaves if id(a) in self._forms or id(a) in self._opaque]
        if involved:
            self._combine(func, args, kwargs, out, outs)
        elif any(id(a) in self._batch for a in leaves):
            self._reduce(func, args, kwargs, out, outs)
        return out

    def _combine(self, func, args, kwargs, out, outs) -> None:
        """An op on a term combination: a new linear form, or an opaque value."""
        form = None
        name = func.overloadpacket
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
                if isinstance(c, int | float) and not isinstance(c, bool):
                    fx = self._form(x)
                    form = None if fx is None else fx.scaled(float(c))
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
                    count = aten.mul.Tensor(aten.sum.default(self._real), int(den) // rows)
                    self._term(_Term("count", out, count, int(den), numerator=num), out)
                return None
            return None if fn is None else fn.scaled(1.0 / float(den))
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
        if den.requires_grad or form is None or form.const != 0.0 or len(form.coefs) != 1:
            return
        ((k, c),) = form.coefs.items()
        summed = self._summed.get(id(self.terms[k].value))
        if c == 1.0 and self.terms[k].kind == "sum" and summed is not None:
            self._counts[id(den)] = summed

    def _sums_only(self, form: _Form) -> bool:
        return (
            form.const == 0.0
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

    # ---- the split -------------------------------------------------------------------------

    def split(self, loss: torch.Tensor, chunks: int) -> Split:
        """The loss as micro-batch parts, or a ``LossDecompositionError`` saying why not."""
        if id(loss) in self._opaque:
            raise LossDecompositionError(_explain(self._opaque[id(loss)], chunks))
        form = self._forms.get(id(loss))
        if form is None:
            if id(loss) in self._batch:
                raise LossDecompositionError(
                    _explain("the loss is not reached through a reduction this splitter knows", chunks))  # fmt: skip
            form = _Form({len(self.terms): 1.0})  # batch-free: counted once
            self.terms.append(_Term("fixed", loss))
        used = {k: c for k, c in form.coefs.items() if c != 0.0}
        counted = {id(self.terms[k]) for k in used if self.terms[k].kind == "count"}
        if len(counted) > MAX_COUNTS:
            raise LossDecompositionError(
                _explain(f"it has {len(counted)} means over counted elements; at most "
                         f"{MAX_COUNTS} are supported", chunks))  # fmt: skip
        return Split([(self.terms[k], c) for k, c in used.items()], form.const)

    def counts(self) -> list[float]:
        """The counts of the counted means, in the order ``Split.parts`` holds them (eager)."""
        return [float(t.count) for t in self.terms if t.kind == "count" and t.count is not None]


@dataclass
class Split:
    """A loss as ``const + sum(coef * term)`` (Note [exact losses over micro-batches])."""

    parts: list[tuple[_Term, float]]
    const: float

    @property
    def counted(self) -> list[_Term]:
        return [t for t, _ in self.parts if t.kind == "count"]

    @property
    def deferred(self) -> bool:
        """One counted mean alone: its count is summed in the step and the gradients are
        divided by it once; otherwise counts come from the host (``host_counts``)."""
        return len(self.parts) == 1 and self.parts[0][0].kind == "count" and not self.const

    def objective(self, chunks: int, inv_counts=None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """This micro-batch's objective (in ``dtype``: float32, or float64 for a float64
        model, Note [float64 models] in compile_common.py) and, for a deferred counted mean,
        its count; torch ops, so they are captured with the loss. ``inv_counts`` holds one
        over the global count of every counted mean (host counts)."""
        obj: Any = None
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
            obj = part if obj is None else obj + part
        if obj is None:  # a loss of numbers only
            raise LossDecompositionError(_explain("the loss does not depend on the model", chunks))
        if self.const:
            obj = obj + self.const / chunks
        return obj, count


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
    "it combines a mean over counted elements computed in the model's forward with other "
    "terms (only a loss_fn's counts can be counted ahead; a loss that pairs the samples of "
    "the batch with each other, such as a contrastive loss over the batch, has no "
    "micro-batch parts at all)"
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

    def adds_up(whole: float, total: float) -> bool:
        return abs(total - whole) <= 1e-3 * max(abs(whole), 1e-6) + 1e-6

    try:
        whole, total = parts_total(over_rows)
        if not math.isfinite(whole):  # (a mask that selects nothing of synthetic outputs)
            return False
        if adds_up(whole, total):
            return False
        if not over_rows and adds_up(*parts_total(True)):
            return True
    except LossDecompositionError:
        raise
    except Exception:  # the loss does not run on synthetic outputs: structural split only
        return False
    raise LossDecompositionError(
        _explain(
            f"on the first batch's targets and synthetic outputs, the loss of the whole "
            f"batch is {whole:.6g} but its {chunks} parts add up to {total:.6g}: each part "
            "depends on the other samples of its micro-batch (in-batch negatives, a ratio of "
            "sums over the batch such as a dice score), or the loss divides by another "
            "function of the micro-batch's size than a multiple of its rows "
            "(`/ x.shape[0] ** 0.5`)",
            chunks,
        )
    )
