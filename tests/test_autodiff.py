"""autodiff (gradients from torch.autograd) and call/repeat semantics, checked by value."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.errors import PopXLError
from torch_popxl.transforms import ExpectedConnectionType, autodiff

EXECUTORS = ["fast", "reference"]


def _run(ir, inputs=None, executor="fast"):
    session = popxl.Session(ir, "ipu_model", executor=executor)
    with session:
        return session.run(inputs or {}), session


def _grad_program(fn, arrays, seed, executor):
    """Build fwd graph from ``fn``, autodiff it, return (outputs, grads w.r.t. every input)."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        consts = [popxl.variable(a, name=f"in{i}") for i, a in enumerate(arrays)]
        fwd = ir.create_graph(fn, *[c.spec for c in consts])
        info = ops.call_with_info(fwd, *consts)
        y = info.outputs[0]
        bwd = autodiff(fwd)
        seed_t = popxl.constant(seed, name="seed")
        grads = ops.call(bwd.graph, seed_t, inputs_dict=bwd.inputs_dict(info))
        streams = []
        for t in (y, *grads):
            s = popxl.d2h_stream(t.shape, t.dtype)
            ops.host_store(s, t)
            streams.append(s)
    out, _ = _run(ir, executor=executor)
    return [out[s] for s in streams], bwd


def _torch_grads(fn_torch, arrays, seed):
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]
    y = fn_torch(*xs)
    y.backward(torch.tensor(seed))
    return y.detach().numpy(), [x.grad.numpy() for x in xs]


def _mlp(x, w, b):
    return torch.nn.functional.gelu(x @ w + b)


def _norm_softmax(x, w, b):
    h = torch.nn.functional.layer_norm(x, (x.shape[-1],)) * w + b
    return torch.softmax(h, dim=-1) * torch.tanh(h)


def _reduce_broadcast(x, w, b):
    return (x.exp() * w).sum(dim=0, keepdim=True) - b.reshape(1, -1) ** 2


CASES = {
    "matmul_gelu_broadcast_bias": (_mlp, [(5, 4), (4, 3), (3,)], (5, 3)),
    "layernorm_softmax_tanh": (_norm_softmax, [(6, 8), (8,), (8,)], (6, 8)),
    "exp_sum_keepdim_pow": (_reduce_broadcast, [(3, 4), (1, 4), (4,)], (1, 4)),
}


def assert_grads_match_torch(fn, fn_torch, shapes, out_shape, executor, rng_seed) -> None:
    """``autodiff`` of the graph ``fn`` builds gives torch.autograd's gradients of
    ``fn_torch`` (value and every input's gradient), on random inputs and output seed."""
    rng = np.random.default_rng(rng_seed)
    arrays = [rng.normal(size=s).astype(np.float32) for s in shapes]
    seed = rng.normal(size=out_shape).astype(np.float32)
    got, _ = _grad_program(fn, arrays, seed, executor)
    want_y, want_grads = _torch_grads(fn_torch, arrays, seed)
    np.testing.assert_allclose(got[0], want_y, rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1:], want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_autodiff_grads_match_torch_autograd(case, executor):
    fn, shapes, out_shape = CASES[case]
    assert_grads_match_torch(fn, fn, shapes, out_shape, executor, len(case))


