"""Issue 12 (item 7): random ops draw independently on every replica in both executors.

The reference executor defines the semantics: it runs each op once per replica, so every
replica draws its own values from the op's distribution. The fast executor draws all
replicas at once (``vmap(randomness="different")``), so the two cannot agree value for value
even under one seed. What "equal" means here, for every captured random op family at
replication 2 and 4:

* same shapes and dtypes as the reference;
* replicas are independent: no two replicas hold the same values, and for continuous
  families the correlation between two replicas' samples is within 6 / sqrt(n) of 0;
* same distribution per replica: a two-sample Kolmogorov-Smirnov test of fast replica r
  against reference replica r does not reject at alpha = 1e-6 (n = 4096 draws each).

Randomness is detected from ``torch.Tag.nondeterministic_seeded`` (``rand_like`` has no
``Generator`` argument, which the old detection looked for).
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl import capture
from torch_popxl.runtime import explicit

N = 4096

# name -> (program on a replica-invariant float32 variable v of shape [N], continuous?)
FAMILIES = {
    "rand_like": (lambda v: torch.rand_like(v), True),
    "randn_like": (lambda v: torch.randn_like(v), True),
    "randint_like": (lambda v: torch.randint_like(v, 0, 1000), False),
    "bernoulli_tensor": (lambda v: torch.bernoulli(v + 0.3), False),
    "bernoulli_p": (lambda v: v.bernoulli(0.7), False),
    "dropout": (lambda v: F.dropout(v + 1.0, 0.5, training=True), False),
    "normal_tensor_mean": (lambda v: torch.normal(v, 2.0), True),
    "uniform_": (lambda v: (v + 0).uniform_(-1.0, 3.0), True),
    "normal_": (lambda v: (v + 0).normal_(1.0, 0.5), True),
    "exponential_": (lambda v: (v + 0).exponential_(2.0), True),
    "multinomial": (lambda v: torch.multinomial(v + 1.0, 512, replacement=True), False),
    "poisson": (lambda v: torch.poisson(v + 3.0), False),
    "uniform_on_the_variable": (lambda v: v.uniform_(), True),  # in place, on the variable
}


def _run(build, replicas, executor):
    ir = popxl.Ir(replicas)
    with ir.main_graph:
        v = popxl.variable(np.zeros(N, np.float32))
        y = build(v)
        out = popxl.d2h_stream(y.shape, y.dtype)
        ops.host_store(out, y)
    with popxl.Session(ir, executor=executor) as session:
        return session.run()[out]


def _ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Largest gap between the two samples' empirical CDFs."""
    a, b = np.sort(a.ravel()), np.sort(b.ravel())
    points = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, points, side="right") / a.size
    cdf_b = np.searchsorted(b, points, side="right") / b.size
    return float(np.abs(cdf_a - cdf_b).max())


def _ks_critical(n: int, m: int, alpha: float = 1e-6) -> float:
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_op_draws_independently_per_replica_like_the_reference(family, replicas):
    build, continuous = FAMILIES[family]
    torch.manual_seed(0)
    ref = _run(build, replicas, "reference")
    fast = _run(build, replicas, "fast")
    assert fast.shape == ref.shape and fast.dtype == ref.dtype
    assert fast.shape[0] == replicas
    for name, out in (("reference", ref), ("fast", fast)):
        rows = out.reshape(replicas, -1).astype(np.float64)
        for i in range(replicas):
            for j in range(i + 1, replicas):
                assert not np.array_equal(rows[i], rows[j]), (
                    f"{name}: replicas {i} and {j} drew the same values"
                )
                if continuous:
                    corr = np.corrcoef(rows[i], rows[j])[0, 1]
                    assert abs(corr) < 6 / math.sqrt(rows.shape[1]), (name, i, j, corr)
    for r in range(replicas):
        a, b = fast[r].astype(np.float64), ref[r].astype(np.float64)
        d = _ks_statistic(a, b)
        assert d < _ks_critical(a.size, b.size), (
            f"replica {r}: fast and reference distributions differ (KS {d:.4f})"
        )


