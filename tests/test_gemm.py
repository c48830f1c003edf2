"""The simulator's matmul (Note [gemm kernel] in csrc/gemm.cpp; torch_popxl/runtime/gemm.py):
both kernels against a float64 reference, the calls that always run ATen's kernel, argument
errors, the kernel setting, and a compiled trainer under each kernel against eager torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl.runtime import gemm as G

ONEDNN = torch.backends.mkldnn.is_available()
KERNELS = [k for k in G.KERNELS if k == "aten" or ONEDNN]


def _operands(case: str, M=96, K=200, N=160):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    a, b = {
        "plain": (r(M, K), r(K, N)),
        "a transposed": (r(K, M).t(), r(K, N)),
        "b transposed": (r(M, K), r(N, K).t()),
        "both transposed": (r(K, M).t(), r(N, K).t()),
        "column slices": (r(M, 2 * K)[:, K:], r(K, 3 * N)[:, N : 2 * N]),
        "strided columns": (r(M, 2 * K)[:, ::2], r(K, N)),
        "3-D rows": (r(4, M, K), r(K, N)),
    }[case]
    return a, b


CASES = ["plain", "a transposed", "b transposed", "both transposed", "column slices",
         "strided columns", "3-D rows"]  # fmt: skip


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_float64(kernel, case, with_bias):
    a, b = _operands(case)
    bias = torch.randn(b.shape[1]) if with_bias else None
    expected = a.double() @ b.double() + (0 if bias is None else bias.double())
    with G.using(kernel):
        got = G.gemm(a, b, bias)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # float32 rounding of K=200 products of unit normals: |error| well under 1e-4
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-4)


@pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
def test_onednn_kernel_really_runs():
    """The two kernels add the K products in different orders: some bits differ (a gemm that
    silently fell back to ATen would equal torch.mm exactly)."""
    a, b = _operands("plain", 256, 784, 512)
    with G.using("onednn"):
        fast = G.gemm(a, b)
    with G.using("aten"):
        slow = G.gemm(a, b)
    assert torch.equal(slow, a @ b)
    assert not torch.equal(fast, slow)
    torch.testing.assert_close(fast, slow, rtol=0, atol=5e-4)


@pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
@pytest.mark.parametrize("shape", [(256, 512, 512), (256, 784, 512), (32, 10, 512), (300, 97, 61)])
def test_transposed_left_operand_gives_the_linear_kernels_bits(shape):
    """A weight gradient's x^T (a transposed view) runs oneDNN's matmul on the view (Note [gemm
    kernel]): the bits of the same product through oneDNN's linear on a contiguous copy. Where
    oneDNN adds the products in another order than torch.mm (MKL's AVX2 path on AMD CPUs) that
    also shows the oneDNN route ran; on Intel CPUs with AVX-512 both kernels give the same bits
    for these shapes, so no claim about torch.mm's bits is made."""
    rows, M, N = shape
    g = torch.Generator().manual_seed(1)
    x, b = torch.randn(rows, M, generator=g), torch.randn(rows, N, generator=g)
    with G.using("onednn"):
        strided = G.gemm(x.t(), b)
        copied = G.gemm(x.t().contiguous(), b)
    assert torch.equal(strided, copied)
    torch.testing.assert_close(strided, x.t().double().mm(b.double()).float(), rtol=0, atol=5e-4)


@pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
@pytest.mark.parametrize(
    "make",
    [
        lambda: (
            torch.randn(64, 80, dtype=torch.float64),
            torch.randn(80, 70, dtype=torch.float64),
        ),
        lambda: (torch.randn(4, 8), torch.randn(8, 4)),  # too small to pay
        lambda: (torch.randn(0, 80), torch.randn(80, 70)),  # empty
        lambda: (torch.randn(64, 80, requires_grad=True), torch.randn(80, 70)),  # recorded
    ],
    ids=["float64", "tiny", "empty", "autograd records it"],
)
def test_calls_oneDNN_does_not_take_run_atens_kernel(make):
    a, b = make()
    with G.using("onednn"):
        got = G.gemm(a, b)
    assert torch.equal(got.detach(), (a @ b).detach())


def test_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"a's last dim \(5\) must equal b's first \(6\)"):
        G.gemm(torch.ones(3, 5), torch.ones(6, 2))
    with pytest.raises(ValueError, match=r"expected a \[..., K\] and b \[K, N\]"):
        G.gemm(torch.ones(3, 5), torch.ones(5, 2, 2))
    with pytest.raises(ValueError, match=r"bias must be a scalar or \[N\] \(N = 2\)"):
        G.gemm(torch.ones(3, 5), torch.ones(5, 2), torch.ones(3))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", ["plain", "a transposed", "b transposed", "column slices"])
def test_gemm_out_writes_gemms_bits_into_the_given_tensor(kernel, case):
    """Note [weight gradients into their accumulators]: ``gemm_out_`` writes exactly the
    product ``gemm`` returns (same kernel, same bits) into the caller's tensor, and returns
    it; that product is a float32 ``a @ b`` (float64 reference)."""
    a, b = _operands(case)
    out = torch.full((a.shape[0], b.shape[1]), float("nan"))
    with G.using(kernel):
        want = G.gemm(a, b)
        got = G.gemm_out_(out, a, b)
    assert got is out
    assert torch.equal(out, want)
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=0, atol=2e-4)


def test_gemm_out_refuses_an_output_of_another_shape_or_dtype():
    a, b = torch.ones(3, 5), torch.ones(5, 2)
    kept = torch.full((2, 3), 7.0)
    with pytest.raises(ValueError, match=r"out must be \[3, 2\] Float .* \(a @ b\), got \[2, 3\]"):
        G.gemm_out_(kept, a, b)
    assert torch.equal(kept, torch.full((2, 3), 7.0))  # untouched
    with pytest.raises(ValueError, match=r"got \[3, 2\] Double"):
        G.gemm_out_(torch.zeros(3, 2, dtype=torch.float64), a, b)


