"""4-bit group quantisation: packing layout by hand, round-trip error bound, the decompress op
against numpy, and LinearGQ against torch on the dequantised weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl.addons.layers.linear_gq import LinearGQ
from torch_popxl.addons.ops.group_quantize_decompress import (
    group_quantize_compress_numpy,
    group_quantize_decompress,
    group_quantize_decompress_numpy,
)


def test_packing_puts_the_first_code_in_the_high_nibble():
    # one row, one group of 4 values 0, 1/15, 2/15, ... -> codes 0, 1, 2, 3 -> 0x0123
    t = (np.array([[0, 1, 2, 3, 15, 15, 15, 15]]) / 15).astype(np.float16)
    packed, scale, bias = group_quantize_compress_numpy(t, 8)
    assert packed.dtype == np.uint16 and packed.shape == (1, 1, 2)
    assert packed[0, 0].tolist() == [0x0123, 0xFFFF]
    np.testing.assert_allclose(scale, [[[1 / 15]]], rtol=1e-3)
    np.testing.assert_array_equal(bias, [[[0]]])


def test_round_trip_error_is_at_most_half_a_step():
    t = np.random.default_rng(0).normal(size=(6, 32)).astype(np.float16)
    packed, scale, bias = group_quantize_compress_numpy(t, 16)
    back = group_quantize_decompress_numpy(packed, scale, bias)
    assert back.shape == t.shape and back.dtype == np.float16
    step = np.repeat(scale[..., 0], 16, axis=1)
    assert np.all(np.abs(back.astype(np.float32) - t) <= step * 0.5 + 2e-3)
    with pytest.raises(ValueError, match="group_size=6"):
        group_quantize_compress_numpy(t, 6)


def test_decompress_op_matches_numpy():
    t = np.random.default_rng(1).normal(size=(4, 16)).astype(np.float16)
    packed, scale, bias = group_quantize_compress_numpy(t, 8)
    ir = popxl.Ir()
    with ir.main_graph:
        w = group_quantize_decompress(popxl.variable(packed, popxl.uint16), popxl.variable(scale[..., 0], popxl.float16),
                                      popxl.variable(bias, popxl.float16))  # fmt: skip
        assert w.dtype == popxl.float16 and w.shape == (4, 16)
        out = addons.host_store(w)
        with pytest.raises(ValueError, match=r"group_bias must have shape \(4, 2\)"):
            group_quantize_decompress(popxl.variable(packed, popxl.uint16), popxl.variable(scale, popxl.float16),
                                      popxl.variable(np.zeros((4, 3, 1), np.float16), popxl.float16))  # fmt: skip
    with popxl.Session(ir, "ipu_model") as session:
        got = session.run()[out]
    np.testing.assert_array_equal(got, group_quantize_decompress_numpy(packed, scale, bias))


def test_linear_gq_matches_torch_on_the_dequantised_weight():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 16)
    x = np.random.default_rng(2).normal(size=(3, 8)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        xv = popxl.variable(x, popxl.float32)
        facts, fwd = LinearGQ(16, group_size=8).create_graph(xv.spec)
        bwd = addons.autodiff(fwd, grads_required=[fwd.graph.inputs[0]])
        variables = facts.init()
        info = fwd.bind(variables).call_with_info(xv)
        (dx,) = bwd.call(
            popxl.constant(np.ones((3, 16), np.float32)), args=bwd.grad_graph_info.inputs_dict(info)
        )
        outs = [addons.host_store(t) for t in (info.outputs[0], dx)]
    weights = LinearGQ.torch_mapping(variables, lin, group_size=8)
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variables_data(weights)
        y, got_dx = (session.run()[o] for o in outs)
    w = group_quantize_decompress_numpy(*(weights[variables[k]] for k in (
        "weight_compressed", "weight_decompression_scale", "weight_decompression_bias"))).astype(np.float32)  # fmt: skip
    assert np.abs(w - lin.weight.detach().numpy().T).max() < 0.05  # the quantisation is close
    tx = torch.tensor(x, requires_grad=True)
    ty = tx @ torch.tensor(w) + lin.bias
    ty.sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_dx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 4"):
        LinearGQ(16, group_size=6)


# ---- dim: which axis the groups run along (popxl-addons 3.4's group_quantize_decompress.py and
# layers/linear_gq.py: compression moves dim last; decompression moves the last axis to dim) ----


def _dequantise_by_hand(t: np.ndarray, group_size: int, axis: int) -> np.ndarray:
    """Groups of ``group_size`` consecutive values along ``axis``: code = round((x - min) / s)
    with s = (max - min) / 15, back as code * s + min, all in float16 as upstream's numpy."""
    moved = np.moveaxis(t.astype(np.float16), axis, -1)
    g = moved.reshape(*moved.shape[:-1], -1, group_size)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    s = (hi - lo) / np.float16(15)
    q = np.round((g - lo) / s).astype(np.float16) * s + lo
    return np.moveaxis(q.reshape(moved.shape), -1, axis)


