"""Note [portable attention] (torch_popxl/opdefs/attention.py): the math kernels that run the
CPU flash-attention ops of a captured program on other devices equal torch's CPU kernels
(forward output and logsumexp, backward gradients) for every mask form. The GPU path itself
is checked in tests/test_cuda.py (a compiled transformer against eager torch)."""

from __future__ import annotations

import pytest
import torch

from torch_popxl.opdefs.attention import flash_backward, flash_forward

aten = torch.ops.aten
B, H, L, S, E = 2, 3, 5, 7, 8


def _inputs(dtype, mask: str):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, E, generator=g).to(dtype) for n in (L, S, S))
    if mask == "bool":
        m = torch.rand(B, 1, L, S, generator=g) > 0.3
        m[..., 0] = True  # every row keeps a key
        return q, k, v, {"attn_mask": m}
    if mask == "additive":
        return q, k, v, {"attn_mask": torch.randn(1, H, L, S, generator=g).to(dtype)}
    return q, k, v, {}


# torch's CPU kernel takes float masks only (scaled_dot_product_attention turns a boolean one
# into -inf/0 first); the boolean form is checked against that float mask below.
CASES = [("none", False, None), ("none", True, None), ("additive", False, None),
         ("additive", False, 0.3), ("none", True, 0.5)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask,causal,scale", CASES)
def test_math_kernels_equal_torch_cpu_flash_attention(dtype, mask, causal, scale):
    if causal:
        q, k, v, kw = _inputs(dtype, mask)
        k, v = k[:, :, :L], v[:, :, :L]  # causal: a square mask
    else:
        q, k, v, kw = _inputs(dtype, mask)
    kw["scale"] = scale
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, **kw)
    got_out, got_lse = flash_forward(q, k, v, 0.0, causal, **kw)
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    assert got_out.dtype == out.dtype and got_lse.dtype == lse.dtype
    torch.testing.assert_close(got_out, out, rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse, lse, rtol=tol, atol=tol)
    grad = torch.randn_like(out)
    want = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, **kw
    )
    got = flash_backward(grad, q, k, v, out, lse, 0.0, causal, **kw)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=10 * tol, atol=10 * tol)


def test_a_boolean_mask_equals_its_float_form():
    q, k, v, kw = _inputs(torch.float64, "bool")
    as_float = torch.zeros(kw["attn_mask"].shape, dtype=torch.float64)
    as_float = as_float.masked_fill(~kw["attn_mask"], float("-inf"))
    want = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=as_float)
    got = flash_forward(q, k, v, **kw)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_row_with_every_key_masked_gives_zeros_not_nan():
    q, k, v, _ = _inputs(torch.float32, "none")
    m = torch.ones(B, H, L, S, dtype=torch.bool)
    m[:, :, 2] = False
    out, lse = flash_forward(q, k, v, attn_mask=m)
    assert torch.isneginf(lse[:, :, 2]).all() and (out[:, :, 2] == 0).all()
    assert torch.isfinite(out).all()
    grads = flash_backward(torch.ones_like(out), q, k, v, out, lse, 0.0, False, attn_mask=m)
    assert all(torch.isfinite(g).all() for g in grads)


def test_dropout_is_refused_with_the_reason():
    q, k, v, _ = _inputs(torch.float32, "none")
    with pytest.raises(NotImplementedError, match="dropout_p=0.1.*portable attention"):
        flash_forward(q, k, v, 0.1)