def test_kernel_setting(monkeypatch):
    before = G.kernel()
    with G.using("aten"):
        assert G.kernel() == "aten"
    assert G.kernel() == before
    with pytest.raises(ValueError, match="expected one of aten, onednn, got 'blas'"):
        G.set_kernel("blas")
    assert G.kernel() == before
    monkeypatch.setenv(G.ENV, "aten")
    assert G.default_kernel() == "aten"
    monkeypatch.setenv(G.ENV, "fast")
    with pytest.raises(ValueError, match=r"\$TORCH_POPXL_GEMM='fast': expected one of"):
        G.default_kernel()
    monkeypatch.delenv(G.ENV)
    assert G.default_kernel() in G.KERNELS


def test_addmm_form_matches_torch():
    a, b, bias = torch.randn(64, 90), torch.randn(90, 50), torch.randn(50)
    torch.testing.assert_close(G.addmm(bias, a, b), torch.addmm(bias, a, b))
    # scaled forms are torch.addmm itself
    assert torch.equal(
        G.addmm(bias, a, b, beta=0.5, alpha=2), torch.addmm(bias, a, b, beta=0.5, alpha=2)
    )


# Optimizers whose update does not amplify the two kernels' different summation orders: SGD
# with momentum is linear in the gradient; Adam's step lr * m / (sqrt(v) + eps) changes by up
# to lr / eps per unit of gradient near g = 0, so with torch's eps = 1e-8 a gradient within
# float32 rounding of 0 can move a weight by up to 2 * lr per step on one CPU and not on
# another (seen on an Intel Xeon: 5.8e-5 after 3 steps). eps = 1e-4 bounds that to
# lr / eps = 10 times the gradient's rounding, far below the tolerance below.
OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-4),
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_compiled_trainer_under_each_kernel_trains_as_eager(kernel, optimizer):
    """The seed MLP (R=2, GA=2) for 3 steps under each kernel: losses and weights equal eager
    torch on the global batch within float32 rounding, on any x86 CPU (Intel or AMD)."""
    torch.manual_seed(0)

    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.GELU(),
                                   torch.nn.Linear(256, 10))  # fmt: skip

    eager, compiled_model = model(), model()
    make_opt = OPTIMIZERS[optimizer]
    opt = make_opt(eager.parameters())
    rng = np.random.default_rng(0)
    with G.using(kernel):
        trainer = popxl.compile(compiled_model, torch.nn.functional.cross_entropy,
                                make_opt(compiled_model.parameters()),
                                replication_factor=2, gradient_accumulation=2)  # fmt: skip
        for _ in range(3):
            x = rng.normal(size=(32, 784)).astype(np.float32)
            y = rng.integers(0, 10, 32)
            loss = trainer.step(x, y)
            opt.zero_grad()
            ref = torch.nn.functional.cross_entropy(eager(torch.from_numpy(x)), torch.from_numpy(y))
            ref.backward()
            opt.step()
            np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
            # p.grad: the last step's gradient, each weight's written by its folded matmul
            # straight into its accumulator (Note [weight gradients into their accumulators])
            for p, q in zip(compiled_model.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=2e-5, atol=1e-6)
        trainer.sync_weights()
    # Weights move by ~1e-2 (SGD) / 3e-3 (Adam) over the 3 steps; float32 summation-order
    # differences leave them within a few ulps of 1.
    for p, q in zip(compiled_model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("a_rows", [False, True], ids=["a-invariant", "a-batched"])
@pytest.mark.parametrize("b_rows", [False, True], ids=["b-invariant", "b-batched"])
@pytest.mark.parametrize("bias", ["none", "invariant", "batched"])
@pytest.mark.parametrize("a_rank", [2, 3])
def test_gemm_under_vmap_is_a_per_row_matmul(a_rows, b_rows, bias, a_rank, capfd):
    """gemm's batching rule (a fragment on the per-replica path calls it under vmap): row r
    is ``a_r @ b_r + bias_r``, with no per-row fallback loop (torch's fallback prints a
    "performance drop" line to stderr)."""
    if not (a_rows or b_rows or bias == "batched"):
        pytest.skip("vmap needs one batched operand")
    R = 3
    g = torch.Generator().manual_seed(0)
    a = torch.randn(R, *([4] * (a_rank - 1)), 5, generator=g)
    b, c = torch.randn(R, 5, 6, generator=g), torch.randn(R, 6, generator=g)
    args = (a if a_rows else a[0], b if b_rows else b[0], None if bias == "none" else
            (c if bias == "batched" else c[0]))  # fmt: skip
    dims = (0 if a_rows else None, 0 if b_rows else None, 0 if bias == "batched" else None)
    got = torch.func.vmap(G.gemm, in_dims=dims)(*args)
    for r in range(R):
        row = [t if d is None else t[r] for t, d in zip(args, dims, strict=True)]
        want = row[0] @ row[1] + (0 if row[2] is None else row[2])
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
    assert capfd.readouterr().err == ""


def test_gemm_under_vmap_with_an_empty_contraction_is_zero():
    # K = 0 (linalg ops on empty matrices): every product is the empty sum
    a, b = torch.randn(2, 0, 0), torch.randn(2, 0, 3)
    torch.testing.assert_close(torch.func.vmap(G.gemm)(a, b), torch.zeros(2, 0, 3))
    a, b = torch.randn(2, 4, 0), torch.randn(2, 0, 3)
    torch.testing.assert_close(torch.func.vmap(G.gemm)(a, b), torch.zeros(2, 4, 3))
