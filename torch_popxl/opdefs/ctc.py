"""CTC loss with static shapes.

Note [CTC loss in a captured graph]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``F.ctc_loss`` runs ``aten._ctc_loss``, which returns the per-sample negative log-likelihood
``[N]`` and the forward variables ``log_alpha`` ``[N, T, 2 * max(target_lengths) + 1]`` that its
backward reads. That second shape depends on the target lengths' values, so torch's fake
tensors cannot run the op and a captured graph could not hold it. Only the likelihood leaves
the op (``ctc_loss``'s zero-infinity masking and reduction follow it), so the capture records
``torch_popxl::ctc_loss`` instead: the likelihood alone, computed by torch's kernel. Its
gradient ``torch_popxl::ctc_loss_backward`` runs torch's forward kernel again for ``log_alpha``
and then torch's backward kernel, so the numbers are eager torch's. Both take the lengths as
tensors (a Python list becomes a constant) and run on stacked replicas as one call over the
replicas' samples, which CTC treats independently.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..ir.graph import Op, Slot
from .registry import Effect, OpDef, register

__all__ = ["ctc_loss", "ctc_loss_backward"]

aten = torch.ops.aten


def _check(log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor):
    if log_probs.dim() != 3:
        raise ValueError(
            f"ctc_loss: log_probs must be [T, N, C] (time, batch, classes); got shape "
            f"{tuple(log_probs.shape)}."
        )
    n = log_probs.shape[1]
    if input_lengths.shape != (n,) or target_lengths.shape != (n,):
        raise ValueError(
            f"ctc_loss: input_lengths and target_lengths must hold one length per sample "
            f"({n}); got shapes {tuple(input_lengths.shape)} and {tuple(target_lengths.shape)}."
        )
    if targets.dim() == 2 and targets.shape[0] != n:
        raise ValueError(
            f"ctc_loss: padded targets must be [N={n}, S]; got shape {tuple(targets.shape)}."
        )


@torch.library.custom_op("torch_popxl::ctc_loss", mutates_args=())
def ctc_loss(log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
             blank: int, zero_infinity: bool) -> Tensor:  # fmt: skip
    """``aten._ctc_loss``'s negative log-likelihood per sample, ``[N]``."""
    _check(log_probs, targets, input_lengths, target_lengths)
    return aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank,
                                 zero_infinity)[0]  # fmt: skip


@ctc_loss.register_fake
def _(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    _check(log_probs, targets, input_lengths, target_lengths)
    return log_probs.new_empty(log_probs.shape[1:2])


@torch.library.custom_op("torch_popxl::ctc_loss_backward", mutates_args=())
def ctc_loss_backward(grad: Tensor, log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
                      target_lengths: Tensor, blank: int, zero_infinity: bool) -> Tensor:  # fmt: skip
    """The gradient of ``ctc_loss`` with respect to ``log_probs``, ``[T, N, C]``."""
    nll, log_alpha = aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths,
                                           blank, zero_infinity)  # fmt: skip
    return aten._ctc_loss_backward.Tensor(grad, log_probs, targets, input_lengths,
                                          target_lengths, nll, log_alpha, blank, zero_infinity)  # fmt: skip


@ctc_loss_backward.register_fake
def _(grad, log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    _check(log_probs, targets, input_lengths, target_lengths)
    return torch.empty_like(log_probs)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.blank, ctx.zero_infinity = inputs[4], inputs[5]


def _backward(ctx, grad):
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    g = torch.ops.torch_popxl.ctc_loss_backward(grad, log_probs, targets, input_lengths,
                                                target_lengths, ctx.blank, ctx.zero_infinity)  # fmt: skip
    return g, None, None, None, None, None


ctc_loss.register_autograd(_backward, setup_context=_save)


# ---- stacked replicas: one call over every replica's samples ----------------------------------


def _rows(x: Tensor, in_dim, size: int) -> Tensor:
    """``x`` with the replica dim first (expanded where it is the same on every replica)."""
    if in_dim is None:
        return x.unsqueeze(0).expand(size, *x.shape)
    return x.movedim(in_dim, 0)


def _samples(b: int, in_dims, log_probs, targets, input_lengths, target_lengths):
    """The ``b`` replicas' samples as one batch: ``[T, B * N, C]`` log-probabilities, the
    targets (padded ``[B * N, S]`` or concatenated ``[B * L]``) and ``[B * N]`` lengths."""
    lp = _rows(log_probs, in_dims[0], b)  # [B, T, N, C]
    t, n, c = lp.shape[1:]
    lp = lp.permute(1, 0, 2, 3).reshape(t, b * n, c)
    tg = _rows(targets, in_dims[1], b)
    tg = tg.reshape(b * tg.shape[1], *tg.shape[2:])
    il = _rows(input_lengths, in_dims[2], b).reshape(b * n)
    tl = _rows(target_lengths, in_dims[3], b).reshape(b * n)
    return lp, tg, il, tl, (b, t, n, c)


def _stacked_forward(b: int, in_dims, log_probs, targets, input_lengths, target_lengths,
                     blank, zero_infinity) -> Tensor:  # fmt: skip
    lp, tg, il, tl, (b, _, n, _) = _samples(b, in_dims, log_probs, targets, input_lengths,
                                            target_lengths)  # fmt: skip
    return ctc_loss(lp, tg, il, tl, blank, zero_infinity).reshape(b, n)


def _stacked_backward(b: int, in_dims, grad, log_probs, targets, input_lengths, target_lengths,
                      blank, zero_infinity) -> Tensor:  # fmt: skip
    lp, tg, il, tl, (b, t, n, c) = _samples(b, in_dims[1:], log_probs, targets, input_lengths,
                                            target_lengths)  # fmt: skip
    g = _rows(grad, in_dims[0], b).reshape(b * n)
    return (
        ctc_loss_backward(g, lp, tg, il, tl, blank, zero_infinity).reshape(t, b, n, c).movedim(1, 0)
    )


@ctc_loss.register_vmap
def _(info, in_dims, *args):
    return _stacked_forward(info.batch_size, in_dims, *args), 0


@ctc_loss_backward.register_vmap
def _(info, in_dims, *args):
    return _stacked_backward(info.batch_size, in_dims, *args), 0


def _explicit(stacked_form):
    """Note [explicit batching] (runtime/explicit.py): the op on stacked ``[R, ...]`` values as
    one call over every replica's samples (``stacked_form``: the vmap rules' own)."""

    def rule(op: Op, batched, num_replicas: int):
        dims = [0 if batched[a.index] else None for a in op.attrs.args if isinstance(a, Slot)]
        if not any(d == 0 for d in dims):
            return None
        return functools.partial(stacked_form, num_replicas, dims)

    return rule


register(OpDef("ctc_loss", Effect.NONE, {"explicit": _explicit(_stacked_forward)}),
         torch.ops.torch_popxl.ctc_loss.default)  # fmt: skip
register(OpDef("ctc_loss_backward", Effect.NONE, {"explicit": _explicit(_stacked_backward)}),
         torch.ops.torch_popxl.ctc_loss_backward.default)  # fmt: skip
