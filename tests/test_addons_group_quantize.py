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