def test_randomness_is_detected_from_the_nondeterministic_seeded_tag():
    aten = torch.ops.aten
    # no Generator argument in their schemas, yet random
    for op in (aten.rand_like.default, aten.randn_like.default, aten.randint_like.low_dtype):
        assert not any("Generator" in str(a.type) for a in op._schema.arguments)
        assert explicit.is_random(op)
    assert explicit.is_random(aten.bernoulli.default)
    assert explicit.is_random(aten.native_dropout.default)
    for op in (aten.add.Tensor, aten.zeros_like.default, aten.empty_like.default):
        assert not explicit.is_random(op)
    assert not explicit.is_random(torch.ops.torch_popxl.replicated_all_reduce.default)


def test_attention_and_dropout_with_probability_zero_draw_nothing():
    """Flash attention and dropout carry the seeded tag; with p = 0 they draw nothing, so they
    neither make a value per replica nor keep a program under vmap."""
    aten = torch.ops.aten
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    ir = popxl.Ir()
    with ir.main_graph:
        q = popxl.variable(np.ones((1, 2, 3, 4), np.float32))
        x = popxl.variable(np.ones((3,), np.float32))
        cases = [
            (capture.call_torch(flash, (q, q, q), {}), False),
            (capture.call_torch(flash, (q, q, q, 0.0), {}), False),
            (capture.call_torch(flash, (q, q, q), {"dropout_p": 0.1}), True),
            (capture.call_torch(aten.native_dropout.default, (x, 0.0, True), {}), False),
            (capture.call_torch(aten.native_dropout.default, (x, 0.5, True), {}), True),
            (capture.call_torch(aten.bernoulli.p, (x, 0.0), {}), True),  # not a dropout op
        ]
        for out, random in cases:
            first = out[0] if isinstance(out, tuple) else out
            op = first._graph._producer(first)
            assert explicit.is_random(op.attrs.target)
            assert explicit.draws_random(op) is random, (op.attrs.target, op.attrs.args)


