"""popxl-addons transforms of issue 16: recomputation, repeat_graph, batch serialisation.

Spec: ../shared/spec/addons.md §7 (transforms) and §15 (test_recomputation, test_repeat_graph,
test_batch_serialisation). Each transform is checked against its untransformed program (fast
and reference executors) and eager torch, for upstream's structure, and, for recomputation and
batch serialisation, for a lower peak of live intermediates in the memory report.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl import ops
from torch_popxl.addons.transforms.batch_serialisation import (
    BatchSerialResult,
    RemoteHandle,
    batch_serial_buffer,
    batch_serialise,
    batch_serialise_fwd_and_grad,
)
from torch_popxl.addons.transforms.recomputation import recompute_graph
from torch_popxl.addons.transforms.repeat_graph import repeat_graph

EXECUTORS = ["fast", "reference"]


def run(ir, inputs=None, executor="fast", weights=None):
    """One run: (outputs by stream, peak live intermediate bytes of the program)."""
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        if weights:
            session.write_variables_data(weights)
        outputs = session.run(inputs or {})
        peak = session.memory_report().peak_intermediate_bytes
    return outputs, peak


# ---- recomputation --------------------------------------------------------------------------


class DoubleLinear(addons.Module):
    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        # The Add's gradient does not need x: with recomputation x becomes an expected input.
        y = x + 2
        w1 = self.add_variable_input("w1", partial(np.random.normal, 0, 0.1, (2, 2)), x.dtype)
        w2 = self.add_variable_input("w2", partial(np.random.normal, 0, 0.1, (2, 2)), x.dtype)
        return (y @ w1) @ w2


def _double_linear(recompute: bool, executor: str):
    np.random.seed(1984)
    ir = popxl.Ir()
    with ir.main_graph:
        x_data, x_h2d, x = addons.host_load(
            np.random.normal(0, 0.1, (2, 2)).astype(np.float32), popxl.float32, "x"
        )
        args, graph = DoubleLinear().create_graph(x)
        dgraph = addons.autodiff(graph)
        if recompute:
            dgraph = addons.recompute_graph(dgraph)
        weights = args.init()
        layer = graph.bind(weights)
        x, *_ = layer.call(x)
        info = layer.call_with_info(x)
        y, *_ = info.outputs
        seed = popxl.constant(np.ones(y.shape), y.dtype, "gradient")
        grads = dgraph.call(seed, args=dgraph.grad_graph_info.inputs_dict(info))
        streams = [addons.host_store(g) for g in grads]
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        outputs = session.run({x_h2d: x_data})
        w = [session.get_tensor_data(weights.w1), session.get_tensor_data(weights.w2)]
    return [outputs[s] for s in streams], len(ir.graphs), (x_data, *w)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_recompute_graph_gives_the_same_gradients_as_the_plain_grad_graph(executor):
    plain, _, _ = _double_linear(False, executor)
    recomputed, _, (x_np, w1_np, w2_np) = _double_linear(True, executor)
    for a, b in zip(plain, recomputed, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    # And both are the gradients eager torch computes for the second call of the layer.
    w1 = torch.tensor(w1_np, requires_grad=True)
    w2 = torch.tensor(w2_np, requires_grad=True)
    x1 = ((torch.tensor(x_np) + 2) @ w1 @ w2).detach().requires_grad_(True)
    ((x1 + 2) @ w1 @ w2).sum().backward()
    for got, want in zip(recomputed, (x1.grad, w1.grad, w2.grad), strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-7)


def test_recompute_graph_adds_one_graph_whose_expected_inputs_are_forward_inputs():
    _, n_plain, _ = _double_linear(False, "fast")
    _, n_recomp, _ = _double_linear(True, "fast")
    assert n_plain == 3 and n_recomp == 4  # spec §15 test_modules
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros((2, 2), np.float32))
        _, graph = DoubleLinear().create_graph(x)
        dgraph = addons.autodiff(graph)
        rgraph = recompute_graph(dgraph)
    fwd_inputs = set(graph.graph.inputs)
    kinds = [ec.connection_type.name for ec in rgraph.grad_graph_info.expected_inputs]
    assert kinds == ["FwdGrad", "Fwd", "Fwd", "Fwd"]
    assert all(ec.fwd_tensor in fwd_inputs for ec in rgraph.grad_graph_info.expected_inputs[1:])
    assert rgraph.grad_graph_info.expected_outputs == dgraph.grad_graph_info.expected_outputs
    assert rgraph.graph is not dgraph.graph and rgraph.graph.name.endswith("_recomp")
    with pytest.raises(ValueError, match="not a gradient graph"):
        recompute_graph(graph)
    with pytest.raises(TypeError, match="GraphWithNamedArgs"):
        recompute_graph(dgraph.graph)


class Block(addons.Module):
    """A wide MLP block: its activations (4x wider than its input) dominate memory."""

    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        d = x.shape[-1]
        w1 = self.add_variable_input("w1", partial(np.random.normal, 0, 0.2, (d, 4 * d)), x.dtype)
        w2 = self.add_variable_input("w2", partial(np.random.normal, 0, 0.2, (4 * d, d)), x.dtype)
        return ops.gelu(x @ w1) @ w2 + x


def _deep_mlp(recompute: bool, executor: str, layers: int = 4, accumulate: bool = False):
    """``layers`` Blocks forward then backward; returns (dx, accumulated dw1s, peak bytes)."""
    np.random.seed(7)
    x_np = np.random.normal(0, 1, (16, 32)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        x_h2d = popxl.h2d_stream(x_np.shape, popxl.float32, "x")
        x = ops.host_load(x_h2d)
        facts, graph = Block().create_graph(x)
        if accumulate:
            dfacts, dgraph = addons.autodiff_with_accumulation(
                graph, graph.args.tensors, grads_required=graph.graph.inputs[:1]
            )
        else:
            dgraph = addons.autodiff(graph, grads_required=graph.graph.inputs[:1])
        if recompute:
            dgraph = recompute_graph(dgraph)
        weights = [facts.init(f"layer{i}") for i in range(layers)]
        accums = [dfacts.init(f"accum{i}") for i in range(layers)] if accumulate else []
        infos = []
        h = x
        for w in weights:
            infos.append(graph.bind(w).call_with_info(h))
            h = infos[-1].outputs[0]
        dh = popxl.constant(np.ones(h.shape, np.float32), popxl.float32, "seed")
        for i in reversed(range(layers)):
            bound = dgraph.bind(accums[i]) if accumulate else dgraph.bind()
            (dh,) = bound.call(dh, args=dgraph.grad_graph_info.inputs_dict(infos[i]))
        out = popxl.d2h_stream(dh.shape, dh.dtype, "dx")
        ops.host_store(out, dh)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        result = session.run({x_h2d: x_np})
        peak = session.memory_report().peak_intermediate_bytes
        w_np = [session.get_tensor_data(w.w1) for w in weights] + [
            session.get_tensor_data(w.w2) for w in weights
        ]
        dw1 = [session.get_tensor_data(a.accum.w1) for a in accums]
    return result[out], dw1, peak, x_np, w_np


def _torch_deep_mlp(x_np, w_np, layers=4):
    w1s = [torch.tensor(w, requires_grad=True) for w in w_np[:layers]]
    w2s = [torch.tensor(w, requires_grad=True) for w in w_np[layers:]]
    x = torch.tensor(x_np, requires_grad=True)
    h = x
    for w1, w2 in zip(w1s, w2s, strict=True):
        h = torch.nn.functional.gelu(h @ w1, approximate="tanh") @ w2 + h
    h.sum().backward()
    return x.grad.numpy(), [w.grad.numpy() for w in w1s]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_recomputation_matches_plain_backward_and_torch_and_lowers_peak_memory(executor):
    dx_plain, _, peak_plain, x_np, w_np = _deep_mlp(False, executor)
    dx_recomp, _, peak_recomp, _, _ = _deep_mlp(True, executor)
    np.testing.assert_allclose(dx_recomp, dx_plain, rtol=1e-6, atol=1e-6)
    dx_torch, _ = _torch_deep_mlp(x_np, w_np)
    np.testing.assert_allclose(dx_recomp, dx_torch, rtol=1e-4, atol=1e-5)
    assert peak_recomp < peak_plain, (peak_plain, peak_recomp)


def test_recomputation_peak_memory_grows_with_layer_inputs_not_activations():
    """Plain: each layer keeps a [16, 128] activation alive until its backward, so the peak
    grows by that much per layer. Recomputed: only the layer's [16, 32] input stays alive."""
    peaks = {(r, n): _deep_mlp(r, "fast", layers=n)[2] for r in (False, True) for n in (2, 6)}
    act, layer_input = 16 * 128 * 4, 16 * 32 * 4
    assert peaks[False, 6] - peaks[False, 2] >= 4 * act
    assert peaks[True, 6] - peaks[True, 2] <= 4 * layer_input
    assert peaks[True, 6] < peaks[False, 6] - 3 * act


