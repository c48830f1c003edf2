"""Float8 in popxl-addons: the MSE scale search (``popxl.fp8_utils.host_fp8_mse_scale`` and the
graph op ``addons.ops.fp8_mse_scale``), SDK 3.3's ``ops.pow2scale_cast_to_fp8`` /
``pow2scale_cast_from_fp8`` and the ``LinearFP8`` layer, against a plain-Python loop over the
biases, hand values, numpy emulation of the float8 casts and ``torch.nn.Linear``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl import ops
from torch_popxl.addons.layers.linear_fp8 import LinearFP8
from torch_popxl.addons.ops.fp8_mse_scale import fp8_mse_scale
from torch_popxl.addons.testing_utils import TensorInput, run_module
from torch_popxl.fp8_utils import (
    host_fp8_mse_scale,
    host_pow2scale_cast_from_fp8,
    host_pow2scale_cast_to_fp8,
)

# Exponent window (min, max) and mantissa bits of Graphcore's float8 formats.
FORMATS = {"143": (popxl.float8_143, -10, 7, 3), "152": (popxl.float8_152, -17, 15, 2)}


def mse_scale_by_loops(values: np.ndarray, fmt: str) -> tuple[float, int]:
    """The published search, one bias at a time: histogram of binary exponents over float32's
    range, the cost of each of the 63 biases summed term by term, the middle of equal lowest
    costs, negated."""
    _, lo, hi, mantissa = FORMATS[fmt]
    span = hi - lo + 1
    q = 2.0 ** (-2.0 * ((23 if values.dtype == np.float32 else 10) - mantissa))
    edges = [2.0**p for p in range(-126, 126)]
    counts = [0.0] * (len(edges) + 1)
    for v in np.abs(values.reshape(-1).astype(np.float64)):
        if v < edges[0]:
            counts[0] += 1
        elif v > edges[-1]:
            counts[-1] += 1
        else:
            counts[math.frexp(v)[1] + 126] += 1
    total = sum(counts)
    freq = [c / total for c in counts]
    costs: dict[float, list[int]] = {}
    for k in range(63):
        start, cost = lo - 31 + 126 + k, 0.0
        for i in range(len(edges)):
            if i == 0 and start > 0:
                cost += (edges[0] / 2) ** 2
            if i < start:
                cost += edges[i] ** 2 * freq[i + 1]
            elif i < start + span:
                cost += edges[i] ** 2 * freq[i + 1] * q
            else:
                cost += (edges[k + span - 1] - edges[i]) ** 2 * freq[i + 1]
        costs.setdefault(cost, []).append(k - 31)
    lowest = min(costs)
    ties = sorted(costs[lowest])
    return lowest, -ties[len(ties) // 2]


def _samples():
    rng = np.random.default_rng(7)
    for n in range(12):
        dtype = np.float32 if n % 2 else np.float16
        magnitude = 10.0 ** rng.uniform(-6, 4)
        yield (rng.standard_normal(int(rng.integers(1, 200))) * magnitude).astype(dtype)


@pytest.mark.parametrize("fmt", ["143", "152"])
def test_host_fp8_mse_scale_equals_the_search_written_as_loops(fmt):
    for values in _samples():
        cost, scale = host_fp8_mse_scale(values, FORMATS[fmt][0])
        assert (cost, scale) == mse_scale_by_loops(values, fmt)


@pytest.mark.parametrize("fmt, scale", [("143", -7), ("152", -6)])
def test_fp8_mse_scale_of_one_binade_is_the_middle_of_the_windows_holding_it(fmt, scale):
    # Every value in [32, 64) has binary exponent 6 (x = m * 2**6, m in [0.5, 1)). Each window of
    # the format's exponents that holds it costs the same (18 windows for 143, 33 for 152); the
    # middle one is bias 7 (143) or 6 (152), and the scale is its negation.
    values = np.random.default_rng(0).uniform(32, 64, 10).astype(np.float32)
    assert host_fp8_mse_scale(values, FORMATS[fmt][0])[1] == scale
    assert host_fp8_mse_scale(-values.astype(np.float16), FORMATS[fmt][0])[1] == scale


def test_fp8_mse_scale_in_a_graph_equals_the_host_search_on_every_replica():
    samples = list(_samples())[:4]
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        outs = []
        for values in samples:
            src = popxl.variable(values)
            for fmt in ("143", "152"):
                scale = fp8_mse_scale(src, FORMATS[fmt][0])
                assert scale.dtype == popxl.int32 and scale.shape == ()
                outs.append((values, fmt, addons.host_store(scale)))
        with pytest.raises(RuntimeError, match="not currently supported"):
            fp8_mse_scale(popxl.variable(np.ones(3, np.int32)))
        with pytest.raises(TypeError, match="float8_143 or popxl.float8_152"):
            fp8_mse_scale(popxl.variable(np.ones(3, np.float32)), popxl.float16)
    with popxl.Session(ir, "ipu_hw") as session:
        got = session.run()
    for values, fmt, stream in outs:
        want = mse_scale_by_loops(values, fmt)[1]
        np.testing.assert_array_equal(got[stream], [want, want])


@pytest.mark.parametrize("fmt", ["143", "152"])
def test_pow2scale_cast_to_and_from_fp8_are_the_host_casts(fmt):
    dtype = FORMATS[fmt][0]
    x = np.random.default_rng(3).uniform(-3, 3, (4, 5)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(x)
        f8 = ops.pow2scale_cast_to_fp8(t, data_type=dtype, log2_scale=popxl.constant(np.int32(2)))
        back = ops.pow2scale_cast_from_fp8(
            f8, data_type=popxl.float32, log2_scale=popxl.constant(np.int32(-2))
        )
        unscaled = ops.pow2scale_cast_from_fp8(ops.pow2scale_cast_to_fp8(t, dtype))  # no scale
        streams = addons.host_store(back), addons.host_store(unscaled)
    assert unscaled.dtype == popxl.float16  # upstream's default result type
    with popxl.Session(ir, "ipu_hw") as session:
        out = session.run()
    want = host_pow2scale_cast_from_fp8(host_pow2scale_cast_to_fp8(x, dtype, 2), popxl.float32, -2)
    np.testing.assert_array_equal(out[streams[0]], want)
    want0 = host_pow2scale_cast_from_fp8(host_pow2scale_cast_to_fp8(x, dtype, 0), popxl.float16, 0)
    np.testing.assert_array_equal(out[streams[1]], want0)


def _fp8(x: np.ndarray, dtype, scale: int) -> np.ndarray:
    """float8 rounding of ``x * 2**scale`` as float32, scale removed."""
    q = host_pow2scale_cast_to_fp8(x.astype(np.float32), dtype, scale)
    return host_pow2scale_cast_from_fp8(q, popxl.float32, -scale)


def _amax_scale(x: np.ndarray, fp8_max: float) -> int:
    return int(np.clip(np.floor(np.log2(fp8_max / np.abs(x).max())), -31, 31))


@pytest.mark.parametrize("scale_metric", ["amax", "mse", "manual_scale"])
def test_linear_fp8_forward_is_close_to_torch_linear(scale_metric):
    # popxl-addons' own claim for the layer: within 0.1 of torch.nn.Linear in float16.
    torch.manual_seed(0)
    layer = torch.nn.Linear(10, 10)
    x = np.random.default_rng(0).random((2, 10)).astype(np.float16)
    want = layer(torch.tensor(x, dtype=torch.float32)).detach().numpy()
    mapping = lambda v: LinearFP8.torch_mapping(v, layer, popxl.float16)  # noqa: E731
    (got,) = run_module(LinearFP8(10, scale_metric=scale_metric), TensorInput(x), weights=mapping)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, want, atol=0.1)
    with pytest.raises(ValueError, match="amax, mse or manual_scale"):
        LinearFP8(10, scale_metric="no_scale")


def test_linear_fp8_gradients_are_the_float8_products_of_its_forward():
    # amax scales, float32 data: every step emulated with the host casts.
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (4, 6)).astype(np.float32)
    w = rng.normal(0, 0.3, (6, 3)).astype(np.float32)
    dy = rng.normal(0, 0.01, (4, 3)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        xt = popxl.variable(x)
        facts, graph = LinearFP8(3).create_graph(xt)
        grad = graph.autodiff()
        params = facts.init()
        call = graph.bind(params).call_with_info(xt)
        dx, dw, db = grad.call(popxl.constant(dy), args=grad.grad_graph_info.inputs_dict(call))
        streams = [addons.host_store(t) for t in (call.outputs[0], dx, dw, db)]
    with popxl.Session(ir, "ipu_hw") as session:
        session.write_variable_data(params.weight, w)
        y_out, dx_out, dw_out, db_out = (session.run()[s] for s in streams)

    s_w, s_x = _amax_scale(w, 240), _amax_scale(x, 240)
    s_dy = int(np.clip(_amax_scale(dy, 57344) - 3, -31, 31))
    w8, x8 = _fp8(w, popxl.float8_143, s_w), _fp8(x, popxl.float8_143, s_x)
    dy8 = _fp8(dy, popxl.float8_152, s_dy)
    # matmul_pow2scaled's products come back in float16; float32 inputs get a float32 output.
    np.testing.assert_allclose(y_out, (x8 @ w8).astype(np.float16), rtol=1e-3)
    np.testing.assert_allclose(dx_out, (dy8 @ w8.T).astype(np.float16), rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(dw_out, (x8.T @ dy8).astype(np.float16), rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(db_out, dy.sum(0), rtol=1e-6)
    # ... and all of it near the exact float32 layer.
    np.testing.assert_allclose(y_out, x @ w, atol=0.15)
    np.testing.assert_allclose(dw_out, x.T @ dy, atol=5e-3)