def test_grad_graph_info_contract():
    """FwdGrad seeds first, then Fwd activations; stitched activations become fwd outputs."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones((2, 3), np.float32), name="x")
        w = popxl.variable(np.ones((3, 4), np.float32), name="w")

        def fwd_fn(x, w):
            return ops.gelu(x @ w)

        fwd = ir.create_graph(fwd_fn, x, w)
        info = ops.call_with_info(fwd, x, w)
        assert len(info.outputs) == 1
        bwd = autodiff(fwd)
        types = [e.connection_type for e in bwd.expected_inputs]
        assert types[0] is ExpectedConnectionType.FwdGrad
        assert all(t is ExpectedConnectionType.Fwd for t in types[1:])
        fwd_ids = [e.fwd_tensor.id for e in bwd.expected_inputs[1:]]
        assert fwd_ids == sorted(fwd_ids)
        # gelu's input (x @ w) is an intermediate: it is stitched as a new forward output and
        # the existing call site gains the matching output.
        assert len(fwd.outputs) > 1 and len(info.outputs) == len(fwd.outputs)
        assert [e.fwd_tensor for e in bwd.expected_outputs] == list(fwd.inputs)
        assert bwd.graph.id == "test_grad_graph_info_contract.fwd_fn_grad_subgraph(1)"


def test_autodiff_rejects_modifying_ops():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32))

        def f(x):
            x += 1.0
            return x

        g = ir.create_graph(f, x)
    with pytest.raises(PopXLError, match="modifying op"):
        autodiff(g)


def test_autodiff_explicit_required_without_path_raises():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.ones(3, np.float32))

        def f(a, b):
            return a * 2.0

        g = ir.create_graph(f, a, a)
    with pytest.raises(PopXLError, match="Unable to provide required gradient"):
        autodiff(g, grads_required=[g.inputs[1]])
    info = autodiff(g)  # default: inputs without a path are silently omitted
    assert [e.fwd_tensor for e in info.expected_outputs] == [g.inputs[0]]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_call_is_pass_by_value_unless_marked_modified(executor):
    """Spec §11.9: accumulate_ inside the callee is invisible unless the input is modified."""
    results = []
    for mark in (False, True):
        ir = popxl.Ir()
        with ir.main_graph, popxl.in_sequence():
            x = popxl.variable(1, popxl.int32, name="x")

            def inc(x):
                ops.var_updates.accumulate_(x, popxl.constant(1, popxl.int32))

            g = ir.create_graph(inc, x)
            info = ops.call_with_info(g, x)
            if mark:
                info.set_parent_input_modified(x)
            s = popxl.d2h_stream((), popxl.int32)
            ops.host_store(s, x)
        out, _ = _run(ir, executor=executor)
        results.append(int(out[s]))
    assert results == [1, 2]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_by_ref_input_changes_reach_the_caller(executor):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(np.array([1.0, 2.0], np.float32), name="x")

        def double(x: popxl.TensorByRef):
            ops.var_updates.accumulator_scale_(x, 2.0)

        g = ir.create_graph(double, x)
        ops.call(g, x)
        ops.call(g, x)
    _, session = _run(ir, executor=executor)
    np.testing.assert_array_equal(session.get_tensor_data(x), [4.0, 8.0])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_repeat_feeds_outputs_back_and_consumes_host_entries(executor):
    """Spec §11.13: nht=8, y[i] = x[i] @ W + b; plus a loop-carried counter."""
    ir = popxl.Ir()
    ir.num_host_transfers = 8
    rng = np.random.default_rng(0)
    x_data = rng.normal(size=(8, 2, 2)).astype(np.float32)
    with ir.main_graph, popxl.in_sequence():
        W = popxl.variable(np.ones((2, 2), np.float32), name="W")
        b = popxl.variable(np.ones(2, np.float32), name="b")
        x_stream = popxl.h2d_stream((2, 2), popxl.float32, "x")
        y_stream = popxl.d2h_stream((2, 2), popxl.float32, "y")

        def body(count, W, b):
            x = ops.host_load(x_stream)
            ops.host_store(y_stream, x @ W + b)
            return count + 1.0

        g = ir.create_graph(body, popxl.TensorSpec((), popxl.float32), W, b)
        zero = popxl.constant(0.0, popxl.float32)
        (count,) = ops.repeat(g, 8, zero, W, b)
        c_stream = popxl.d2h_stream((), popxl.float32, "count")
        ops.host_store(c_stream, count)
    out, _ = _run(ir, {x_stream: x_data}, executor)
    np.testing.assert_allclose(out[y_stream], x_data @ np.ones((2, 2)) + 1.0, rtol=1e-6)
    assert out[c_stream].shape == (8,)
    assert float(out[c_stream][0]) == 8.0


def test_call_input_mismatch_is_a_popxl_error():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.ones(3, np.float32))
        b = popxl.variable(np.ones(4, np.float32))
        g = ir.create_graph(lambda x: x * 2.0, a)
        with pytest.raises(PopXLError, match="does not match callee input"):
            ops.call(g, b)
        with pytest.raises(ValueError, match="Too many inputs"):
            ops.call(g, a, a)
        with pytest.raises(
            ValueError, match="^Not enough inputs have been provided for the called graph"
        ):
            ops.call_with_info(g)


def test_callsiteinfo_maps_between_parent_and_graph():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.ones(3, np.float32))

        def f(x):
            return x + 1.0, x * 2.0

        g = ir.create_graph(f, a)
        info = ops.call_with_info(g, a)
        assert info.parent_to_graph(a) is g.inputs[0]
        assert info.graph_to_parent(g.inputs[0]) is a
        assert info.graph_to_parent(g.outputs[1]) is info.outputs[1]
        assert info.parent_input(0) is a and info.parent_output(0) is info.outputs[0]
        assert info.called_graph is g
        with pytest.raises(ValueError):
            info.parent_to_graph(info.outputs[0])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_sgd_steps_match_torch_training(executor):
    """Several captured SGD steps (in-place var updates in sequence) equal eager torch SGD."""
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=(6, 5)).astype(np.float32) * 0.3
    b0 = np.zeros(5, np.float32)
    w1 = rng.normal(size=(5, 3)).astype(np.float32) * 0.3
    xs = rng.normal(size=(4, 8, 6)).astype(np.float32)
    labels = rng.integers(0, 3, size=(4, 8)).astype(np.int32)
    lr = 0.1

    ir = popxl.Ir()
    ir.num_host_transfers = 4
    with ir.main_graph, popxl.in_sequence():
        W0 = popxl.variable(w0, name="W0")
        B0 = popxl.variable(b0, name="B0")
        W1 = popxl.variable(w1, name="W1")
        xs_s = popxl.h2d_stream((8, 6), popxl.float32, "x")
        lb_s = popxl.h2d_stream((8,), popxl.int32, "labels")

        def net(x, w0, b0, w1):
            return torch.relu(x @ w0 + b0) @ w1

        fwd = ir.create_graph(net, popxl.TensorSpec((8, 6), popxl.float32), W0, B0, W1)
        bwd = autodiff(fwd, grads_provided=fwd.outputs[:1], grads_required=list(fwd.inputs[1:]))

        def step():
            x = ops.host_load(xs_s)
            lab = ops.host_load(lb_s)
            info = ops.call_with_info(fwd, x, W0, B0, W1)
            probs = ops.softmax(info.outputs[0], axis=1)
            _, dy = ops.nll_loss_with_softmax_grad(probs, lab)
            gw0, gb0, gw1 = ops.call(bwd.graph, dy, inputs_dict=bwd.inputs_dict(info))
            for v, gr in ((W0, gw0), (B0, gb0), (W1, gw1)):
                ops.scaled_add_(v, gr, b=-lr)

        for _ in range(4):
            step()
    _, session = _run(ir, {xs_s: xs, lb_s: labels}, executor)

    params = [torch.tensor(a, requires_grad=True) for a in (w0, b0, w1)]
    opt = torch.optim.SGD(params, lr=lr)
    for i in range(4):
        opt.zero_grad()
        logits = torch.relu(torch.tensor(xs[i]) @ params[0] + params[1]) @ params[2]
        torch.nn.functional.cross_entropy(logits, torch.tensor(labels[i]).long()).backward()
        opt.step()
    for v, p in zip((W0, B0, W1), params, strict=True):
        np.testing.assert_allclose(
            session.get_tensor_data(v), p.detach().numpy(), rtol=1e-4, atol=1e-5
        )