def test_recomputation_with_gradient_accumulation_matches_torch():
    dx_plain, dw_plain, _, x_np, w_np = _deep_mlp(False, "fast", accumulate=True)
    dx_recomp, dw_recomp, _, _, _ = _deep_mlp(True, "fast", accumulate=True)
    dx_torch, dw_torch = _torch_deep_mlp(x_np, w_np)
    np.testing.assert_allclose(dx_recomp, dx_plain, rtol=1e-6, atol=1e-6)
    for a, b, t in zip(dw_plain, dw_recomp, dw_torch, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(b, t, rtol=1e-4, atol=1e-5)


# ---- repeat_graph ---------------------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("repeat_count", [1, 5])
def test_repeat_graph_runs_the_main_program_repeat_count_times(repeat_count, executor):
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(0) + 1
        d2h = addons.host_store(x)
    before = len(ir.graphs)
    new = repeat_graph(ir.main_graph, repeat_count)
    assert (new is ir.main_graph) == (repeat_count == 1)
    assert len(ir.graphs) == before + (repeat_count > 1)
    ir.num_host_transfers = repeat_count
    outputs, _ = run(ir, executor=executor)
    assert np.sum(outputs[d2h]) == repeat_count


@pytest.mark.parametrize("executor", EXECUTORS)
def test_repeat_graph_variables_are_updated_in_place_every_iteration(executor):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        v = popxl.variable(np.float32(0.0), name="v")
        d2h = addons.host_store(v + 1)
        ops.var_updates.accumulate_(v, popxl.constant(np.float32(2.0)))
    repeat_graph(ir.main_graph, 5)
    ir.num_host_transfers = 5
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run()[d2h]
        v_after = session.get_tensor_data(v)
    np.testing.assert_array_equal(out.reshape(-1), [1, 3, 5, 7, 9])
    assert v_after == 10.0


def test_repeat_graph_keeps_op_order_and_checks_arguments():
    ir = popxl.Ir()
    with ir.main_graph:
        small = popxl.variable(1, name="small")
        big = popxl.variable(np.ones((2, 2), np.float32), name="big")
        with popxl.in_sequence():
            _ = big + 1
            _ = small * 1
    new = repeat_graph(ir.main_graph, 5)
    names = [op.attrs.target.__name__ for op in new.ops]
    assert names[0].startswith("add") and names[1].startswith("mul")
    assert [op.kind for op in ir.main_graph.ops] == ["repeat"]
    assert all(new.is_input_by_ref(t) for t in new.inputs)
    with pytest.raises(TypeError, match="repeat_count"):
        repeat_graph(ir.main_graph, 2.0)
    sub = ir.create_graph(lambda t: t + 1, popxl.TensorSpec((2,), popxl.float32))
    with pytest.raises(ValueError, match="has outputs"):
        repeat_graph(sub, 3)


# ---- batch serialisation --------------------------------------------------------------------


class Scale(addons.Module):
    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        scale = self.add_variable_input("scale", partial(np.full, x.shape, 2), x.dtype)
        return x * scale


CB, BF = 2, 4  # micro batch, batch serialisation factor


def _inputs():
    return np.arange(BF * CB * 2, dtype=np.float32).reshape(BF, CB, 2)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("io_mode", ["compute", "io", "io_overlapped"])
def test_batch_serialise_forward_stores_every_micro_batch(io_mode, executor):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        in_h2d = popxl.h2d_stream((CB, 2), popxl.float32, name="x_stream")
        args, graph = Scale().create_graph(in_h2d.spec)
        stores = {t: RemoteHandle(batch_serial_buffer(t)) for t in graph.graph.outputs}
        result = batch_serialise(graph, BF, {graph.graph.inputs[0]: in_h2d}, {}, stores,
                                 io_mode=io_mode)  # fmt: skip
        assert isinstance(result, BatchSerialResult)
        result.graph.bind(args.init()).call(0)
        handle = result.stored_buffers[graph.graph.outputs[0]]
        assert handle.buffer.entries == BF  # grown from 1 to one entry per step
        out = popxl.d2h_stream(in_h2d.shape, in_h2d.dtype)
        for i in range(BF):
            ops.host_store(out, ops.remote_load(handle.buffer, i))
    ir.num_host_transfers = BF
    outputs, _ = run(ir, {in_h2d: _inputs()}, executor)
    np.testing.assert_array_equal(outputs[out], _inputs() * 2)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_batch_serialise_rows_offsets_and_chained_buffers(executor):
    """Upstream's sequence test: load from host into row 0, scale row 0 into row 1 and row 1
    into row 2 (one graph called with row index 0 and 1), then row 2 out to the host."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        in_h2d = popxl.h2d_stream((CB, 2), popxl.float32, name="in_stream")
        out_d2h = popxl.d2h_stream(in_h2d.shape, in_h2d.dtype, name="out_stream")
        args, graph = Scale().create_graph(in_h2d.spec)
        x_in, y_out = graph.graph.inputs[0], graph.graph.outputs[0]
        buffer = batch_serial_buffer(y_out)
        load = batch_serialise(graph, BF, {x_in: in_h2d}, {}, {y_out: (buffer, 0)})
        remote = batch_serialise(graph, BF, {x_in: (buffer, 0)}, {}, {y_out: (buffer, 1)}, rows=2)
        store = batch_serialise(graph, BF, {x_in: (buffer, 2)}, {y_out: out_d2h}, {})
        assert buffer.entries == 3 * BF
        var = args.init()
        load.graph.bind(var).call(0)
        remote.graph.bind(var).call(0)
        remote.graph.bind(var).call(1)
        store.graph.bind(var).call(0)
    ir.num_host_transfers = BF
    outputs, _ = run(ir, {in_h2d: _inputs()}, executor)
    np.testing.assert_array_equal(outputs[out_d2h], _inputs() * 2**4)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_batch_serialise_row_offset_functions_name_the_row(executor):
    """A handle's row offset may be a function of the graph's row index giving the row itself
    (T5's finetuning: its encoder and decoder layers share one block graph and read masks
    from rows 0 and 1 of one buffer, ``RemoteHandle(mask_buffer, lambda i: i / (N + 2))``).
    Called with row index 3, the middle graph reads row 0 and writes row 1."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        in_h2d = popxl.h2d_stream((CB, 2), popxl.float32, name="in_stream")
        out_d2h = popxl.d2h_stream(in_h2d.shape, in_h2d.dtype, name="out_stream")
        args, graph = Scale().create_graph(in_h2d.spec)
        x_in, y_out = graph.graph.inputs[0], graph.graph.outputs[0]
        buffer = batch_serial_buffer(y_out, steps=BF, rows=2)
        load = batch_serialise(graph, BF, {x_in: in_h2d}, {}, {y_out: (buffer, 0)})
        middle = batch_serialise(graph, BF, {x_in: RemoteHandle(buffer, lambda r: r - 3)}, {},
                                 {y_out: RemoteHandle(buffer, lambda r: r / 3)})  # fmt: skip
        store = batch_serialise(graph, BF, {x_in: (buffer, 1)}, {y_out: out_d2h}, {})
        var = args.init()
        load.graph.bind(var).call(0)
        middle.graph.bind(var).call(3)
        store.graph.bind(var).call(0)
    ir.num_host_transfers = BF
    outputs, _ = run(ir, {in_h2d: _inputs()}, executor)
    np.testing.assert_array_equal(outputs[out_d2h], _inputs() * 2**3)


class Linear(addons.Module):
    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        w = self.add_variable_input("w", partial(np.random.normal, 0, 0.1, (2, 16)), x.dtype)
        return ops.gelu(x @ w)


def _linear_data():
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, (BF, CB, 2)).astype(np.float32)
    w = rng.normal(0, 0.1, (2, 16)).astype(np.float32)
    dy = rng.normal(0, 1, (BF, CB, 16)).astype(np.float32)
    return x, w, dy


