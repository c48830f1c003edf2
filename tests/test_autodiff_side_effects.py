"""autodiff of graphs holding side-effect ops (host_store, remote_store, print_tensor) and the
modifying-op rule of upstream's tests/popxl/transforms/autodiff_test.py, with gradients
compared to torch autograd."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.errors import PopXLError
from torch_popxl.transforms import autodiff

X = np.array([1.0, -2.0, 3.0], np.float32)


def test_autodiff_of_a_graph_with_stores_and_a_print_matches_torch_and_stores_once():
    ir = popxl.Ir()
    with ir.main_graph:
        side = popxl.d2h_stream((3,), popxl.float32, "side")
        rb = popxl.remote_buffer((3,), popxl.float32, 1)

    def f(x):
        y = x * x
        ops.host_store(side, y)  # no gradient; runs with the forward call only
        ops.remote_store(rb, 0, y)
        z = ops.print_tensor(y, "y", print_self=False)  # an identity for gradients
        return ops.sin(z) * 3.0

    g = ir.create_graph(f, popxl.TensorSpec((3,), popxl.float32))
    bwd = autodiff(g)
    assert not any(op.kind in ("host_store", "remote_store") for op in bwd.graph.ops)
    seed = np.array([0.5, 1.0, -1.0], np.float32)
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(X, name="x")
        info = ops.call_with_info(g, x)
        (dx,) = ops.call(bwd.graph, popxl.constant(seed), inputs_dict=bwd.inputs_dict(info))
        out = popxl.d2h_stream((3,), popxl.float32, "dx")
        ops.host_store(out, dx)
        stored = ops.remote_load(rb, 0)
        out_rb = popxl.d2h_stream((3,), popxl.float32, "rb")
        ops.host_store(out_rb, stored)
    with popxl.Session(ir, "ipu_model") as session:
        got = session.run()
    tx = torch.from_numpy(X).requires_grad_()
    (torch.sin(tx * tx) * 3.0).backward(torch.from_numpy(seed))
    np.testing.assert_allclose(got[out], tx.grad.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(got[side], X * X)  # one store: the forward call's
    np.testing.assert_array_equal(got[out_rb], X * X)


# Upstream's table (autodiff_test.py, test_modifying_ops): graph body -> raises. Message
# beginning: "The graph <id> contains a modifying op".
def _iadd(a, b):
    a += b
    return a


MODIFYING = [
    ("iadd", _iadd, True),
    ("gelu_", lambda a, b: ops.gelu_(a) + b, True),
    ("concat_", lambda a, b: ops.concat_([a, b], axis=0), False),
    ("accumulate_", lambda a, b: ops.var_updates.accumulate_(a, b, 0.1), True),
    ("host_store", None, False),  # a side effect, not a modification
]


@pytest.mark.parametrize(("name", "body", "raises"), MODIFYING, ids=[m[0] for m in MODIFYING])
def test_autodiff_rejects_exactly_upstreams_modifying_ops(name, body, raises):
    ir = popxl.Ir()
    with ir.main_graph:
        s = popxl.d2h_stream((1,), popxl.float32, "s")
    if body is None:

        def body(a, b):
            ops.host_store(s, a)
            return a * b

    spec = popxl.TensorSpec((1,), popxl.float32)
    g = ir.create_graph(body, spec, spec)
    if raises:
        with pytest.raises(
            PopXLError,
            match=rf"^The graph {g.id.replace('(', '.').replace(')', '.')} contains a modifying op",
        ):
            autodiff(g)
    else:
        info = autodiff(g)
        assert [e.fwd_tensor for e in info.expected_outputs] == list(g.inputs)
