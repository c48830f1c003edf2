"""Replication through the public API: grouped variables, per-replica I/O, collectives in
programs (both executors, per-replica values from the spec), data-parallel training."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.transforms import autodiff

EXECUTORS = ["fast", "reference"]


def _store(t):
    s = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(s, t)
    return s


def _session(ir, executor):
    return popxl.Session(ir, "ipu_hw", executor=executor)


GROUPINGS_R8 = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (1, 1)]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("stride,group_size", GROUPINGS_R8)
def test_grouped_variable_initialises_each_replica_from_its_group_row(stride, group_size, executor):
    """Spec §11.6: data arange(num_groups) gives per-replica values equal to the assignment."""
    ir = popxl.Ir(replication=8)
    rg = ir.replica_grouping(stride, group_size)
    with ir.main_graph:
        v = popxl.variable(np.arange(rg.num_groups, dtype=np.float32)[:, None] if rg.num_groups > 1
                           else np.zeros(1, np.float32), replica_grouping=rg)  # fmt: skip
        s = _store(v + 0.0)
    with _session(ir, executor) as session:
        out = session.run()[s]
    assert out.shape == (8, 1)
    np.testing.assert_array_equal(out[:, 0], rg.assignment if rg.num_groups > 1 else np.zeros(8))
    assert v.shape == (1,) and v.shape_on_host == (
        (rg.num_groups, 1) if rg.num_groups > 1 else (1,)
    )


@pytest.mark.parametrize("executor", EXECUTORS)
def test_all_gather_new_axis_per_replica_values(executor):
    """Spec §11.5: x_r = [r], new_axis gathers; (S=2,G=2) gives r0 [[0],[2]], r5 [[5],[7]]."""
    ir = popxl.Ir(replication=8)
    with ir.main_graph:
        x = popxl.variable(
            np.arange(8, dtype=np.float32)[:, None], replica_grouping=ir.replica_grouping(1, 1)
        )
        streams = {
            (s, g): _store(ops.collectives.replicated_all_gather(
                x, group=ir.replica_grouping(s, g), output_shape="new_axis"))
            for s, g in [(1, 2), (2, 2), (2, 4), (4, 2)]
        }  # fmt: skip
    with _session(ir, executor) as session:
        res = session.run()
    out = {k: res[s][..., 0] for k, s in streams.items()}
    np.testing.assert_array_equal(out[(1, 2)][2], [2, 3])
    np.testing.assert_array_equal(out[(2, 2)][0], [0, 2])
    np.testing.assert_array_equal(out[(2, 2)][5], [5, 7])
    np.testing.assert_array_equal(out[(2, 4)][3], [1, 3, 5, 7])
    np.testing.assert_array_equal(out[(4, 2)][6], [2, 6])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_all_gather_called_with_the_grouping_second_is_the_older_new_axis_gather(executor):
    """Older PopXL's replicated_all_gather(t, group) (upstream's tests call it so): x_r = [r]
    gathers to (G, 1) per replica, and an RTS shard to its meta_shape."""
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        x = popxl.variable(
            np.arange(4, dtype=np.int32)[:, None], replica_grouping=ir.replica_grouping(1, 1)
        )
        by_group = {
            (s, g): _store(ops.collectives.replicated_all_gather(x, ir.replica_grouping(s, g)))
            for s, g in [(1, 1), (1, 2), (2, 2), (1, 4)]
        }
        _, shard = popxl.replica_sharded_variable(np.arange(6, dtype=np.float32).reshape(2, 3))
        full = _store(ops.collectives.replicated_all_gather(shard, ir.replica_grouping()))
        with pytest.raises(ValueError, match="both as axis"):
            ops.collectives.replicated_all_gather(
                x, ir.replica_grouping(), group=ir.replica_grouping()
            )
    with _session(ir, executor) as session:
        res = session.run()
    members = {(1, 1): [[0], [1], [2], [3]], (1, 2): [[0, 1], [0, 1], [2, 3], [2, 3]],
               (2, 2): [[0, 2], [1, 3], [0, 2], [1, 3]], (1, 4): [[0, 1, 2, 3]] * 4}  # fmt: skip
    for key, stream in by_group.items():
        np.testing.assert_array_equal(res[stream], np.array(members[key])[..., None], str(key))
    np.testing.assert_array_equal(res[full], np.tile(np.arange(6.0).reshape(2, 3), (4, 1, 1)))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_inputs_and_outputs_have_a_replica_dimension(executor):
    """Spec §6.3: arrays are (nht, R, *shape); element [i, r] is replica r's i-th transfer."""
    ir = popxl.Ir(replication=4)
    ir.num_host_transfers = 3
    with ir.main_graph:
        xs = popxl.h2d_stream((2,), popxl.float32, "x")
        ys = popxl.d2h_stream((2,), popxl.float32, "y")
        for _ in range(3):  # each execution consumes / fills the next entry
            ops.host_store(ys, ops.host_load(xs) * 2.0)
    data = np.arange(24, dtype=np.float32).reshape(3, 4, 2)
    with _session(ir, executor) as session:
        assert session._full_input_shape((2,)) == (3, 4, 2)
        out = session.run({xs: data})[ys]
        with pytest.raises(ValueError, match="It should be of size replication_factor = 4"):
            session.run({xs: data[:, :2]})
    np.testing.assert_array_equal(out, data * 2)


