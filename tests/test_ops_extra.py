"""Ops the main op tests do not cover: dropout, init, print_tensor, ipu_copy, lamb_square,
sparse_accumulate_ — checked by value on both executors."""

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.ops as ops

EXECUTORS = ["fast", "reference"]


def _run(build, executor, replication=1):
    ir = popxl.Ir(replication=replication)
    with ir.main_graph, popxl.in_sequence():
        streams = build()
    session = popxl.Session(ir, "ipu_model", executor=executor)
    with session:
        out = session.run()
    return {k: out[s] for k, s in streams.items()}, session


def _store(t):
    s = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(s, t)
    return s


@pytest.mark.parametrize("executor", EXECUTORS)
def test_dropout_zeroes_about_p_and_scales_the_rest(executor):
    def build():
        x = popxl.variable(np.ones(4000, np.float32))
        return {"y": _store(ops.dropout(x, None, p=0.25))}

    y = _run(build, executor)[0]["y"]
    kept = y != 0
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert 0.70 < kept.mean() < 0.80  # binomial(4000, 0.75): 5 sigma is about +-0.034
    with pytest.raises(ValueError, match="dropout probability"):
        _run(
            lambda: {"y": _store(ops.dropout(popxl.variable(np.ones(2, np.float32)), None, p=1.0))},
            executor,
        )


@pytest.mark.parametrize("executor", EXECUTORS)
def test_replicas_draw_different_dropout_masks(executor):
    def build():
        x = popxl.variable(np.ones(256, np.float32))
        return {"y": _store(ops.dropout(x, None, p=0.5))}

    y = _run(build, executor, replication=2)[0]["y"]
    assert y.shape == (2, 256) and not np.array_equal(y[0] != 0, y[1] != 0)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_init_ipu_copy_lamb_square_and_sparse_accumulate(executor):
    def build():
        z = ops.init((2, 3), popxl.float32, "z")
        x = popxl.variable(np.arange(6, dtype=np.float32).reshape(2, 3))
        moved = ops.ipu_copy(x, 1, source=0)  # x was made outside popxl.ipu: name its IPU
        sq = ops.lamb_square(x)
        t = popxl.variable(np.zeros((4, 3), np.float32), name="t")
        idx = popxl.constant(np.array([2, 0], np.int32))
        ops.sparse_accumulate_(t, x, idx, axis=0, f=2.0)
        return {"z": _store(z), "moved": _store(moved), "sq": _store(sq), "t": _store(t + 0.0)}

    out = _run(build, executor)[0]
    np.testing.assert_array_equal(out["z"], np.zeros((2, 3)))
    np.testing.assert_array_equal(out["moved"], np.arange(6).reshape(2, 3))
    assert float(out["sq"]) == float(sum(i * i for i in range(6)))
    expected = np.zeros((4, 3), np.float32)
    expected[2] = 2 * np.array([0, 1, 2])
    expected[0] = 2 * np.array([3, 4, 5])
    np.testing.assert_array_equal(out["t"], expected)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_print_tensor_prints_each_replica_and_passes_the_value_through(executor, capsys):
    def build():
        x = popxl.variable(
            np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
            replica_grouping=popxl.gcg().ir.replica_grouping(1, 1),
        )
        y = ops.print_tensor(x, "x_value") * 2.0
        return {"y": _store(y)}

    out = _run(build, executor, replication=2)[0]
    np.testing.assert_array_equal(out["y"], [[2.0, 4.0], [6.0, 8.0]])
    printed = capsys.readouterr().err  # upstream prints on stderr
    assert "x_value (replica 0): (1.0000000,2.0000000)" in printed
    assert "x_value (replica 1): (3.0000000,4.0000000)" in printed