def _linear_plain(executor):
    x_np, w_np, dy_np = _linear_data()
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        in_h2d = popxl.h2d_stream((BF * CB, 2), popxl.float32, name="in_stream")
        out_d2h = popxl.d2h_stream(in_h2d.shape, in_h2d.dtype, name="out_stream")
        args, graph = Linear().create_graph(in_h2d.spec)
        dargs, dgraph = addons.autodiff_with_accumulation(
            graph, graph.args.tensors, grads_required=graph.graph.inputs[:1]
        )
        weights = args.init()
        accums = dargs.init()
        info = graph.bind(weights).call_with_info(ops.host_load(in_h2d))
        seed = popxl.constant(dy_np.reshape(-1, 16))
        (dx,) = dgraph.bind(accums).call(seed, args=dgraph.grad_graph_info.inputs_dict(info))
        ops.host_store(out_d2h, dx)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        session.write_variable_data(weights.w, w_np)
        dx = session.run({in_h2d: x_np.reshape(-1, 2)})[out_d2h]
        dw = session.get_tensor_data(accums.accum.w)
        peak = session.memory_report().peak_intermediate_bytes
    return dx, dw, peak


def _linear_serial(executor, io_mode="io", remote_inputs=False, replication=1):
    x_np, w_np, dy_np = _linear_data()
    ir = popxl.Ir(replication=replication)
    with ir.main_graph:
        in_h2d = popxl.h2d_stream((CB, 2), popxl.float32, name="in_stream")
        out_d2h = popxl.d2h_stream(in_h2d.shape, in_h2d.dtype, name="out_stream")
        args, graph = Linear().create_graph(in_h2d.spec)
        dargs, dgraph = addons.autodiff_with_accumulation(
            graph, graph.args.tensors, grads_required=graph.graph.inputs[:1]
        )
        dy_in = dgraph.graph.inputs[0]
        dy_buffer = batch_serial_buffer(dy_in, steps=BF)
        x_in = graph.graph.inputs[0]
        x_buffer = popxl.remote_buffer(in_h2d.shape, in_h2d.dtype, BF)
        stores: dict = {}
        if replication > 1:  # shard every activation the backward needs over the replicas
            group = ir.replica_grouping(group_size=replication)
            stores = {ec.fwd_tensor: group for ec in dgraph.grad_graph_info.expected_inputs
                      if ec.connection_type.name == "Fwd" and ec.fwd_tensor not in graph.args.tensors}  # fmt: skip
        loads = {x_in: (x_buffer, 0) if remote_inputs else in_h2d, dy_in: (dy_buffer, 0)}
        given = (dict(loads), dict(stores))
        bs_fwd, bs_grad = batch_serialise_fwd_and_grad(
            graph, dgraph, graph.args, BF, loads, {dgraph.graph.outputs[0]: out_d2h}, stores,
            io_mode=io_mode,
        )  # fmt: skip
        assert (loads, stores) == given  # the arguments are not modified
        weights = args.init()
        accums = dargs.init()
        with popxl.in_sequence():
            for i in range(BF):
                ops.remote_store(dy_buffer, i, popxl.constant(dy_np[i]))
                if remote_inputs:
                    ops.remote_store(x_buffer, i, popxl.constant(x_np[i]))
            bs_fwd.graph.bind(weights).call(0)
            grad_args = addons.NamedTensors.from_dict({**weights.to_dict(), **accums.to_dict()})
            bs_grad.graph.bind(grad_args).call(0)
    ir.num_host_transfers = BF
    feed = {} if remote_inputs else {in_h2d: np.repeat(x_np[:, None], replication, 1)
                                     if replication > 1 else x_np}  # fmt: skip
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        session.write_variable_data(weights.w, w_np)
        dx = session.run(feed)[out_d2h]
        dw = session.get_tensor_data(accums.accum.w)
        peak = session.memory_report().peak_intermediate_bytes
    return dx, dw, peak, bs_fwd, bs_grad