def test_all_replicas_retrieval_and_nonconstant_grouping():
    """Spec §11.15 and §11.16."""
    ir = popxl.Ir(replication=4)
    rg = ir.replica_grouping(2, 2)
    data = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    ir8 = popxl.Ir(replication=8)
    nc = ir8.replica_grouping_from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
    d8 = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    with ir.main_graph:
        v = popxl.variable(data, replica_grouping=rg, retrieval_mode="all_replicas")
        _store(v + 0.0)
    with ir8.main_graph:
        w = popxl.variable(d8, replica_grouping=nc)
        _store(w + 0.0)
    with _session(ir, "fast") as s:
        s.run()
        np.testing.assert_array_equal(s.get_tensor_data(v), np.take(data, [0, 1, 0, 1], axis=0))
        with pytest.raises(NotImplementedError):
            s.write_variable_data(v, data)
    with _session(ir8, "fast") as s:
        assert w.shape == (3, 2)
        np.testing.assert_array_equal(s.get_tensor_data(w), d8)
        s.write_variable_data(w, d8[::-1].copy())
        np.testing.assert_array_equal(s.get_tensor_data(w), d8[::-1])


def test_grouping_from_another_ir_is_rejected():
    ir, other = popxl.Ir(replication=2), popxl.Ir(replication=2)
    with ir.main_graph:
        with pytest.raises(ValueError, match="created by"):
            popxl.variable(np.zeros(2, np.float32), replica_grouping=other.replica_grouping())


def test_collectives_reject_unsupported_dtypes():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        v = popxl.variable(np.zeros(2, np.float64), dtype=popxl.float64)
        with pytest.raises(TypeError, match="float64"):
            ops.collectives.replicated_all_reduce(v)
        w = popxl.variable(np.zeros(2, np.float32))
        with pytest.raises(ValueError, match="Not a valid op"):
            ops.collectives.replicated_all_reduce(w, "prod")


def _mlp_program(R: int, micro: int, w_init, lr: float, executor: str):
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        ws = [popxl.variable(w, name=f"w{i}") for i, w in enumerate(w_init)]
        xs = popxl.h2d_stream((micro, w_init[0].shape[0]), popxl.float32, "x")
        ls = popxl.h2d_stream((micro,), popxl.int32, "labels")

        def net(x, *ws):
            h = x
            for i, w in enumerate(ws):
                h = h @ w
                if i < len(ws) - 1:
                    h = torch.nn.functional.gelu(h)
            return h

        fwd = ir.create_graph(
            net, popxl.TensorSpec((micro, w_init[0].shape[0]), popxl.float32), *ws
        )
        bwd = autodiff(fwd, grads_provided=fwd.outputs[:1], grads_required=list(fwd.inputs[1:]))
        info = ops.call_with_info(fwd, ops.host_load(xs), *ws)
        labels = ops.host_load(ls)
        loss, dy = ops.nll_loss_with_softmax_grad(ops.softmax(info.outputs[0], axis=1), labels)
        grads = ops.call(bwd.graph, dy, inputs_dict=bwd.inputs_dict(info))
        for w, g in zip(ws, grads, strict=True):
            g = ops.collectives.replicated_all_reduce(g, op="mean")
            ops.scaled_add_(w, g, b=-lr)
        _store(loss)
    return ir, ws, xs, ls


@pytest.mark.parametrize("executor", EXECUTORS)
def test_data_parallel_step_matches_single_replica_on_concatenated_batch(executor):
    """R=4 replicas x micro-batch 8 with mean all-reduce == 1 replica on the batch of 32."""
    rng = np.random.default_rng(0)
    sizes = (12, 16, 16, 5)
    w_init = [
        rng.normal(size=(a, b)).astype(np.float32) * 0.3
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    x = rng.normal(size=(3, 32, 12)).astype(np.float32)
    y = rng.integers(0, 5, size=(3, 32)).astype(np.int32)
    results = []
    for R in (4, 1):
        ir, ws, xs, ls = _mlp_program(R, 32 // R, w_init, 0.1, executor)
        with _session(ir, executor) as session:
            for step in range(3):
                xb = x[step].reshape(R, 32 // R, 12) if R > 1 else x[step]
                yb = y[step].reshape(R, 32 // R) if R > 1 else y[step]
                session.run({xs: xb, ls: yb})
            results.append([session.get_tensor_data(w) for w in ws])
    # Sum order differs (per-replica partial sums), so allow float32 rounding.
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
