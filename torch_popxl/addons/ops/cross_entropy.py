"""``cross_entropy`` and ``cross_entropy_with_grad`` (spec addons §8).

``p = softmax(x)`` over the last axis; per item loss ``-log(max(p[label], eps))``. The
gradient ``(p - onehot(label)) * loss_scaling / D`` is computed directly (D = number of
non-ignored items for "mean", 1 for "sum"); the loss itself is never scaled.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import dtypes as _dtypes
from ...ir.tensor import Tensor

__all__ = ["cross_entropy", "cross_entropy_with_grad"]

_REDUCTIONS = ("mean", "sum", "none")

# The maths below is torch code run on popxl handles: each torch function or method records an
# op (``Tensor.__torch_function__`` / ``__getattr__``) and returns a popxl Tensor, where torch's
# stubs say torch.Tensor. Such traced values are typed ``_Traced``.
_Traced = Any


def _eps(x: Tensor) -> float:
    return 6.104e-5 if x.dtype == _dtypes.float16 else 1e-7


def _check(x: Tensor, labels: Tensor, reduction: str) -> Tensor:
    """``labels`` laid out as ``x.shape[:-1]``. Upstream's loss op (PopART's
    NlllWithSoftmaxGradDirect) reads the logits as rows ``(-1, C)`` and the labels flattened, so
    any label shape with one label per row is accepted (BERT's MLM head passes ``(batch,
    mask_tokens)`` labels for ``(batch * mask_tokens, vocab)`` logits)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}; got {reduction!r}.")
    rows = tuple(x.shape[:-1])
    if torch.Size(labels.shape).numel() != torch.Size(rows).numel():
        raise ValueError(
            f"cross_entropy: labels have shape {labels.shape} ({torch.Size(labels.shape).numel()} "
            f"labels), expected one label per row of x: x.shape[:-1] = {rows} (x has shape "
            f"{x.shape}; classes are on the last axis)."
        )
    if labels.dtype.is_floating_point:
        raise TypeError(
            f"cross_entropy: labels must be integers (int32/uint32); got {labels.dtype.name}."
        )
    return labels if tuple(labels.shape) == rows else labels.reshape(rows)


def _per_label(loss: _Traced, labels: Tensor, reduction: str) -> _Traced:
    # reduction "none": one loss per label, in the labels' own shape (as upstream's op).
    if reduction == "none" and tuple(loss.shape) != tuple(labels.shape):
        return loss.reshape(tuple(labels.shape))
    return loss


def _parts(
    x: _Traced, labels: _Traced, ignore_index: int | None
) -> tuple[_Traced, _Traced, _Traced, _Traced]:
    """(probabilities, one-hot labels, mask of counted items or None, per-item loss)."""
    p: _Traced = torch.softmax(x, dim=-1)
    lab = labels.to(torch.int64)
    mask = None
    if ignore_index is not None:
        mask = torch.ne(lab, ignore_index)
        lab = torch.where(mask, lab, torch.zeros_like(lab))
    classes = torch.arange(x.shape[-1], dtype=torch.int64)
    onehot = torch.eq(lab.unsqueeze(-1), classes).to(p.dtype.as_torch())
    picked = torch.sum(p * onehot, dim=-1)
    item_loss = torch.neg(torch.log(torch.clamp(picked, min=_eps(x))))
    if mask is not None:
        item_loss = torch.where(mask, item_loss, torch.zeros_like(item_loss))
    return p, onehot, mask, item_loss


def _divisor(x: Tensor, mask, reduction: str, num_items: int):
    if reduction != "mean":
        return None
    if mask is None:
        return float(num_items)
    return torch.clamp(torch.sum(mask.to(x.dtype.as_torch())), min=1.0)


def _reduce(item_loss, divisor, reduction: str):
    if reduction == "none":
        return item_loss
    total = torch.sum(item_loss)
    return total if divisor is None else torch.div(total, divisor)


def cross_entropy(
    x: Tensor, labels: Tensor, ignore_index: int | None = None, reduction: str = "mean"
) -> Tensor:
    """Softmax cross entropy of logits ``x`` (classes on the last axis) against ``labels``."""
    rows = _check(x, labels, reduction)
    _, _, mask, item_loss = _parts(x, rows, ignore_index)
    num_items = int(torch.Size(labels.shape).numel())
    loss = _reduce(item_loss, _divisor(x, mask, reduction, num_items), reduction)
    return _per_label(loss, labels, reduction)


def cross_entropy_with_grad(x: Tensor, labels: Tensor, loss_scaling: float | Tensor = 1,
                            ignore_index: int | None = None,
                            reduction: str = "mean") -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(loss, dloss/dx * loss_scaling)``; the loss is not scaled."""
    rows = _check(x, labels, reduction)
    p, onehot, mask, item_loss = _parts(x, rows, ignore_index)
    num_items = int(torch.Size(labels.shape).numel())
    divisor = _divisor(x, mask, reduction, num_items)
    loss = _per_label(_reduce(item_loss, divisor, reduction), labels, reduction)
    dx: _Traced = torch.sub(p, onehot)
    if mask is not None:
        dx = dx * mask.unsqueeze(-1).to(dx.dtype.as_torch())
    if isinstance(loss_scaling, Tensor):
        scale: _Traced = loss_scaling
        dx = dx * scale.to(dx.dtype.as_torch())
    elif float(loss_scaling) != 1.0:
        dx = dx * float(loss_scaling)
    if divisor is not None:
        dx = torch.div(dx, divisor)
    return loss, dx