# Note [counter-based bernoulli] (csrc/random.cpp): dropout masks in the generated code
_BERNOULLI = torch.ops.torch_popxl.bernoulli_p_


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_counter_based_bernoulli_draws_ones_at_rate_p(p, dtype):
    n = 100_001  # odd: the last element has no pair
    mask = _BERNOULLI(torch.empty(n, dtype=dtype), p).double()
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(mask.mean().item() - p) <= 6 * sigma + 1e-9
    # the two elements of one 64-bit draw, and neighbours in general, are uncorrelated
    if 0 < p < 1:
        even, odd = mask[:-1:2] - p, mask[1::2] - p
        corr = (even * odd).mean().item() / (p * (1 - p))
        assert abs(corr) < 6 / math.sqrt(n // 2), corr


def _splitmix64_mask(torch_seed: int, n: int, p: float) -> np.ndarray:
    """Note [counter-based bernoulli] in numpy: the kernel's seed is the first 64 bits of
    torch's generator after ``torch.manual_seed(torch_seed)`` (its Mersenne Twister is the
    standard one, numpy's legacy ``RandomState`` seeding: two 32-bit words, the first high),
    element pair k takes SplitMix64 at ``seed + k * golden``, low half first."""
    words = np.random.RandomState(torch_seed)._bit_generator.random_raw(2).astype(np.uint64)
    seed = (words[0] << np.uint64(32)) | words[1]
    z = seed + np.arange((n + 1) // 2, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    threshold = np.uint64(int(math.ldexp(p, 32)))
    pairs = np.stack([(z & np.uint64(0xFFFFFFFF)) < threshold, (z >> np.uint64(32)) < threshold])
    return pairs.T.reshape(-1)[:n].astype(np.float64)


@pytest.mark.parametrize("n", [1, 7, 4096, 2 * (1 << 17) + 3, 5 * (1 << 17) + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_counter_based_bernoulli_is_splitmix64_of_the_generators_seed(n, dtype):
    """The kernel's values are the formula's, element for element, whichever vector code the
    CPU runs (Note [vectorised mask draws]) and across its parallel chunks (2^17 pairs)."""
    torch.manual_seed(11)
    got = _BERNOULLI(torch.empty(n, dtype=dtype), 0.3).double().numpy()
    np.testing.assert_array_equal(got, _splitmix64_mask(11, n, 0.3))


def test_counter_based_bernoulli_follows_torch_manual_seed_and_never_repeats():
    torch.manual_seed(3)
    a = _BERNOULLI(torch.empty(4096), 0.5).clone()
    b = _BERNOULLI(torch.empty(4096), 0.5).clone()
    torch.manual_seed(3)
    assert torch.equal(_BERNOULLI(torch.empty(4096), 0.5), a)
    assert not torch.equal(a, b)  # each call takes a new seed from the generator


def test_counter_based_bernoulli_fills_a_strided_tensor_and_rejects_bad_input():
    t = torch.full((64, 33), 7.0).t()
    _BERNOULLI(t, 0.5)
    assert set(t.unique().tolist()) == {0.0, 1.0}
    with pytest.raises(RuntimeError, match="expected 0 <= p <= 1, got p=1.5"):
        _BERNOULLI(torch.empty(3), 1.5)
    with pytest.raises(RuntimeError, match="floating-point"):
        _BERNOULLI(torch.empty(3, dtype=torch.int64), 0.5)


def test_compiled_dropout_draws_its_masks_through_the_counter_based_kernel():
    """A compiled step's dropout mask is the kernel's for the generator's next seed: after
    ``torch.manual_seed(5)`` the step's outputs (dropout before an identity layer, on ones)
    are exactly ``bernoulli_p_(1 - p) / (1 - p)`` drawn after the same seed, over the global
    batch in order (the accumulation loop folded: one draw for every micro-batch and
    replica)."""
    R, GA, micro, width, p = 2, 2, 4, 8, 0.5
    model = torch.nn.Sequential(torch.nn.Dropout(p), torch.nn.Linear(width, width))
    with torch.no_grad():
        model[1].weight.copy_(torch.eye(width))
        model[1].bias.zero_()
    trainer = popxl.compile(model, lambda out, y: out.pow(2).mean(),
                            torch.optim.SGD(model.parameters(), 0.0), replication_factor=R,
                            gradient_accumulation=GA, return_outputs=True,
                            device="cpu")  # the kernel is the CPU's (a GPU draws through ATen)  # fmt: skip
    x, y = np.ones((R * GA * micro, width), np.float32), np.zeros(R * GA * micro, np.float32)
    trainer.step(x, y)  # builds the program
    torch.manual_seed(5)
    _, out = trainer.step(x, y)
    torch.manual_seed(5)
    want = _BERNOULLI(torch.empty(R * GA * micro, width), 1 - p) / (1 - p)
    np.testing.assert_array_equal(np.asarray(out), want.numpy())


class _DrawsBySize(torch.nn.Module):
    """A random factory given a size (as stochastic depth draws its mask): ``torch.rand``."""

    def forward(self, x):
        return x + torch.rand(x.shape, dtype=x.dtype, device=x.device)


def test_a_random_factory_draws_every_replica_at_once_like_the_reference():
    x = np.zeros((2 * 2, N // 2), np.float32)  # two samples per replica
    out = {}
    for executor in ("fast", "reference"):
        torch.manual_seed(0)
        program = popxl.compile(_DrawsBySize(), replication_factor=2, executor=executor)
        out[executor] = np.asarray(program(x)).reshape(2, -1).astype(np.float64)
        if executor == "fast":  # Note [random ops on stacked rows]: one draw, no vmap
            assert program.session._executor.fns["normal"].explicit
    fast, ref = out["fast"], out["reference"]
    assert not np.array_equal(fast[0], fast[1])
    assert abs(np.corrcoef(fast[0], fast[1])[0, 1]) < 6 / math.sqrt(fast.shape[1])
    for r in range(2):
        d = _ks_statistic(fast[r], ref[r])
        assert d < _ks_critical(fast[r].size, ref[r].size), (r, d)