@pytest.mark.parametrize("shape, dim", [((32, 6), 0), ((6, 32), -1), ((6, 32), 1), ((3, 16, 5), 1)])
def test_compress_along_dim_round_trips_to_the_grouped_quantisation(shape, dim):
    t = np.random.default_rng(5).normal(size=shape).astype(np.float16)
    packed, scale, bias = group_quantize_compress_numpy(t, 8, dim=dim)
    axis = dim % t.ndim
    others = tuple(n for i, n in enumerate(shape) if i != axis)
    assert packed.shape == (*others, shape[axis] // 8, 2) and scale.shape == (
        *others,
        shape[axis] // 8,
        1,
    )
    back = group_quantize_decompress_numpy(packed, scale, bias, dim)
    assert back.shape == t.shape
    np.testing.assert_array_equal(back, _dequantise_by_hand(t, 8, axis))
    with pytest.raises(ValueError, match=r"dim must be an axis .*got 3"):
        group_quantize_compress_numpy(t, 8, dim=3)


def test_decompress_op_moves_the_decompressed_axis_to_dim():
    t = np.random.default_rng(6).normal(size=(16, 4)).astype(np.float16)  # grouped along axis 0
    packed, scale, bias = group_quantize_compress_numpy(t, 8, dim=0)  # (4, 2, 2)
    ir = popxl.Ir()
    with ir.main_graph:
        w = group_quantize_decompress(popxl.variable(packed, popxl.uint16), popxl.variable(scale, popxl.float16),
                                      popxl.variable(bias, popxl.float16), dim=0)  # fmt: skip
        assert w.shape == (16, 4)
        out = addons.host_store(w)
    with popxl.Session(ir, "ipu_model") as session:
        got = session.run()[out]
    np.testing.assert_array_equal(got, group_quantize_decompress_numpy(packed, scale, bias, 0))


def test_linear_gq_grouped_along_the_inputs_matches_the_dequantised_weight():
    torch.manual_seed(1)
    lin = torch.nn.Linear(16, 4)  # W (in=16, out=4): dim=0 groups 8 inputs at a time
    x = np.random.default_rng(7).normal(size=(3, 16)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        xv = popxl.variable(x, popxl.float32)
        facts, fwd = LinearGQ(4, group_size=8, dim=0).create_graph(xv.spec)
        variables = facts.init()
        (y,) = fwd.bind(variables).call(xv)
        out = addons.host_store(y)
    assert variables.weight_compressed.shape == (4, 2, 2)
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variables_data(LinearGQ.torch_mapping(variables, lin, group_size=8, dim=0))
        got = session.run()[out]
    w = _dequantise_by_hand(lin.weight.detach().numpy().T.astype(np.float16), 8, 0)
    np.testing.assert_allclose(got, x @ w + lin.bias.detach().numpy(), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="dim must be -1, 0 or 1"):
        LinearGQ(4, group_size=8, dim=2)
