"""PopXL core behaviour found different from upstream by the conformance sweep, each compared
with an independent reference (eager torch, numpy or hand-computed values)."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.transforms import autodiff

EXECUTORS = ("fast", "reference")
rng = np.random.default_rng(0)


def run(build, executor="fast", replication=1):
    """Build ``build() -> {name: tensor}`` in the main graph and return the host values."""
    ir = popxl.Ir(replication=replication)
    with ir.main_graph, popxl.in_sequence():
        outs = build()
        streams = {}
        for k, t in outs.items():
            s = popxl.d2h_stream(t.shape, t.dtype, k)
            ops.host_store(s, t)
            streams[k] = s
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        out = session.run()
    return {k: out[s] for k, s in streams.items()}


# ---- C12: matmul over every rank combination numpy allows ---------------------------------

MATMUL_SHAPES = [
    ((4,), (4, 3)),
    ((4,), (2, 4, 3)),
    ((4,), (2, 1, 4, 3)),
    ((3, 4), (4,)),
    ((2, 3, 4), (4,)),
    ((4,), (4,)),
    ((3, 4), (4, 5)),
    ((2, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 2)),
]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize(("ls", "rs"), MATMUL_SHAPES, ids=[f"{a}@{b}" for a, b in MATMUL_SHAPES])
def test_matmul_every_rank_combo_matches_torch_matmul(ls, rs, executor):
    a = rng.standard_normal(ls).astype(np.float32)
    b = rng.standard_normal(rs).astype(np.float32)
    want = torch.matmul(torch.from_numpy(a), torch.from_numpy(b)).numpy()

    def build():
        x, w = popxl.variable(a, name="x"), popxl.variable(b, name="w")
        g = popxl.gcg().ir.create_graph(lambda x, w: x @ w, x, w)
        (y_sub,) = ops.call(g, x, w)
        return {"op": ops.matmul(x, w), "at": x @ w, "sub": y_sub}

    got = run(build, executor)
    for k, v in got.items():
        assert v.shape == want.shape, k
        np.testing.assert_allclose(v, want, rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.parametrize(("ls", "rs"), [((4,), (4, 3)), ((3, 4), (4,)), ((4,), (2, 4, 3))])
def test_vector_matmul_gradients_match_torch_autograd(ls, rs):
    a = rng.standard_normal(ls).astype(np.float32)
    b = rng.standard_normal(rs).astype(np.float32)
    ta = torch.tensor(a, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True)
    ty = ta @ tb
    seed = rng.standard_normal(tuple(ty.shape)).astype(np.float32)
    ty.backward(torch.from_numpy(seed))

    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x, w = popxl.variable(a, name="x"), popxl.variable(b, name="w")
        fwd = ir.create_graph(lambda x, w: x @ w, x.spec, w.spec)
        info = ops.call_with_info(fwd, x, w)
        bwd = autodiff(fwd)
        dx, dw = ops.call(bwd.graph, popxl.constant(seed), inputs_dict=bwd.inputs_dict(info))
        streams = []
        for t in (dx, dw):
            streams.append(popxl.d2h_stream(t.shape, t.dtype))
            ops.host_store(streams[-1], t)
    with popxl.Session(ir, "ipu_hw") as session:
        out = session.run()
    np.testing.assert_allclose(out[streams[0]], ta.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[streams[1]], tb.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_inplace_squeeze_in_captured_torch_code_keeps_the_producer_shape():
    # Torch decompositions reshape fresh results in place (squeeze_); the recorded producer
    # must keep its own shape, so the IR verifies and the value is torch's.
    a = rng.standard_normal((3, 1, 4)).astype(np.float32)

    def build():
        x = popxl.variable(a, name="x")
        y = popxl.gcg().ir.create_graph(lambda x: (x * 2).squeeze_(1).t_() + 1, x)
        return {"y": ops.call(y, x)[0]}

    got = run(build)["y"]
    np.testing.assert_allclose(got, (a * 2).squeeze(1).T + 1, rtol=1e-6)
