"""Note [explicit batching]: replicated programs whose ops all have stacked rules run without
vmap; they must give exactly what the reference executor gives (per replica)."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops


def _build(R):
    rng = np.random.default_rng(0)
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        w = popxl.variable(rng.normal(size=(6, 5)).astype(np.float32), name="w")  # invariant
        b = popxl.variable(rng.normal(size=(5,)).astype(np.float32), name="b")
        per = popxl.variable(rng.normal(size=(R, 4, 6)).astype(np.float32), name="per",
                             replica_grouping=ir.replica_grouping(1, 1))  # fmt: skip
        xs = popxl.h2d_stream((4, 6), popxl.float32, "x")
        ls = popxl.h2d_stream((4,), popxl.int32, "labels")
        x = ops.host_load(xs)
        h = torch.nn.functional.gelu(x @ w + b)  # mm(B, U) + broadcast
        m = torch.matmul(per.transpose(0, 1), x)  # mm(B, B) via t
        u = torch.matmul(w.transpose(0, 1), m)  # mm(U, B)
        s = torch.softmax(h, dim=-1)
        picked = torch.gather(s, 1, ops.host_load(ls).long().unsqueeze(1))
        red = picked.sum() + h.mean(dim=0).amax() + u.sum(dim=[0, 1])
        scattered = torch.zeros(4, 5).scatter_add(1, torch.zeros(4, 1, dtype=torch.int64), h)
        v = h.reshape(2, 10).view(20) * 2.0
        g = ops.collectives.replicated_all_reduce(h.sum(dim=0), "mean")
        ops.scaled_add_(b, g, b=-0.1)  # invariant update
        outs = {}
        for name, t in (("h", h), ("m", m), ("u", u), ("red", red), ("scattered", scattered),
                        ("v", v), ("g", g), ("picked", picked)):  # fmt: skip
            st = popxl.d2h_stream(t.shape, t.dtype, name)
            ops.host_store(st, t)
            outs[name] = st
    return ir, xs, ls, outs, b


@pytest.mark.parametrize("R", [2, 4])
def test_explicitly_batched_program_matches_the_reference(R):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(R, 4, 6)).astype(np.float32)
    labels = rng.integers(0, 5, size=(R, 4)).astype(np.int32)
    results = {}
    for executor in ("fast", "reference"):
        ir, xs, ls, outs, b = _build(R)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        if executor == "fast":
            assert session._executor.fns["normal"].explicit, session.generated_code()
        with session:
            out = session.run({xs: x, ls: labels})
            results[executor] = {k: out[s] for k, s in outs.items()}
            results[executor]["b"] = session.get_tensor_data(b)
    for k, want in results["reference"].items():
        np.testing.assert_allclose(results["fast"][k], want, rtol=1e-5, atol=1e-6, err_msg=k)


def test_programs_with_other_ops_fall_back_to_vmap():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        x = popxl.variable(
            np.ones((2, 2, 3), np.float32), replica_grouping=ir.replica_grouping(1, 1)
        )
        y = torch.cumsum(x, dim=1)  # no explicit rule
        st = popxl.d2h_stream(y.shape, y.dtype)
        ops.host_store(st, y)
    session = popxl.Session(ir, "ipu_model")
    assert not session._executor.fns["normal"].explicit
    with session:
        want = np.cumsum(np.ones((2, 3)), axis=1)[None].repeat(2, 0)  # (replicas, 2, 3)
        np.testing.assert_array_equal(session.run()[st], want)
