"""Rows selected by a boolean mask in captured code (``x[mask]``, ``masked_select``).

Note [rows selected by a mask]
    A loss over some rows only is often written with a boolean mask: ``F.mse_loss(pred[m],
    target[m])`` where targets hold NaNs, a token-classification loss over
    ``logits.view(-1, C)[attention_mask.view(-1) == 1]``. The selection's size depends on the
    mask's values, and a popxl graph has static shapes. Its *use* usually does not: the
    selected rows go through elementwise and row-wise ops into a sum, a mean or a loss with a
    reduction, whose value is a sum over the selected rows, divided by their count for a mean.
    So while the model and loss are captured, ``MaskedRows`` (a dispatch mode in front of the
    loss splitter and the recorder) keeps a selection as all ``N`` rows (the mask's elements,
    flattened) with the mask beside it, and rewrites what reads it:

    * the selection itself: every row, where unselected rows hold a copy of the first selected
      row, so that values stay in the domain of the selected ones (a NaN target is never read;
      no log of 0 and no 0 * inf in the backward);
    * elementwise ops (torch's ``pointwise`` tag), row-wise ones (softmax over a dim other
      than the rows, reductions over other dims, dropout, layer norm, a matrix product with
      the selection on the left: a head over the selected rows, ``decoder(hidden[m])``; a
      max, sort, top-k or running sum along another dim: ``target(next[m]).max(1)``),
      casts, views and lookups along other dims (``y[:, None]``, ``x[:, 0]``,
      ``x.gather(1, y[:, None])``, ``F.one_hot``'s scatter) and views that merge the rows
      with the dims after them (``logits.view(-1, C)``: one mask per such shape): the same
      mask on the result; a ``max``/``min``/``any``/``all`` over everything reads the fill
      rows as the copies they are (``F.one_hot``'s check of its classes); operands without a
      mask may broadcast over the trailing dims only, as they must against ``k`` rows in
      eager torch;
    * a sum: of ``where(mask, x, 0)``; a mean: that sum over the count of selected elements
      (a counted mean, which the loss splitter adds up over micro-batches exactly: Note [exact
      losses over micro-batches]); a loss op with ``reduction='mean'`` or ``'sum'``: the same
      on its ``'none'`` result; ``nll_loss`` (cross entropy): the unselected rows' targets set
      to its ``ignore_index``, so its counted mean and class weights are torch's own;
    * a selection written back under its own mask (``values[m] = target(next[m]).max(1)``,
      PyTorch's DQN tutorial): the selected rows take it, the others keep theirs.

    Anything else that reads a selection (a matmul over rows, a sort over them, a sum over the rows
    kept as a vector, ``len(x[mask])``' value in arithmetic is the one thing not seen: it reads
    ``N``) is refused with a ``DataDependentError`` naming the op. Where the mask's values are
    known at capture time, the recorder folds the selection as a constant shape instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import DataDependentError

__all__ = ["MaskedRows"]

aten = torch.ops.aten

_INDEX = {aten.index.Tensor, aten.masked_select.default}
# value-preserving copies, casts and views of the whole tensor
_SAME = {
    aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
    aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.contiguous.default,
}  # fmt: skip
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# ops over one dim (``dim`` second): row-wise where it is not the rows' dim
_ALONG_DIM = {aten._log_softmax.default, aten._softmax.default}
# ops along one dim ``dim`` (by name in their schema) whose every output keeps the rows where
# ``dim`` is not the rows' dim: a max per row (DQN's ``target(next[m]).max(1).values``), a sort
# or top-k per row, a running sum per row
_ONE_DIM = {
    aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.sort.default,
    aten.sort.stable, aten.topk.default, aten.cumsum.default, aten.cumprod.default,
    aten.logcumsumexp.default, aten.cummax.default, aten.cummin.default,
}  # fmt: skip
# writes of a selection back into the rows it came from: ``out[m] = x[m] * 2``
_PUT = {aten.index_put.default, aten.index_put_.default}
_REDUCE_DIMS = {
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.logsumexp.default,
}  # fmt: skip
# elementwise ops torch does not tag ``pointwise``
_ELEMENTWISE = {
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Scalar,
    aten.masked_fill_.Tensor,
}  # fmt: skip
# row-wise ops whose first output is a selection when their first tensor argument is:
# dropout, a layer norm over the trailing dims
_ROW_WISE = {aten.native_dropout.default, aten.native_layer_norm.default}
# matrix products whose left operand's rows are the result's: (op, the left operand's index)
_LEFT_ROWS = {aten.mm.default: 0, aten.addmm.default: 1}
# tensors like a selection: selected too
_LIKE = {
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.empty_like.default, aten.rand_like.default, aten.randn_like.default,
}  # fmt: skip
_NONE, _MEAN, _SUM = 0, 1, 2
# views and lookups along one dim (second argument) or two: row-wise where neither is the rows'
_AT_DIM = {
    aten.unsqueeze.default, aten.squeeze.dim, aten.select.int, aten.slice.Tensor,
    aten.gather.default, aten.index_select.default, aten.scatter.value, aten.scatter.src,
    aten.scatter_.value, aten.scatter_.src, aten.scatter_add.default, aten.scatter_add_.default,
}  # fmt: skip
# lookups along a dim whose index (third argument) has the rows: ``x.gather(1, y[:, None])``,
# ``F.one_hot``'s scatter
_BY_INDEX = {op for op in _AT_DIM if op.overloadpacket in (aten.gather, aten.scatter,
                                                           aten.scatter_, aten.scatter_add,
                                                           aten.scatter_add_)}  # fmt: skip
_AT_DIMS = {aten.transpose.int, aten.squeeze.dims, aten.permute.default}
# reductions a repeated row does not change: over the rows, the fill rows (copies of a
# selected row) leave the selected rows' result (``F.one_hot``'s check of its classes)
_REPEATS_FREE = {
    aten.aminmax.default, aten.max.default, aten.min.default, aten.any.default,
    aten.all.default,
}  # fmt: skip


def _dims(dims, ndim: int) -> list[int]:
    if dims is None or (isinstance(dims, list | tuple) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return [d % max(ndim, 1) for d in dims]


class MaskedRows(TorchDispatchMode):
    """Keeps boolean-mask selections as whole rows plus their mask (Note [rows selected by a
    mask]); entered inside the loss splitter, so the ops it issues are split and recorded."""

    def __init__(self, untracked: Callable[[], contextlib.AbstractContextManager] | None = None,
                 *, always: bool = False):  # fmt: skip
        super().__init__()
        # every selection kept whole, not only those whose size the capture cannot know: the
        # loss splitter's eager replays count as the captured graph does
        self._always = always
        # ops whose values never reach the loss (the fill rows) run inside this: the loss
        # splitter does not follow them
        self._untracked = untracked or contextlib.nullcontext
        self._masks: dict[int, torch.Tensor] = {}  # id(tensor) -> its rows' 1-D bool mask
        self._flat: dict[int, torch.Tensor] = {}  # id(a mask indexing) -> its 1-D form
        # (id(mask), shape) -> the mask broadcast; (id(mask), id(outer)) -> both masks
        self._expanded: dict[tuple, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []  # ids above stay valid while these live

    def _mark(self, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self._keep.append(t)
        self._masks[id(t)] = mask
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        masks = [self._masks[id(a)] for a in leaves if id(a) in self._masks]
        if func.namespace == "prim" or func._opname.startswith(("sym_", "is_")):
            return func(*args, **kwargs)  # metadata: the device, a size, contiguity
        if not masks:
            if func in _INDEX and self._always:
                selected = self._select(func, args)
                return func(*args, **kwargs) if selected is None else selected
            if func in _INDEX:
                try:
                    return func(*args, **kwargs)
                except DataDependentError:
                    selected = self._select(func, args)
                    if selected is None:
                        raise
                    return selected
            return func(*args, **kwargs)
        mask = masks[0]
        if any(m is not mask for m in masks[1:]):
            raise self._refuse(
                func,
                "it combines selections made with different mask tensors (one "
                "selection's rows pair with another's only under the same mask: compute it "
                "once, `m = ...; out[m], target[m]`)",
            )
        return self._on_selection(func, args, kwargs, mask)

    # ---- the selection ------------------------------------------------------------------

    def _select(self, func, args, outer: torch.Tensor | None = None) -> torch.Tensor | None:
        """``x[mask]`` or ``masked_select(x, mask)`` kept whole; ``outer``: the mask that
        selected ``x``'s rows already (a selection of a selection selects by both)."""
        x, index = args[0], args[1]
        if func is aten.masked_select.default:
            shape = torch.broadcast_shapes(x.shape, index.shape)
            x, mask = aten.expand.default(x, list(shape)), index
            if tuple(index.shape) != tuple(shape):  # one expanded form per mask and shape
                key = (id(index), tuple(shape))
                if key not in self._expanded:
                    self._keep.append(index)
                    self._expanded[key] = aten.expand.default(index, list(shape))
                mask = self._expanded[key]
        else:
            if len(index) != 1 or index[0] is None or index[0].dtype not in (
                torch.bool, torch.uint8,
            ):  # fmt: skip
                return None
            mask = index[0]
            if tuple(mask.shape) != tuple(x.shape[: mask.ndim]):
                return None
        n = mask.numel()
        rows = aten.reshape.default(x, [n, *x.shape[mask.ndim :]])
        flat = self._flat.get(id(mask))  # one mask for every selection it makes
        if flat is None:
            flat = aten.reshape.default(aten._to_copy.default(mask, dtype=torch.bool), [n])
            self._keep.append(mask)
            self._flat[id(mask)] = flat
        if outer is not None:
            if mask.shape[0] != outer.numel():
                return None
            both_key = (id(mask), id(outer))
            if both_key not in self._expanded:
                per_row = aten.reshape.default(outer, [outer.numel()] + [1] * (mask.ndim - 1))
                both = aten.reshape.default(aten.expand.default(per_row, list(mask.shape)), [n])
                self._expanded[both_key] = aten.logical_and.default(flat, both)
            flat = self._expanded[both_key]
        with self._untracked():  # (no gradient: a NaN target's would reach a selected row)
            first = aten.argmax.default(aten._to_copy.default(flat, dtype=torch.int32))
            fill = aten.detach.default(aten.index.Tensor(rows, [aten.unsqueeze.default(first, 0)]))
        keep = aten.reshape.default(flat, [n] + [1] * (rows.ndim - 1))
        return self._mark(aten.where.self(keep, rows, fill), flat)

    # ---- ops reading a selection ----------------------------------------------------------

    def _on_selection(self, func, args, kwargs, mask):
        if func in _INDEX:
            selected = self._select(func, args, outer=mask)
            if selected is None:
                raise self._refuse(func, "it selects with a mask over other dims than the rows")
            return selected
        if func is aten.gather.default and id(args[0]) not in self._masks:
            return self._mark(func(*args, **kwargs), mask)  # a lookup per selected index
        if func is aten.nll_loss_forward.default:
            return self._nll(func, args, kwargs, mask)
        schema = func._schema.arguments
        names = [a.name for a in schema]
        if "reduction" in names:
            return self._loss(func, args, kwargs, names.index("reduction"), mask)
        if func in (aten.sum.default, aten.mean.default):
            x = args[0]
            dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
            return self._reduce(x, mask, list(range(x.ndim)), func is aten.mean.default, dtype)
        x = args[0]
        if func in _REDUCE_DIMS:
            dims = _dims(args[1] if len(args) > 1 else kwargs.get("dim"), x.ndim)
            if 0 not in dims:
                return self._mark(func(*args, **kwargs), mask)
            if func in (aten.sum.dim_IntList, aten.mean.dim) and not (
                args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            ):
                dtype = kwargs.get("dtype")
                return self._reduce(x, mask, dims, func is aten.mean.dim, dtype)
            raise self._refuse(func, "it reduces over the selected rows")
        if func in _ALONG_DIM:
            if args[1] % x.ndim == 0:
                raise self._refuse(func, "it runs along the selected rows")
            return self._mark(func(*args, **kwargs), mask)
        if func in _ONE_DIM and id(x) in self._masks:
            return self._one_dim(func, args, kwargs, mask)
        if func in _PUT:
            return self._put(func, args, kwargs, mask)
        if func in _LEFT_ROWS:  # a head over the selected rows (``decoder(hidden[m])``)
            left = _LEFT_ROWS[func]
            if any(id(a) in self._masks for i, a in enumerate(args) if i != left):
                raise self._refuse(func, "it multiplies by the selected rows on the right")
            return self._mark(func(*args, **kwargs), mask)
        if func in _ROW_WISE and id(args[0]) in self._masks:
            out = func(*args, **kwargs)
            if out[0].ndim > 1:  # (a layer norm over dim 0 too: not row-wise)
                return (self._mark(out[0], mask), *out[1:])
        if func in _REPEATS_FREE and len(args) == 1 and not kwargs:
            return func(*args)
        if func in _AT_DIM or func in _AT_DIMS:
            return self._along(func, args, kwargs, mask)
        if (
            func is aten.expand.default
            and x.ndim == len(args[1])
            and args[1][0] in (-1, x.shape[0])
        ):
            return self._mark(func(*args, **kwargs), mask)
        if func in _SAME or func in _LIKE:
            return self._mark(func(*args, **kwargs), mask)
        if func in _VIEWS:
            return self._view(func, args, kwargs, mask)
        if torch.Tag.pointwise in func.tags or func in _ELEMENTWISE:
            out = func(*args, **kwargs)
            for a in pytree.tree_leaves((args, kwargs)):
                if (isinstance(a, torch.Tensor) and id(a) not in self._masks
                        and a.ndim == out.ndim and a.shape[0] != 1):  # fmt: skip
                    raise self._refuse(func, "an operand without the mask has rows of its own")
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and o.ndim > 0 and o.shape[0] == mask.numel():
                    self._mark(o, mask)
            return out
        raise self._refuse(func, "it is not elementwise, row-wise or a reduction")

    def _along(self, func, args, kwargs, mask):
        """A view or a lookup along dims other than the rows': the rows stay (an unsqueeze,
        ``x[:, 0]``, ``x.gather(1, y[:, None])`` with the index selected too)."""
        x = args[0]
        if func is aten.permute.default:
            ok = list(args[1])[0] % x.ndim == 0
        else:
            dims = args[1:3] if func is aten.transpose.int else args[1]
            dims = [dims] if isinstance(dims, int) else list(dims)
            ndim = x.ndim + (func is aten.unsqueeze.default)
            ok = x.ndim > 0 and all(d % ndim != 0 for d in dims)
        if func in _BY_INDEX or func is aten.index_select.default:
            index = args[2]
            ok = ok and (id(index) in self._masks) == (func in _BY_INDEX)
        if not ok:
            raise self._refuse(func, "it is not elementwise, row-wise or a reduction (it "
                                     "reads along the selected rows)")  # fmt: skip
        return self._mark(func(*args, **kwargs), mask)

    def _one_dim(self, func, args, kwargs, mask):
        """An op along one dim that is not the rows': each output keeps the rows."""
        x = args[0]
        names = [a.name for a in func._schema.arguments]
        at = names.index("dim")
        dim = (
            args[at]
            if len(args) > at
            else kwargs.get("dim", func._schema.arguments[at].default_value)
        )
        if dim is None or x.ndim == 0 or dim % x.ndim == 0:
            raise self._refuse(func, "it runs along the selected rows")
        out = func(*args, **kwargs)
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.ndim > 0 and o.shape[0] == mask.numel():
                self._mark(o, mask)
        return out

    def _put(self, func, args, kwargs, mask):
        """``out[m] = values``: ``values`` selected by the same mask ``m``, ``out`` holding all
        the rows: the selected rows take the values, the others keep theirs."""
        names = [a.name for a in func._schema.arguments]
        bound = dict(zip(names, args, strict=False)) | kwargs
        out, index, values = bound["self"], bound["indices"], bound["values"]
        m = index[0] if len(index) == 1 else None
        if (id(out) in self._masks or m is None or self._flat.get(id(m)) is not mask
                or id(values) not in self._masks or tuple(out.shape[: m.ndim]) != tuple(m.shape)):  # fmt: skip
            raise self._refuse(func, "it writes rows selected by another mask than its index")
        n = mask.numel()
        rows = aten.reshape.default(out, [n, *out.shape[m.ndim :]])
        keep = aten.reshape.default(mask, [n] + [1] * (rows.ndim - 1))
        new = aten.expand.default(values, list(rows.shape)) if values.ndim == rows.ndim else (
            aten.expand.default(aten.reshape.default(values, [n] + [1] * (rows.ndim - 1)),
                                list(rows.shape)))  # fmt: skip
        if bound.get("accumulate", False):
            new = aten.add.Tensor(rows, new)
        result = aten.reshape.default(aten.where.self(keep, new, rows), list(out.shape))
        if func is aten.index_put_.default:
            return aten.copy_.default(out, result)
        return result

    def _where_selected(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = aten.reshape.default(mask, [mask.numel()] + [1] * (x.ndim - 1))
        return aten.where.self(keep, x, aten.zeros_like.default(x))

    def _reduce(self, x, mask, dims, mean: bool, dtype=None):
        """A sum over ``dims`` (the rows among them) of the selected rows; a mean divides it
        by the number of selected elements it covers."""
        x = self._where_selected(x, mask)
        total = aten.sum.dim_IntList(x, dims, False, dtype=dtype) if dtype else (
            aten.sum.dim_IntList(x, dims))  # fmt: skip
        if not mean:
            return total
        keep = aten.reshape.default(mask, [mask.numel()] + [1] * (x.ndim - 1))
        count = aten.sum.dim_IntList(aten.expand.default(keep, list(x.shape)), dims)
        return aten.div.Tensor(total, count)

    def _loss(self, func, args, kwargs, at: int, mask):
        args, kwargs = list(args), dict(kwargs)
        if at < len(args):
            reduction, args[at] = args[at], _NONE
        else:
            reduction, kwargs["reduction"] = kwargs.get("reduction", _MEAN), _NONE
        out = func(*args, **kwargs)
        if reduction == _NONE:
            return self._mark(out, mask)
        return self._reduce(out, mask, list(range(out.ndim)), reduction == _MEAN)

    def _nll(self, func, args, kwargs, mask):
        names = [a.name for a in func._schema.arguments]
        bound = dict(zip(names, args, strict=False)) | kwargs
        x, target = bound["self"], bound["target"]
        if id(x) not in self._masks or id(target) not in self._masks:
            raise self._refuse(func, "its input and target must be selected by the same mask")
        keep = aten.reshape.default(mask, [mask.numel()] + [1] * (target.ndim - 1))
        bound["target"] = aten.where.self(keep, target,
                                          aten.full_like.default(target, bound["ignore_index"]))  # fmt: skip
        out = func(*[bound[n] for n in names])
        if bound["reduction"] == _NONE:
            self._mark(out[0], mask)
        return out

    def _view(self, func, args, kwargs, mask):
        x, shape = args[0], list(args[1])
        out = func(*args, **kwargs)
        n = mask.numel()
        if out.ndim > 0 and out.shape[0] == n:
            return self._mark(out, mask)
        # the rows merged with the dims after them (rows x positions, or all flat): each
        # new row lies in one selected row
        lead = next((j for j in range(2, x.ndim + 1)
                     if out.ndim > 0 and out.shape[0] == x.shape[:j].numel()), None)  # fmt: skip
        if lead is not None:
            per_row = x.shape[1:lead].numel()
            key = (id(mask), per_row)  # one mask for every view of the rows so
            if key not in self._expanded:
                self._keep.append(mask)
                expanded = aten.expand.default(aten.unsqueeze.default(mask, 1), [n, per_row])
                self._expanded[key] = aten.reshape.default(expanded, [n * per_row])
            return self._mark(out, self._expanded[key])
        raise self._refuse(func, f"it reshapes the selected rows to {shape}")

    @staticmethod
    def _refuse(func, why: str) -> DataDependentError:
        return DataDependentError(
            f"{func} reads rows selected by a boolean mask (x[mask]), whose number depends on "
            f"the mask's values, and {why}. In a captured graph a selection runs as all rows "
            "with the mask beside them (Note [rows selected by a mask]): elementwise and "
            "row-wise ops, sums, means and losses with a reduction read it. Otherwise keep the "
            "shapes fixed: torch.where(mask, x, 0), a multiplication by the mask, or a loss's "
            "ignore_index."
        )
