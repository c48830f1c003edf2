"""The popxl.ops names popxl-addons programs use (ops/addons_needs.py): float8 power-of-two
casts and scaled matmul, swish_, shaped_dropout and scatter_reduce, against numpy / torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops


def _run(ir, tensors):
    with ir.main_graph:
        streams = []
        for t in tensors:
            s = popxl.d2h_stream(t.shape, t.dtype)
            ops.host_store(s, t)
            streams.append(s)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()
    return [out[s] for s in streams]


@pytest.mark.parametrize("fp8", [popxl.float8_143, popxl.float8_152])
@pytest.mark.parametrize("log2_scale", [-3, 0, 2])
def test_pow2scale_casts_round_trip_through_float8_like_torch(fp8, log2_scale):
    rng = np.random.default_rng(0)
    x = rng.uniform(-4, 4, (3, 5)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(x)
        scale = popxl.constant(np.int32(log2_scale))
        f8 = ops.pow2scale_then_cast(t, scale, fp8)
        back = ops.cast_then_pow2scale(f8, popxl.constant(np.int32(-log2_scale)), popxl.float32)
    assert f8.dtype == fp8 and back.dtype == popxl.float32
    (got,) = _run(ir, [back])
    want = (torch.tensor(x) * 2.0**log2_scale).to(fp8.as_torch()).to(
        torch.float32
    ) * 2.0**-log2_scale
    np.testing.assert_array_equal(got, want.numpy())
    # float8 keeps 3 (143) or 2 (152) mantissa bits: the round trip is within half an ulp.
    rel = 2.0 ** -(4 if fp8 is popxl.float8_143 else 3)
    np.testing.assert_allclose(got, x, rtol=rel)


def test_matmul_pow2scaled_is_the_scaled_product_in_float16():
    rng = np.random.default_rng(1)
    a = rng.integers(-4, 5, (2, 3)).astype(np.float32)  # exact in float8
    b = rng.integers(-4, 5, (3, 4)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        zero = popxl.constant(np.int32(0))
        fa = ops.pow2scale_then_cast(popxl.variable(a), zero, popxl.float8_143)
        fb = ops.pow2scale_then_cast(popxl.variable(b), zero, popxl.float8_152)
        y = ops.matmul_pow2scaled(fa, fb, popxl.constant(np.int32(-1)))
        with pytest.raises(TypeError, match="float8_143 or popxl.float8_152"):
            ops.matmul_pow2scaled(popxl.variable(a), fb, zero)
        with pytest.raises(TypeError, match="popxl.int32"):
            ops.matmul_pow2scaled(fa, fb, popxl.constant(np.float32(0)))
        with pytest.raises(ValueError, match="scalar"):
            ops.matmul_pow2scaled(fa, fb, popxl.constant(np.zeros(2, np.int32)))
        with pytest.raises(TypeError, match="float8_143 or float8_152"):
            ops.pow2scale_then_cast(fa, zero, popxl.float16)
    assert y.dtype == popxl.float16 and y.shape == (2, 4)
    (got,) = _run(ir, [y])
    np.testing.assert_array_equal(got, ((a @ b) / 2).astype(np.float16))


def test_swish_in_place_modifies_its_input():
    x = np.linspace(-3, 3, 7).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(x)
        t = v + 0.0
        out = ops.swish_(t)
        after = t * 1.0
    got_out, got_after = _run(ir, [out, after])
    want = torch.nn.functional.silu(torch.tensor(x)).numpy()
    np.testing.assert_allclose(got_out, want, rtol=1e-6)
    np.testing.assert_allclose(got_after, want, rtol=1e-6)


def test_shaped_dropout_drops_whole_features_and_rescales():
    x = np.ones((64, 8), np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        seed = popxl.variable(popxl.create_seeds(1), popxl.uint32)
        y = ops.shaped_dropout(popxl.variable(x), seed, [1, 8], 0.25)
        with pytest.raises(ValueError, match="must broadcast"):
            ops.shaped_dropout(popxl.variable(x), seed, [3, 8], 0.25)
        with pytest.raises(ValueError, match="ratio"):
            ops.shaped_dropout(popxl.variable(x), seed, [1, 8], 1.0)
    (got,) = _run(ir, [y])
    # The mask has shape [1, 8]: every row is the same, each column all kept or all dropped.
    assert (got == got[:1]).all()
    assert set(np.unique(got)) <= {0.0, np.float32(1 / 0.75)}


@pytest.mark.parametrize("reduction", ["sum", "max", "min", "none"])
def test_scatter_reduce_matches_a_numpy_loop(reduction):
    rng = np.random.default_rng(2)
    data = rng.normal(size=(6, 3)).astype(np.float32)
    idx = np.array([0, 2, 2, 4, 0, 2], np.int32)
    init = rng.normal(size=(5, 3)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        d, i = popxl.variable(data), popxl.variable(idx)
        plain = ops.scatter_reduce(d, i, reduction, axis_size=5)
        seeded = ops.scatter_reduce(d, i, reduction, initial_values=popxl.variable(init))
    got_plain, got_seeded = _run(ir, [plain, seeded])
    fn = {"sum": np.add, "max": np.maximum, "min": np.minimum, "none": lambda a, b: b}[reduction]
    want_plain, want_seeded = np.zeros((5, 3), np.float32), init.copy()
    seen = set()
    for r, j in enumerate(idx):
        want_plain[j] = data[r] if j not in seen else fn(want_plain[j], data[r])
        want_seeded[j] = data[r] if reduction == "none" else fn(want_seeded[j], data[r])
        seen.add(j)
    if reduction == "none":  # repeated indices: one of the writes wins; check the others
        ok = [j for j in range(5) if (idx == j).sum() <= 1]
        np.testing.assert_allclose(got_plain[ok], want_plain[ok])
        np.testing.assert_allclose(got_seeded[ok], want_seeded[ok])
    else:
        np.testing.assert_allclose(got_plain, want_plain, rtol=1e-6)
        np.testing.assert_allclose(got_seeded, want_seeded, rtol=1e-6)


def test_scatter_reduce_errors():
    ir = popxl.Ir()
    with ir.main_graph:
        d = popxl.variable(np.zeros((4, 2), np.float32))
        i = popxl.variable(np.zeros(4, np.int32))
        with pytest.raises(ValueError, match="One of initial_values and axis_size"):
            ops.scatter_reduce(d, i, "sum")
        with pytest.raises(ValueError, match="reduction must be one of"):
            ops.scatter_reduce(d, i, "mean", axis_size=3)
        with pytest.raises(ValueError, match="one index per slice"):
            ops.scatter_reduce(d, popxl.variable(np.zeros(3, np.int32)), "sum", axis_size=3)
