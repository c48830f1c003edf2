"""``ops.ipu_copy`` / ``Tensor.copy_to_ipu`` (opdefs/ipu_copy.py): values, placement, misuse,
gradient, IPU-link traffic in the report and the cost model, and the per-IPU memory report
(Note [memory per IPU] in runtime/report.py)."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.runtime.cost_model import CostModel

EXECUTORS = ["fast", "reference"]
F32 = 4


def _store(t):
    stream = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(stream, t)
    return stream


@pytest.mark.parametrize("executor", EXECUTORS)
def test_ipu_copy_returns_the_value_on_the_destination_ipu(executor):
    ir = popxl.Ir(replication=2)
    data = np.arange(12, dtype=np.float32).reshape(2, 6)  # one row per replica
    with ir.main_graph, popxl.in_sequence():
        x_stream = popxl.h2d_stream((6,), popxl.float32, "x")
        with popxl.ipu(0):
            x = ops.host_load(x_stream, "x")
            y = x * 2
            moved = y.copy_to_ipu(1)
        with popxl.ipu(1):
            back = ops.ipu_copy(moved + 1, 0)
        out = _store(back)
    assert (moved.ipu, back.ipu) == (1, 0)
    assert moved.name == f"{y.name}_c1"
    with popxl.Session(ir, "ipu_model", executor=executor) as s:
        result = s.run({x_stream: data})[out]
    np.testing.assert_array_equal(result, data * 2 + 1)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_op_output_made_outside_popxl_ipu_is_on_ipu_0_as_upstream(executor):
    # Upstream's ops run on virtual graph 0 unless placed, so ipu_copy takes its source from
    # the producer; a variable has no producer and stays undefined until placed.
    ir = popxl.Ir()
    data = np.arange(4, dtype=np.float32)
    with ir.main_graph, popxl.in_sequence():
        v = popxl.variable(data, name="v")
        x = v * 3.0
        with pytest.raises(popxl.errors.UndefinedValue, match="'v' has no ipu set"):
            _ = v.ipu
        assert x.ipu == 0
        moved = ops.ipu_copy(x, 1)
        with popxl.ipu(1):
            out = _store(moved - 1.0)
    assert moved.ipu == 1
    with popxl.Session(ir, "ipu_model", executor=executor) as s:
        np.testing.assert_array_equal(s.run()[out], data * 3 - 1)


def test_ipu_copy_misuse_says_what_was_given_and_how_to_fix_it():
    ir = popxl.Ir()
    other = ir.create_empty_graph("other")
    with ir.main_graph:
        unplaced = popxl.variable(np.ones(3, np.float32), name="unplaced")
        with popxl.ipu(1):
            on1 = popxl.variable(np.ones(3, np.float32), name="on1")
        with pytest.raises(ValueError, match="already on IPU 1"):
            ops.ipu_copy(on1, 1)
        with pytest.raises(ValueError, match="could not infer the IPU.*source="):
            ops.ipu_copy(unplaced, 1)
        with pytest.raises(ValueError, match="source=0 but tensor 'on1' is on IPU 1"):
            ops.ipu_copy(on1, 2, source=0)
        for bad in (-1, True, 1.0):
            with pytest.raises(ValueError, match="destination must be a non-negative int"):
                ops.ipu_copy(on1, bad)
        with pytest.raises(TypeError, match="expects a popxl Tensor"):
            ops.ipu_copy(np.ones(3), 1)
        n_ops = len(ir.main_graph.ops)
        assert ops.ipu_copy(unplaced, 1, source=0).ipu == 1  # an explicit source is enough
        assert len(ir.main_graph.ops) == n_ops + 1  # the failed calls recorded nothing
    with other, pytest.raises(ValueError, match="not in the current graph"):
        ops.ipu_copy(on1, 0)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_gradient_through_ipu_copy_matches_eager_torch(executor):
    # f(x, w) = sum((copy_to_ipu1(x) * w)^2): autodiff's gradient equals torch's.
    x_np = np.array([0.5, -1.0, 2.0], np.float32)
    w_np = np.array([1.5, 0.25, -3.0], np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        with popxl.ipu(0):
            x = popxl.variable(x_np, name="x")
            w = popxl.variable(w_np, name="w")

        def f(x: popxl.Tensor, w: popxl.Tensor) -> popxl.Tensor:
            with popxl.ipu(1):
                y = x.copy_to_ipu(1, source=0) * w
                return ops.sum(y * y)

        with popxl.ipu(0):
            fwd = ir.create_graph(f, x, w)
        bwd_info = popxl.transforms.autodiff(fwd)
        assert any(op.name.endswith("ipu_copy") or "ipu_copy" in str(op.attrs.target)
                   for op in bwd_info.graph.ops if op.kind == "torch")  # fmt: skip
        fwd_info = ops.call_with_info(fwd, x, w)
        one = popxl.constant(np.float32(1.0))
        dx, dw = ops.call(bwd_info.graph, one, inputs_dict=bwd_info.inputs_dict(fwd_info))
        streams = (_store(dx), _store(dw))
    with popxl.Session(ir, "ipu_model", executor=executor) as s:
        out = s.run()
    xt = torch.tensor(x_np, requires_grad=True)
    wt = torch.tensor(w_np, requires_grad=True)
    ((xt * wt) ** 2).sum().backward()
    np.testing.assert_allclose(out[streams[0]], xt.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(out[streams[1]], wt.grad.numpy(), rtol=1e-6)


def _two_ipu_program(R: int = 2):
    """x (16 floats) on IPU 0, copied to IPU 1 once and three more times in a repeat."""
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        with popxl.ipu(0):
            w0 = popxl.variable(np.ones((16,), np.float32), name="w0")  # 64 B on IPU 0
            x = w0 * 3.0  # 64 B live on IPU 0
        with popxl.ipu(1):
            w1 = popxl.variable(np.ones((4, 16), np.float32), name="w1")  # 256 B on IPU 1
        with popxl.ipu(0):
            y = x.copy_to_ipu(1)  # 64 B per replica over the IPU-Links
        with popxl.ipu(1):
            z = y + w1  # [4, 16]: 256 B live on IPU 1 (with y: 64 B)

        def body(t: popxl.Tensor) -> popxl.Tensor:
            with popxl.ipu(0):
                moved = t.copy_to_ipu(1)
            with popxl.ipu(1):
                return ops.ipu_copy(moved * 2.0, 0)

        with popxl.ipu(0):
            g = ir.create_graph(body, x)
            (r,) = ops.repeat(g, 3, x)
        out = (_store(z), _store(r))
    return ir, out


def test_ipu_copy_bytes_are_ipu_link_traffic_in_the_report_and_the_cost_model():
    R = 2
    ir, (z_stream, r_stream) = _two_ipu_program(R)
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run()
    np.testing.assert_array_equal(out[z_stream], np.full((R, 4, 16), 4.0, np.float32))
    np.testing.assert_array_equal(out[r_stream], np.full((R, 16), 3.0 * 8, np.float32))
    report = s.memory_report()
    copies = 1 + 3 * 2  # one in the main graph, two per repeat iteration
    assert report.op_counts["ipu_copy"] == copies
    assert report.traffic["ipu_copy"] == copies * R * 16 * F32  # summed over replicas
    model = CostModel(ipu_link_bytes_per_s=1e9, ipu_copy_latency_s=1e-6)
    seconds = model.breakdown(report.workload)["ipu_links"]
    assert seconds == pytest.approx(copies * (1e-6 + 16 * F32 / 1e9), rel=1e-12)
    text = str(report)
    assert "IPU links (popxl.ipu placement)" in text and "ipu_copy" in text
    assert report.to_dict()["traffic_per_run_bytes"]["ipu_copy"] == copies * R * 64


def test_memory_report_splits_variables_and_peak_intermediates_per_ipu():
    ir, _ = _two_ipu_program()
    with popxl.Session(ir, "ipu_model") as s:
        s.run()
    report = s.memory_report()
    per_ipu = {m.ipu: m for m in report.ipu_memory}
    assert sorted(per_ipu) == [0, 1]
    assert per_ipu[0].variable_bytes == 64 and per_ipu[1].variable_bytes == 256
    # IPU 1: z (256 B) is stored after the repeat, so it is live while the body holds `moved`
    # and `moved * 2` (64 B each) on IPU 1; that beats `z = y + w1` (64 + 256 B).
    assert per_ipu[1].peak_intermediate_bytes == 256 + 2 * 64
    # IPU 0: x (64 B) lives to the repeat, whose body adds its own: the copy back (64 B).
    assert per_ipu[0].peak_intermediate_bytes == 64 + 64
    assert sum(m.variable_bytes for m in report.ipu_memory) == report.variable_bytes
    text = str(report)
    assert "On chip per IPU (one replica)" in text and "IPU 1" in text
    assert report.to_dict()["memory_per_ipu_bytes"]["1"] == {
        "on_chip": 256 + 384, "variables": 256, "peak_intermediates": 384}  # fmt: skip


def test_a_program_without_ipu_placement_has_no_per_ipu_section():
    ir = popxl.Ir()
    with ir.main_graph:
        _store(popxl.variable(np.ones(3, np.float32)) + 1)
    with popxl.Session(ir, "ipu_model") as s:
        s.run()
    report = s.memory_report()
    assert report.ipu_memory == () and "per IPU" not in str(report)
    assert "IPU links" not in str(report)  # no copies: the group is left out


@pytest.mark.parametrize("executor", EXECUTORS)
def test_copying_a_value_every_replica_shares_needs_no_per_replica_work(executor):
    # A variable is the same on every replica (not batched in the fast executor): its copy
    # must stay an ordinary op there, not be taken for a collective.
    ir = popxl.Ir(replication=2)
    with ir.main_graph, popxl.in_sequence():
        with popxl.ipu(0):
            w = popxl.variable(np.arange(4, dtype=np.float32), name="w")
            moved = w.copy_to_ipu(1)
        with popxl.ipu(1):
            out = _store(moved * 2.0)
    with popxl.Session(ir, "ipu_model", executor=executor) as s:
        result = s.run()[out]
    np.testing.assert_array_equal(result, np.tile(np.arange(4, dtype=np.float32) * 2, (2, 1)))
