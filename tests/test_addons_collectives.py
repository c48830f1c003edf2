"""addons.ops tensor-parallel and strided collectives: forward values and gradients on every
replica, against sums over each replica group computed by hand (numpy)."""

from __future__ import annotations

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl import ops
from torch_popxl.addons.ops import replicated_all_reduce_TP as tp
from torch_popxl.addons.ops import replicated_strided_collectives as strided

R = 4


def group_sum(a: np.ndarray, group_size: int, stride: int) -> np.ndarray:
    """Each replica's row replaced by the sum over its group (numpy reference)."""
    out = np.empty_like(a)
    for r in range(a.shape[0]):
        base = (r // (group_size * stride)) * group_size * stride + r % stride
        members = [base + k * stride for k in range(group_size)]
        assert r in members
        out[r] = a[members].sum(0)
    return out


def fwd_and_grad(fn, x_data, seed_data, executor):
    """y = fn(x) * 3 per replica and dL/dx for the per-replica seed (addons.autodiff)."""
    ir = popxl.Ir(replication=R)

    class M(addons.Module):
        def build(self, x):
            return fn(ir, x) * 3.0

    with ir.main_graph:
        xs = popxl.h2d_stream(x_data.shape[1:], popxl.float32, "x")
        ss = popxl.h2d_stream(seed_data.shape[1:], popxl.float32, "seed")
        x, seed = ops.host_load(xs), ops.host_load(ss)
        facts, fwd = M().create_graph(x)
        bwd = addons.autodiff(fwd)
        info = fwd.bind(facts.init()).call_with_info(x)
        (dx,) = bwd.call(seed, args=bwd.grad_graph_info.inputs_dict(info))
        y_out, dx_out = addons.host_store(info.outputs[0]), addons.host_store(dx)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run({xs: x_data, ss: seed_data})
    return out[y_out], out[dx_out]


GROUPINGS = [(2, 1), (2, 2), (4, 1), (1, 1)]


@pytest.mark.parametrize("executor", ["fast", "reference"])
@pytest.mark.parametrize("group_size, stride", GROUPINGS)
@pytest.mark.parametrize(
    "name, fwd_reduces, grad_reduces",
    [
        ("replicated_all_reduce_identical_inputs", False, True),
        ("replicated_all_reduce_identical_grad_inputs", True, False),
        ("replicated_all_reduce", True, True),
    ],
)
def test_tp_all_reduce_forward_and_gradient_per_replica_group(name, fwd_reduces, grad_reduces,
                                                              group_size, stride, executor):  # fmt: skip
    rng = np.random.default_rng(group_size * 10 + stride)
    x = rng.normal(size=(R, 2, 3)).astype(np.float32)
    seed = rng.normal(size=(R, 2, 3)).astype(np.float32)
    op = getattr(tp, name)
    y, dx = fwd_and_grad(
        lambda ir, t: op(t, group=ir.replica_grouping(stride, group_size)), x, seed, executor
    )
    np.testing.assert_allclose(
        y, 3 * (group_sum(x, group_size, stride) if fwd_reduces else x), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(dx, 3 * (group_sum(seed, group_size, stride) if grad_reduces else seed),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("name, mode_of", [
    ("replicated_all_reduce_strided", "replicated_all_reduce"),
    ("replicated_all_reduce_strided_identical_inputs", "replicated_all_reduce_identical_inputs"),
    ("replicated_all_reduce_strided_identical_grad_inputs", "replicated_all_reduce_identical_grad_inputs"),
])  # fmt: skip
def test_strided_all_reduces_match_the_tp_variants(name, mode_of):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(R, 3)).astype(np.float32)
    seed = rng.normal(size=(R, 3)).astype(np.float32)
    got = fwd_and_grad(
        lambda ir, t: getattr(strided, name)(t, group=ir.replica_grouping(2, 2)), x, seed, "fast"
    )
    want = fwd_and_grad(
        lambda ir, t: getattr(tp, mode_of)(t, group=ir.replica_grouping(2, 2)), x, seed, "fast"
    )
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_tp_all_reduce_defaults_to_all_replicas_and_rejects_other_ops():
    x = np.arange(R * 2, dtype=np.float32).reshape(R, 2)
    y, dx = fwd_and_grad(lambda ir, t: tp.replicated_all_reduce(t), x, x, "fast")
    np.testing.assert_allclose(y, 3 * group_sum(x, R, 1))
    ir = popxl.Ir(replication=R)
    with ir.main_graph, pytest.raises(ValueError, match="only op='add' is supported"):
        tp.replicated_all_reduce(popxl.variable(np.zeros(2, np.float32)), op="max")


def test_strided_all_gather_and_reduce_scatter_over_a_strided_group():
    """Group (stride 2, size 2) = replicas {0, 2} and {1, 3}."""
    x = np.arange(R * 4, dtype=np.float32).reshape(R, 4)
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        xs = popxl.h2d_stream((4,), popxl.float32, "x")
        t = ops.host_load(xs)
        g = ir.replica_grouping(2, 2)
        gathered = strided.replicated_all_gather_strided(t, group=g)
        scattered = strided.replicated_reduce_scatter_strided(t, group=g)
        outs = [addons.host_store(v) for v in (gathered, scattered)]
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({xs: x})
    partner = [2, 3, 0, 1]
    for r in range(R):
        lo, hi = min(r, partner[r]), max(r, partner[r])
        np.testing.assert_array_equal(out[outs[0]][r], np.concatenate([x[lo], x[hi]]))
        rank = 0 if r == lo else 1
        np.testing.assert_array_equal(out[outs[1]][r], (x[lo] + x[hi])[2 * rank : 2 * rank + 2])


def test_all_reduce_strided_graph_reduces_each_named_tensor():
    x = np.arange(R * 2, dtype=np.float32).reshape(R, 2)
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        xs = popxl.h2d_stream((2,), popxl.float32, "x")
        a = ops.host_load(xs)
        b = a * 2.0
        named = addons.NamedTensors(b=b, a=a)
        graph, names = strided.replicated_all_reduce_strided_graph(
            named, group=ir.replica_grouping(1, 2)
        )
        assert names == ["a", "b"]
        reduced = addons.NamedTensors.pack(names, graph.bind(named).call())
        outs = {k: addons.host_store(v) for k, v in reduced.to_dict().items()}
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({xs: x})
    np.testing.assert_array_equal(out[outs["a"]], group_sum(x, 2, 1))
    np.testing.assert_array_equal(out[outs["b"]], 2 * group_sum(x, 2, 1))
