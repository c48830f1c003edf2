"""addons.layers: forward values and gradients (input and every variable) against torch.nn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl.addons.layers import Conv2D, Embedding, GroupNorm, LayerNorm


def fwd_bwd(module, x_data, mapping, x_dtype=popxl.float32, grad_x=True):
    """Run ``module`` on ``x_data`` with weights from ``mapping(variables)``; seed = ones.

    Returns (output, {"x"|variable key: gradient}).
    """
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        x = popxl.variable(x_data, x_dtype, name="x")
        facts, fwd = module.create_graph(x.spec)
        required = [fwd.graph.inputs[0], *fwd.args.tensors] if grad_x else list(fwd.args.tensors)
        bwd = addons.autodiff(fwd, grads_required=required)
        variables = facts.init()
        info = fwd.bind(variables).call_with_info(x)
        y = info.outputs[0]
        seed = popxl.constant(np.ones(y.shape, np.float32))
        grads = bwd.call(seed, args=bwd.grad_graph_info.inputs_dict(info))
        streams = [addons.host_store(t) for t in (y, *grads)]
    names = (["x"] if grad_x else []) + [
        next(k for k, v in fwd.args.to_dict().items() if v is t) for t in fwd.args.tensors
    ]
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variables_data(mapping(variables))
        out = session.run()
    return out[streams[0]], {n: out[s] for n, s in zip(names, streams[1:], strict=True)}


def torch_grads(layer, x, inputs_need_grad=True):
    tx = torch.tensor(x, requires_grad=inputs_need_grad)
    y = layer(tx)
    y.sum().backward()
    return y.detach().numpy(), tx.grad, dict(layer.named_parameters())


def test_layer_norm_matches_torch_forward_and_gradients():
    torch.manual_seed(0)
    x = np.random.default_rng(0).normal(size=(6, 8)).astype(np.float32)
    ln = torch.nn.LayerNorm(8)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    y, grads = fwd_bwd(LayerNorm(), x, lambda v: LayerNorm.torch_mapping(v, ln))
    ty, tdx, params = torch_grads(ln, x)
    np.testing.assert_allclose(y, ty, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads["x"], tdx.numpy(), rtol=1e-4, atol=1e-5)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(grads[k], params[k].grad.numpy(), rtol=1e-4, atol=1e-5)


def test_layer_norm_rejects_inputs_that_are_not_two_dimensional():
    ir = popxl.Ir()
    with ir.main_graph, pytest.raises(ValueError, match=r"shape \(N, C\), got \(2, 3, 4\)"):
        LayerNorm().create_graph(popxl.TensorSpec((2, 3, 4), popxl.float32))


def test_layer_norm_default_variables_are_ones_and_zeros():
    ir = popxl.Ir()
    with ir.main_graph:
        facts, _ = LayerNorm().create_graph(popxl.TensorSpec((2, 5), popxl.float32))
        v = facts.init()
    with popxl.Session(ir, "ipu_model") as session:
        data = session.get_tensors_data([v.weight, v.bias])
    np.testing.assert_array_equal(data[v.weight], np.ones(5, np.float32))
    np.testing.assert_array_equal(data[v.bias], np.zeros(5, np.float32))


def test_group_norm_matches_torch_forward_and_gradients():
    torch.manual_seed(1)
    x = np.random.default_rng(1).normal(size=(2, 6, 3, 4)).astype(np.float32)
    gn = torch.nn.GroupNorm(3, 6)
    with torch.no_grad():
        gn.weight.normal_()
        gn.bias.normal_()
    y, grads = fwd_bwd(GroupNorm(3), x, lambda v: GroupNorm.torch_mapping(v, gn))
    ty, tdx, params = torch_grads(gn, x)
    np.testing.assert_allclose(y, ty, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads["x"], tdx.numpy(), rtol=1e-4, atol=1e-5)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(grads[k], params[k].grad.numpy(), rtol=1e-4, atol=1e-4)
    ir = popxl.Ir()
    with ir.main_graph, pytest.raises(ValueError, match="divisible by num_groups=4"):
        GroupNorm(4).create_graph(popxl.TensorSpec((2, 6, 3), popxl.float32))


@pytest.mark.parametrize(
    "kwargs, torch_kwargs",
    [
        ({}, {}),
        ({"strides": (2, 1), "paddings": (1, 1, 1, 1)}, {"stride": (2, 1), "padding": 1}),
        (
            {"dilations": (2, 2), "groups": 2, "bias": False},
            {"dilation": 2, "groups": 2, "bias": False},
        ),
        ({"paddings": "same_upper"}, {"padding": "same"}),
    ],
)
def test_conv2d_matches_torch_forward_and_gradients(kwargs, torch_kwargs):
    torch.manual_seed(2)
    x = np.random.default_rng(2).normal(size=(2, 4, 7, 6)).astype(np.float32)
    conv = torch.nn.Conv2d(4, 6, 3, **torch_kwargs)
    y, grads = fwd_bwd(Conv2D(6, 3, **kwargs), x, lambda v: Conv2D.torch_mapping(v, conv))
    ty, tdx, params = torch_grads(conv, x)
    np.testing.assert_allclose(y, ty, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["x"], tdx.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads["weight"], params["weight"].grad.numpy(), rtol=1e-4, atol=1e-4)
    if conv.bias is not None:
        np.testing.assert_allclose(
            grads["bias"].reshape(-1), params["bias"].grad.numpy(), rtol=1e-4, atol=1e-4
        )
    else:
        assert "bias" not in grads


def test_conv2d_same_lower_pads_the_extra_element_first():
    # 1x1 input row, kernel 2, stride 1: total padding 1 goes before ("lower") or after ("upper").
    x = np.arange(1, 4, dtype=np.float32).reshape(1, 1, 1, 3)
    w = torch.nn.Conv2d(1, 1, (1, 2), bias=False)
    with torch.no_grad():
        w.weight.copy_(torch.tensor([[[[1.0, 10.0]]]]))
    lower, _ = fwd_bwd(Conv2D(1, (1, 2), paddings="same_lower", bias=False), x,
                       lambda v: Conv2D.torch_mapping(v, w))  # fmt: skip
    upper, _ = fwd_bwd(Conv2D(1, (1, 2), paddings="same_upper", bias=False), x,
                       lambda v: Conv2D.torch_mapping(v, w))  # fmt: skip
    np.testing.assert_allclose(lower.reshape(-1), [10.0, 21.0, 32.0])  # [0,1,2,3] windows
    np.testing.assert_allclose(upper.reshape(-1), [21.0, 32.0, 3.0])  # [1,2,3,0] windows


def test_embedding_matches_torch_forward_and_weight_gradient():
    torch.manual_seed(3)
    idx = np.array([[1, 5, 5], [0, 9, 2]], np.int32)
    emb = torch.nn.Embedding(10, 4)
    layer = Embedding(popxl.float32, 10, 4)
    assert layer.vocab_shard_size == 16  # rounded up to a multiple of 16
    y, grads = fwd_bwd(
        layer, idx, lambda v: Embedding.torch_mapping(v, emb), popxl.int32, grad_x=False
    )
    ty = emb(torch.tensor(idx, dtype=torch.int64))
    ty.sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(grads["weight"][:10], emb.weight.grad.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(grads["weight"][10:], 0)


def test_embedding_shard_sizes_and_offsets():
    assert Embedding.get_vocab_shard_size(50257, 4) == 12576
    np.testing.assert_array_equal(Embedding.get_offsets(100, 4), [0, 32, 64, 96])
    np.testing.assert_array_equal(Embedding.get_offsets(10, 1), [0])


def test_sharded_embedding_sums_to_the_full_lookup_across_groups():
    """Vocab sharded over 2 groups (4 replicas): each replica looks up its group's shard with
    indices shifted by its offset; out-of-shard rows are zero, and the two groups' outputs add up
    to the unsharded lookup."""
    rng = np.random.default_rng(4)
    vocab, hidden, R = 40, 3, 4
    table = rng.normal(size=(vocab, hidden)).astype(np.float32)
    idx = np.array([0, 17, 31, 39, 5], np.int32)
    ir = popxl.Ir(replication=R)
    group = ir.replica_grouping(stride=1, group_size=2)  # groups {0,1}, {2,3}: two vocab shards
    layer = Embedding(popxl.float32, vocab, hidden, replica_grouping=group)
    size = layer.vocab_shard_size
    assert size == 32 and list(layer.offsets) == [0, 32]
    shards = np.zeros((2, size, hidden), np.float32)
    shards[0] = table[:32]
    shards[1, : vocab - 32] = table[32:]
    shifted = np.stack([idx - layer.offsets[r // 2] for r in range(R)]).astype(np.int32)
    with ir.main_graph:
        x_stream = popxl.h2d_stream((5,), popxl.int32, "idx")
        facts, graph = layer.create_graph(x_stream.spec)
        variables = facts.init()
        y = graph.bind(variables).call(popxl.ops.host_load(x_stream))[0]
        out_stream = addons.host_store(y)
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variable_data(variables.weight, shards)
        out = session.run({x_stream: shifted})[out_stream]
    for r in range(R):
        expected = np.zeros((5, hidden), np.float32)
        for i, j in enumerate(shifted[r]):
            if 0 <= j < size:
                expected[i] = shards[r // 2, j]
        np.testing.assert_array_equal(out[r], expected)
    np.testing.assert_array_equal(out[0] + out[2], table[idx])
