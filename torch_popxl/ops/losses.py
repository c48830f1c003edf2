"""Losses: ``nll_loss`` and ``nll_loss_with_softmax_grad`` (PopART's loss with the softmax
input's gradient, fused into one captured function on the common path).
"""

from __future__ import annotations

import torch

from .. import dtypes as _dtypes
from ..ir.tensor import Tensor, constant
from ._common import call_op
from .elementwise import add, div, log, mul, neg, sub, where
from .reductions import reduce_sum
from .shape import cast, reshape

__all__ = ["nll_loss", "nll_loss_with_softmax_grad"]


def _label_rows(probs: Tensor, labels: Tensor):
    p2 = reshape(probs, (-1, probs.shape[-1]))
    l1 = call_op(torch.Tensor.to, (reshape(labels, (-1,)), torch.int64), {})
    return p2, l1


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got {reduction!r}.")


def nll_loss(probs: Tensor, labels: Tensor, ignore_index: int | None = None,
             reduction: str = "mean", log_prob: bool = False) -> Tensor:  # fmt: skip
    """Negative log likelihood of ``labels`` under ``probs`` (or log-probs)."""
    _check_reduction(reduction)
    p2, l1 = _label_rows(probs, labels)
    picked = call_op(torch.gather, (p2, 1, call_op(torch.unsqueeze, (l1, 1), {})), {})
    picked = reshape(picked, (-1,))
    if log_prob:
        rows = neg(picked)
    else:
        eps = 6.104e-5 if probs.dtype == _dtypes.float16 else 1e-7
        rows = neg(log(call_op(torch.clamp, (picked,), {"min": eps})))
    return _reduce_rows(rows, l1, labels, ignore_index, reduction)


def _reduce_rows(rows, l1, labels, ignore_index, reduction):
    count = None
    if ignore_index is not None:
        mask = call_op(torch.ne, (l1, ignore_index), {})
        rows = where(mask, rows, 0.0)
        count = call_op(torch.clamp, (reduce_sum(cast(mask, rows.dtype)),), {"min": 1.0})
    if reduction == "none":
        return reshape(rows, labels.shape)
    total = reduce_sum(rows)
    if reduction == "sum":
        return total
    if count is not None:
        return div(total, count)
    return div(total, float(rows.shape[0]))


def nll_loss_with_softmax_grad(probs: Tensor, labels: Tensor, loss_grad=1,
                               ignore_index: int | None = None,
                               reduction: str = "mean") -> tuple[Tensor, Tensor]:  # fmt: skip
    """Loss of softmax ``probs`` and its gradient with respect to the softmax input."""
    _check_reduction(reduction)
    if ignore_index is None and reduction != "none" and not isinstance(loss_grad, Tensor):
        return _nll_softmax_grad_fused(probs, labels, float(loss_grad), reduction)
    if not isinstance(loss_grad, Tensor):
        loss_grad = constant(float(loss_grad), _dtypes.float32)
    p2, l1 = _label_rows(probs, labels)
    num_classes = probs.shape[-1]
    picked = call_op(torch.gather, (p2, 1, call_op(torch.unsqueeze, (l1, 1), {})), {})
    rows = neg(log(add(reshape(picked, (-1,)), 1e-7)))
    loss = _reduce_rows(rows, l1, labels, ignore_index, reduction)
    onehot_ = call_op(torch.nn.functional.one_hot, (l1, num_classes), {})
    dx = sub(p2, cast(onehot_, probs.dtype))
    lg = cast(loss_grad, probs.dtype)
    if ignore_index is not None:
        mask = cast(call_op(torch.ne, (l1, ignore_index), {}), probs.dtype)
        dx = mul(dx, call_op(torch.unsqueeze, (mask, 1), {}))
        count = call_op(torch.clamp, (reduce_sum(mask),), {"min": 1.0})
    if reduction == "none":
        dx = mul(dx, reshape(lg, (-1, 1)) if lg.nelms > 1 else lg)
    elif reduction == "sum":
        dx = mul(dx, lg)
    elif ignore_index is not None:
        dx = mul(dx, div(lg, count))
    else:
        # PopART divides the mean gradient by the first dimension only (see spec §9).
        dx = mul(dx, div(lg, float(probs.shape[0])))
    return loss, reshape(dx, probs.shape)


def _nll_softmax_grad_torch(probs, labels, loss_grad: float, reduction: str):
    # The same maths as the general path in a few fused torch ops (it runs every training
    # step): -log(p[label] + 1e-7) and dx = (p - onehot) * scale.
    p2 = probs.reshape(-1, probs.shape[-1])
    l1 = labels.reshape(-1).long()
    # gather + sum rather than nll_loss: under vmap nll_loss runs a Python decomposition.
    picked = torch.log(p2.gather(1, l1.unsqueeze(1)) + 1e-7).sum()
    loss = -picked if reduction == "sum" else -(picked / l1.shape[0])
    minus_one = torch.full((l1.shape[0], 1), -1.0, dtype=p2.dtype, device=p2.device)
    dx = p2.scatter_add(1, l1.unsqueeze(1), minus_one)
    # PopART divides the mean gradient by the first dimension only (see spec §9).
    scale = loss_grad if reduction == "sum" else loss_grad / probs.shape[0]
    return loss, (dx * scale).reshape(probs.shape)


def _nll_softmax_grad_fused(probs: Tensor, labels: Tensor, loss_grad: float, reduction: str):
    return call_op(_nll_softmax_grad_torch, (probs, labels, loss_grad, reduction), {})