def _torch_linear():
    x_np, w_np, dy_np = _linear_data()
    x = torch.tensor(x_np.reshape(-1, 2), requires_grad=True)
    w = torch.tensor(w_np, requires_grad=True)
    torch.nn.functional.gelu(x @ w, approximate="tanh").backward(
        torch.tensor(dy_np.reshape(-1, 16))
    )
    return x.grad.numpy(), w.grad.numpy()


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("io_mode", ["compute", "io", "io_overlapped"])
def test_batch_serialise_fwd_and_grad_matches_the_full_batch_program(io_mode, executor):
    dx_plain, dw_plain, _ = _linear_plain(executor)
    dx_bs, dw_bs, _, _, _ = _linear_serial(executor, io_mode)
    dx_torch, dw_torch = _torch_linear()
    np.testing.assert_allclose(dx_bs.reshape(-1, 2), dx_plain, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx_bs.reshape(-1, 2), dx_torch, rtol=1e-5, atol=1e-6)
    # The full batch's gradient is the sum over micro batches; the accumulator keeps the mean
    # of the BF micro-batch gradients (Note [running-mean accumulation]).
    np.testing.assert_allclose(dw_plain, dw_torch, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw_bs * BF, dw_torch, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_batch_serialise_fwd_and_grad_with_inputs_in_remote_buffers(executor):
    dx_plain, _, _ = _linear_plain(executor)
    dx_bs, _, _, bs_fwd, _ = _linear_serial(executor, remote_inputs=True)
    np.testing.assert_allclose(dx_bs.reshape(-1, 2), dx_plain, rtol=1e-5, atol=1e-6)


def test_batch_serialise_fwd_and_grad_structure():
    *_, bs_fwd, bs_grad = _linear_serial("fast")
    # Forward loop: row index, then the weight (passed through, keeps its name).
    assert [t.dtype for t in bs_fwd.graph.graph.inputs[:1]] == [popxl.int32]
    assert bs_fwd.graph.args.keys_flat() == ["w"]
    # The activations went to remote buffers of BF entries (one per step, row offset 0).
    handles = list(bs_fwd.stored_buffers.values())
    assert handles and all(h.buffer.entries == BF and h.row_offset == 0 for h in handles)
    # Gradient loop: the weight becomes a named arg next to the accumulators.
    assert sorted(bs_grad.graph.args.keys_flat()) == ["accum.w", "mean_accum_counter", "w"]
    assert bs_grad.graph.grad_graph_info.expected_inputs == ()
    loops = [op for op in bs_fwd.graph.graph.ops if op.kind == "repeat"]
    assert len(loops) == 1 and loops[0].attrs.repeat_count == BF


@pytest.mark.parametrize("executor", EXECUTORS)
def test_batch_serialise_with_sharded_activation_buffers_matches_unsharded(executor):
    dx_plain, _, _ = _linear_plain(executor)
    dx_bs, dw_bs, _, bs_fwd, _ = _linear_serial(executor, replication=2)
    _, dw_torch = _torch_linear()
    # Every replica sees the same data: each gives the single-replica gradients.
    for r in range(2):
        np.testing.assert_allclose(dx_bs[:, r].reshape(-1, 2), dx_plain, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw_bs * BF, dw_torch, rtol=1e-5, atol=1e-6)
    sharded = [h for h in bs_fwd.stored_buffers.values() if h.shard_group is not None]
    assert sharded and all(h.buffer.meta_shape for h in sharded)
    for h in sharded:  # half of each activation per replica
        full = int(np.prod(h.buffer.meta_shape))
        assert int(np.prod(h.buffer.tensor_shape)) == full // 2


def test_batch_serialisation_lowers_peak_live_intermediates():
    _, _, peak_plain = _linear_plain("fast")
    _, _, peak_bs, _, _ = _linear_serial("fast")
    # The full-batch program holds BF micro batches of activations at once; the loop holds one
    # (the rest wait in streaming memory).
    assert peak_bs * 2 < peak_plain, (peak_plain, peak_bs)


def test_batch_serialise_argument_errors_name_the_problem():
    ir = popxl.Ir()
    with ir.main_graph:
        in_h2d = popxl.h2d_stream((CB, 2), popxl.float32, name="x_stream")
        _, graph = Scale().create_graph(in_h2d.spec)
        x_in, y_out = graph.graph.inputs[0], graph.graph.outputs[0]
        with pytest.raises(ValueError, match="steps must be a positive int"):
            batch_serialise(graph, 0, {x_in: in_h2d}, {}, {})
        with pytest.raises(ValueError, match="Unknown io_mode"):
            batch_serialise(graph, 2, {x_in: in_h2d}, {}, {}, io_mode="fast")
        with pytest.raises(TypeError, match="RemoteHandle"):
            batch_serialise(graph, 2, {x_in: "buffer"}, {}, {})
        with pytest.raises(ValueError, match="only inputs load"):
            batch_serialise(graph, 2, {y_out: in_h2d}, {}, {})
        with pytest.raises(TypeError, match="GraphWithNamedArgs"):
            batch_serialise(graph.graph, 2, {}, {}, {})
        with pytest.raises(ValueError, match="not a gradient graph"):
            batch_serialise_fwd_and_grad(graph, graph, graph.args, 2, {}, {}, {})
        dgraph = addons.autodiff(graph)
        n_graphs = len(ir.graphs)
        with pytest.raises(ValueError, match="needs a load handle"):
            batch_serialise_fwd_and_grad(graph, dgraph, graph.args, 2, {x_in: in_h2d}, {}, {})
        assert len(ir.graphs) == n_graphs  # the failed call created no graph


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("steps", [2, 3, 5])
def test_io_overlapped_builds_upstreams_prologue_loop_epilogue_schedule(steps, executor):
    """load 0; load 1 + compute 0; repeat steps-2 times (store i-2, load i, compute i-1);
    store + compute the last; store the last. Same numbers as one step at a time."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        in_h2d = popxl.h2d_stream((CB, 2), popxl.float32, name="x_stream")
        out_d2h = popxl.d2h_stream((CB, 2), popxl.float32, name="y_stream")
        args, graph = Scale().create_graph(in_h2d.spec)
        x_in, y_out = graph.graph.inputs[0], graph.graph.outputs[0]
        buffer = batch_serial_buffer(y_out, steps=steps)
        result = batch_serialise(graph, steps, {x_in: in_h2d}, {y_out: out_d2h},
                                 {y_out: RemoteHandle(buffer)}, io_mode="io_overlapped")  # fmt: skip
        result.graph.bind(args.init()).call(0)
        back = popxl.d2h_stream((CB, 2), popxl.float32, name="from_buffer")
        for i in range(steps):
            ops.host_store(back, ops.remote_load(buffer, i))
    loop_ops = result.graph.graph.ops
    calls = [op for op in loop_ops if op.kind == "call" and op.attrs.graph is graph.graph]
    repeats = [op for op in loop_ops if op.kind == "repeat"]
    assert len(calls) == 2  # compute 0 in the prologue, the last step in the epilogue
    assert [op.attrs.repeat_count for op in repeats] == ([steps - 2] if steps > 2 else [])
    ir.num_host_transfers = steps
    x = np.arange(steps * CB * 2, dtype=np.float32).reshape(steps, CB, 2)
    outputs, _ = run(ir, {in_h2d: x}, executor)
    np.testing.assert_array_equal(outputs[out_d2h], x * 2)
    np.testing.assert_array_equal(outputs[back], x * 2)


@pytest.mark.parametrize("io_mode", ["compute", "io_overlapped"])
def test_batch_serialise_seed_input_reaches_every_step(io_mode):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        in_h2d = popxl.h2d_stream((CB, 2), popxl.float32, name="x_stream")
        out_d2h = popxl.d2h_stream((CB, 2), popxl.float32, name="y_stream")

        def fn(x: popxl.Tensor, seed: popxl.Tensor) -> popxl.Tensor:
            return x + ops.reduce_sum(ops.cast(seed, popxl.float32))

        seed_spec = popxl.TensorSpec((2,), popxl.uint32)
        graph = addons.GraphWithNamedArgs(ir.create_graph(fn, in_h2d.spec, seed_spec))
        x_in, seed_in = graph.graph.inputs
        result = batch_serialise(graph, BF, {x_in: in_h2d}, {graph.graph.outputs[0]: out_d2h},
                                 {}, seed_input=seed_in, io_mode=io_mode)  # fmt: skip
        assert [t.dtype for t in result.graph.graph.inputs] == [popxl.int32, popxl.uint32]
        result.graph.call(0, popxl.constant(np.array([3, 4], np.uint32)))
    ir.num_host_transfers = BF
    outputs, _ = run(ir, {in_h2d: _inputs()})
    np.testing.assert_array_equal(outputs[out_d2h], _inputs() + 7)


# ---- popxl-addons' other handle spellings ---------------------------------------------------
# popxl-addons 3.0's batch_serialise named the row count ``entries`` and gave back
# (buffer, row_offset) tuples; 3.4 converts a handle tuple with RemoteHandle(*handle), so
# GPT-3 175B and BLOOM pass sharded activation buffers as (buffer, row_offset, grouping).


@pytest.mark.parametrize("executor", EXECUTORS)
def test_batch_serialise_entries_is_rows_and_the_call_offset_picks_the_row(executor):
    # Upstream: entry = row * steps + step; the buffer grows to steps * entries entries. Called
    # with row 1 of entries=2, the outputs land in entries BF..2*BF-1; row 0 stays zero.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        in_h2d = popxl.h2d_stream((CB, 2), popxl.float32, name="x_stream")
        args, graph = Scale().create_graph(in_h2d.spec)
        y = graph.graph.outputs[0]
        result = batch_serialise(graph, BF, {graph.graph.inputs[0]: in_h2d}, {},
                                 {y: (batch_serial_buffer(y), 0)}, entries=2)  # fmt: skip
        result.graph.bind(args.init()).call(1)
        out_buffer, offset = result.stored_buffers[y]  # 3.0's tuple unpacking
        assert offset == 0 and out_buffer.entries == 2 * BF
        rows = [popxl.d2h_stream(in_h2d.shape, in_h2d.dtype) for _ in range(2)]
        for i in range(2 * BF):
            ops.host_store(rows[i // BF], ops.remote_load(out_buffer, i))
    ir.num_host_transfers = BF
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        got = session.run({in_h2d: _inputs()})
    np.testing.assert_array_equal(got[rows[0]], np.zeros_like(_inputs()))
    np.testing.assert_array_equal(got[rows[1]], _inputs() * 2)
    with pytest.raises(TypeError, match="not both; got rows=2, entries=2"):
        batch_serialise(graph, BF, {}, {}, {}, rows=2, entries=2)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_batch_serialise_takes_sharded_buffers_as_buffer_offset_grouping_tuples(executor):
    # Each step's output is stored half per replica ((buffer, 0, grouping): sliced), then a
    # second loop loads it through the same kind of handle (gathered) and scales it again.
    R = 2
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence(True):
        in_h2d = popxl.h2d_stream((CB, 2), popxl.float32, name="x_stream")
        out_d2h = popxl.d2h_stream((CB, 2), popxl.float32, name="out_stream")
        args, graph = Scale().create_graph(in_h2d.spec)
        x, y = graph.graph.inputs[0], graph.graph.outputs[0]
        group = ir.replica_grouping(group_size=R)
        buffer = batch_serial_buffer(y, steps=BF, shard_group=group)
        fwd = batch_serialise(graph, BF, {x: in_h2d}, {}, {y: (buffer, 0, group)})
        back = batch_serialise(graph, BF, {x: (buffer, 0, group)}, {y: out_d2h}, {})
        assert fwd.stored_buffers[y] == RemoteHandle(buffer, 0, group)
        assert buffer.tensor_shape == (CB * 2 // R,)  # half of each activation per replica
        var = args.init()
        fwd.graph.bind(var).call(0)
        back.graph.bind(var).call(0)
    ir.num_host_transfers = BF
    feed = np.repeat(_inputs()[:, None], R, 1)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        got = session.run({in_h2d: feed})[out_d2h]
    np.testing.assert_array_equal(got, feed * 4)
    with pytest.raises(TypeError, match=r"\(RemoteBuffer, row_offset, ReplicaGrouping\).*'x'"):
        batch_serialise(graph, BF, {x: (buffer, 0, "x")}, {}, {})
