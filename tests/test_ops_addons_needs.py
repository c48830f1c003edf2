"""The popxl.ops names popxl-addons programs use (ops/addons_needs.py): float8 power-of-two
casts and scaled matmul, swish_, shaped_dropout and scatter_reduce, against numpy / torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops, popart


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


@pytest.mark.parametrize("fp8", [popxl.float8_143, popxl.float8_152])
def test_device_float8_cast_overflows_to_nan_like_the_host_conversion(fp8):
    # The device cast rounds as popxl's host conversion does (nan_on_overflow by default):
    # upstream's tests compare the two bit for bit. 448 / 57344 are the largest finite values
    # of torch's e4m3fn / e5m2 (Note [float8 encoding]); 1e6 overflows both.
    top = 448.0 if fp8 is popxl.float8_143 else 57344.0
    x = np.array([1.5, -3.0, top, -top, 1e6, -1e6, 2.0**-3], np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(x)
        new = ops.pow2scale_cast_to_fp8(t, popxl.constant(np.int32(2)), fp8)
        old = ops.pow2scale_then_cast(t, popxl.constant(np.int32(0)), fp8)
        back = ops.pow2scale_cast_from_fp8(new, popxl.constant(np.int32(-2)), popxl.float32)
    got_new, got_old, got_back = _run(ir, [new, old, back])
    host_new = popxl.fp8_utils.host_pow2scale_cast_to_fp8(x, fp8, 2)
    host_old = popxl.utils.host_pow2scale_then_cast(x, fp8, 0)
    np.testing.assert_array_equal(got_new, host_new)
    np.testing.assert_array_equal(got_old, host_old)
    # times 4: 1.5, -3 and 2**-3 stay finite; +-top and +-1e6 overflow to NaN
    want_back = np.array([1.5, -3.0, np.nan, np.nan, np.nan, np.nan, 2.0**-3], np.float32)
    np.testing.assert_array_equal(got_back, want_back)
    # unscaled, +-top stays finite
    assert np.isnan(popxl.utils.host_cast_then_pow2scale(got_old, popxl.float32, 0)).tolist() == [
        False, False, False, False, True, True, False
    ]  # fmt: skip


def test_later_cast_names_need_a_scalar_int32_scale():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.ones(3, np.float32))
        with pytest.raises(TypeError, match="must be of type popxl.int32"):
            ops.pow2scale_cast_to_fp8(t, popxl.constant(np.int8(1)), popxl.float8_143)
        with pytest.raises(ValueError, match="must be a scalar tensor"):
            ops.pow2scale_cast_to_fp8(t, popxl.constant(np.zeros(2, np.int32)), popxl.float8_143)
        f8 = ops.pow2scale_cast_to_fp8(t, popxl.constant(np.int32(0)), popxl.float8_152)
        with pytest.raises(TypeError, match="float16 or float32"):
            ops.pow2scale_cast_from_fp8(f8, popxl.constant(np.int32(0)), popxl.int32)


def _fp8_values(rng, shape, fp8):
    """Random values exact in ``fp8`` (so float8 operands lose nothing)."""
    x = rng.uniform(-2, 2, shape).astype(np.float32)
    f8 = popxl.utils.host_pow2scale_then_cast(x, fp8, 0)
    return f8, popxl.utils.host_cast_then_pow2scale(f8, popxl.float32, 0)


@pytest.mark.parametrize("fp8", [popxl.float8_143, popxl.float8_152])
def test_scaled_convolutions_are_the_float32_convolutions_scaled_in_float16(fp8):
    rng = np.random.default_rng(3)
    x8, x = _fp8_values(rng, (2, 4, 6, 5), fp8)
    w8, w = _fp8_values(rng, (6, 2, 3, 3), fp8)  # conv: (C_out, C_in / groups, k, k)
    v8, v = _fp8_values(rng, (4, 3, 2, 2), fp8)  # transpose: (C_in, C_out / groups, k, k)
    ir = popxl.Ir()
    with ir.main_graph:
        xt = popxl.variable(x8, fp8)
        scale = popxl.constant(np.int32(-2))
        c = ops.conv_pow2scaled(xt, popxl.variable(w8, fp8), scale, stride=(2, 1),
                                padding=(1, 0, 0, 1), groups=2)  # fmt: skip
        ct = ops.conv_transpose_pow2scaled(xt, popxl.variable(v8, fp8), scale, stride=(2, 2),
                                           groups=2, output_padding=(1, 0))  # fmt: skip
        with pytest.raises(TypeError, match="Scaled conv operands must be of dtype"):
            ops.conv_pow2scaled(popxl.variable(x), popxl.variable(w8, fp8), scale)
        with pytest.raises(ValueError, match="must be a scalar tensor"):
            ops.conv_transpose_pow2scaled(
                xt, popxl.variable(v8, fp8), popxl.constant(np.zeros(2, np.int32))
            )
        with pytest.raises(TypeError, match="must be of type popxl.int32"):
            ops.conv_pow2scaled(xt, popxl.variable(w8, fp8), popxl.constant(np.int8(1)))
    assert c.dtype == ct.dtype == popxl.float16
    got_c, got_ct = _run(ir, [c, ct])
    tx = torch.from_numpy(x)
    want_c = torch.nn.functional.conv2d(torch.nn.functional.pad(tx, (0, 1, 1, 0)),
                                        torch.from_numpy(w), stride=(2, 1), groups=2)  # fmt: skip
    want_ct = torch.nn.functional.conv_transpose2d(tx, torch.from_numpy(v), stride=2, groups=2,
                                                   output_padding=(1, 0))  # fmt: skip
    np.testing.assert_array_equal(got_c, (want_c / 4).half().numpy())
    np.testing.assert_array_equal(got_ct, (want_ct / 4).half().numpy())


@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_a_log2_scale_out_of_range_stops_the_run_unless_the_option_is_off(executor):
    # Upstream checks a float8 op's run-time scale against [-32, 32) and raises Poplar's
    # application_runtime_error; throwIfLog2ScaleTensorNotInRange = False runs without the
    # check (Note [log2 scale range check]). Two replicas: replica 1's scale is out of range.
    x = np.array([1.5, -2.0, 0.25], np.float32)
    for scales, bad in (([0, 40], [40]), ([-32, 31], None), ([-33, 3], [-33])):
        ir = popxl.Ir(replication=2)
        with ir.main_graph:
            per_replica = ir.replica_grouping(group_size=1)
            s = popxl.variable(np.array(scales, np.int32), popxl.int32,
                               replica_grouping=per_replica)  # fmt: skip
            f8 = ops.pow2scale_cast_to_fp8(popxl.variable(x), s, popxl.float8_143)
            y = ops.pow2scale_cast_from_fp8(f8, popxl.constant(np.int32(0)), popxl.float32)
            d = popxl.d2h_stream(y.shape, y.dtype)
            ops.host_store(d, y)
        with popxl.Session(ir, "ipu_model", executor=executor) as session:
            if bad is None:
                got = session.run()[d]
            else:
                with pytest.raises(popart.poplar_application_runtime_error) as e:
                    session.run()
                assert "not in the range [-32, 32)" in str(e.value)
                assert str(bad) in str(e.value)
                assert "throwIfLog2ScaleTensorNotInRange" in str(e.value)
        ir._pb_ir.getSessionOptions().throwIfLog2ScaleTensorNotInRange = False
        with popxl.Session(ir, "ipu_model", executor=executor) as session:
            unchecked = session.run()[d]
        if bad is None:
            np.testing.assert_array_equal(unchecked, got)
        # Each replica's value is x * 2**scale, exact in float8_143 where it is in the format's
        # range here, NaN above its largest value (448) and 0 far below its smallest (2**-9).
        for r, scale in enumerate(scales):
            v = x.astype(np.float64) * 2.0**scale
            want = np.where(np.abs(v) > 448, np.nan, np.where(np.abs(v) < 2.0**-11, 0.0, v))
            np.testing.assert_array_equal(unchecked[r], want.astype(np.float32))
