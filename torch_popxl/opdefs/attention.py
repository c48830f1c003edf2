"""Attention captured on the CPU, run on any device.

Note [portable attention]
~~~~~~~~~~~~~~~~~~~~~~~~~
Programs are captured with CPU tensors, where torch's ``scaled_dot_product_attention``
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu`` (forward: output and
logsumexp) and its ``_backward``. Those two ops have CPU kernels only, so a program captured
this way could not run with its replicas on a GPU. This stanza gives them kernels for every
other backend, in plain tensor math with the CPU kernel's contract: the same arguments,
``[B, H, L, E]`` output, ``[B, H, L]`` float32 (or float64) logsumexp, a boolean mask that keeps
``True`` entries or an additive float mask, ``is_causal`` as a lower-triangular mask, scale
``1 / sqrt(E)`` by default, and rows with every key masked give zeros. Half-precision inputs
are computed in float32 and their outputs rounded back, as the CPU kernel accumulates.
Dropout is refused (the CPU kernel has none either).
"""

from __future__ import annotations

import math

import torch

__all__ = ["flash_backward", "flash_forward"]

aten = torch.ops.aten


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scores(q, k, is_causal: bool, attn_mask, scale):
    """Scaled, masked scores ``[B, H, L, S]`` in the compute dtype, and the scale."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        L, S = s.shape[-2:]
        keep = torch.ones(L, S, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.to(s.dtype)
    return s, scale


def _probabilities(s, logsumexp):
    # A row whose keys are all masked has logsumexp -inf: its probabilities are 0, not NaN.
    return torch.exp(s - logsumexp.unsqueeze(-1)).nan_to_num(0.0)


def _check_dropout(dropout_p: float) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"_scaled_dot_product_flash_attention_for_cpu with dropout_p={dropout_p} on a "
            "non-CPU device: only dropout_p=0 is supported (Note [portable attention])."
        )


def flash_forward(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, *,
                  attn_mask=None, scale=None):  # fmt: skip
    """``(output, logsumexp)`` as the CPU flash-attention kernel returns them."""
    _check_dropout(dropout_p)
    ct = _compute_dtype(query)
    q, k, v = (t.to(ct) for t in (query, key, value))
    s, _ = _scores(q, k, is_causal, attn_mask, scale)
    logsumexp = torch.logsumexp(s, dim=-1)
    out = torch.matmul(_probabilities(s, logsumexp), v)
    return out.to(query.dtype), logsumexp


def flash_backward(grad_out, query, key, value, out, logsumexp, dropout_p: float,
                   is_causal: bool, *, attn_mask=None, scale=None):  # fmt: skip
    """``(grad_query, grad_key, grad_value)`` of :func:`flash_forward`, from its saved
    output and logsumexp."""
    _check_dropout(dropout_p)
    ct = _compute_dtype(query)
    q, k, v, o, do = (t.to(ct) for t in (query, key, value, out, grad_out))
    s, scale = _scores(q, k, is_causal, attn_mask, scale)
    p = _probabilities(s, logsumexp.to(ct))
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, v.transpose(-2, -1))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


# The CPU keeps torch's own kernels; every other backend that has none gets these.
_lib = torch.library.Library("aten", "IMPL")
for _backend in ("CUDA",):
    _lib.impl("_scaled_dot_product_flash_attention_for_cpu", flash_forward, _backend)
    _lib.impl("_scaled_dot_product_flash_attention_for_cpu_backward", flash_backward, _backend)
