"""``addons.pipelined_execution`` (addons/transforms/pipelining.py, Note [pipelining]): the
fill / main / flush schedule, stashes, gradient accumulation through the pipeline against the
sequential program and eager torch, the per-IPU memory and ipu_copy traffic of the schedule,
and misuse errors."""

from functools import partial

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl import ops
from torch_popxl.addons.transforms.autodiff import autodiff_with_accumulation

EXECUTORS = ["fast", "reference"]


def _run_chain(num_stages: int, steps: int, executor: str) -> np.ndarray:
    ir = popxl.Ir()
    inputs = np.arange(steps).reshape(-1, 1).astype(np.uint32)
    with ir.main_graph:
        in_stream = popxl.h2d_stream((), popxl.uint32)
        out_stream = popxl.d2h_stream((), popxl.uint32)
        with addons.pipelined_execution(steps) as p:
            with p.stage(0), popxl.ipu(0):
                x = ops.host_load(in_stream)
            for s in range(num_stages):
                with p.stage(s), popxl.ipu(s):
                    x = x + 1
                    if s + 1 < num_stages:
                        x = x.copy_to_ipu(s + 1)
            with p.stage(num_stages - 1), popxl.ipu(num_stages - 1):
                ops.host_store(out_stream, x)
    ir.num_host_transfers = steps
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        return session.run({in_stream: inputs})[out_stream].reshape(-1)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("num_stages", [2, 4])
def test_each_micro_batch_passes_every_stage_once_in_order(executor, num_stages):
    steps = 10
    np.testing.assert_array_equal(
        _run_chain(num_stages, steps, executor), np.arange(steps) + num_stages
    )


class Linear(addons.Module):
    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        x = x + 1
        w = self.add_variable_input(
            "weight", partial(np.random.normal, 0, 0.5, (x.shape[-1], self.out_features)), x.dtype
        )
        return x @ w


STEPS = 6


def _data():
    return np.random.default_rng(7).normal(0, 1, (STEPS, 2, 4)).astype(np.float32)


def _sequential(executor: str):
    """The training step unpipelined: one run per micro batch, as upstream's reference."""
    np.random.seed(42)
    ir = popxl.Ir()
    data = _data()
    with ir.main_graph, popxl.in_sequence(True):
        with popxl.ipu(0):
            _, x_stream, x = addons.host_load(data[0], popxl.float32, "x")
            args, fwd = Linear(4).create_graph(x)
            dargs, bwd = autodiff_with_accumulation(fwd, [fwd.args.weight])
            linear, dlinear = args.init(), dargs.init()
            info = fwd.bind(linear).call_with_info(x)
            y = info.outputs[0].copy_to_ipu(1)
        with popxl.ipu(1):
            y = y * y
            y = y.copy_to_ipu(0)
        with popxl.ipu(0):
            bwd.bind(dlinear).call(y, args=bwd.grad_graph_info.inputs_dict(info))
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        for n in range(STEPS):
            session.run({x_stream: data[n]})
        return session.get_tensor_data(dlinear.accum.weight).copy(), session.get_tensor_data(
            linear.weight
        ).copy()


def _pipelined(executor: str, stash: bool = True):
    np.random.seed(42)
    ir = popxl.Ir()
    data = _data()
    with ir.main_graph, popxl.in_sequence(True):
        with addons.pipelined_execution(STEPS) as p:
            with p.stage(0), popxl.ipu(0):
                _, x_stream, x = addons.host_load(data[0], popxl.float32, "x")
                args, fwd = Linear(4).create_graph(x)
                dargs, bwd = autodiff_with_accumulation(fwd, [fwd.args.weight])
                linear, dlinear = args.init(), dargs.init()
                info = fwd.bind(linear).call_with_info(x)
                y = info.outputs[0].copy_to_ipu(1)
            with p.stage(1), popxl.ipu(1):
                y = y * y
                y = y.copy_to_ipu(0)
            with p.stage(2), popxl.ipu(0):
                acts = bwd.grad_graph_info.inputs_dict(info)
                if stash:
                    acts = p.stash_and_restore_activations(info, bwd.grad_graph_info)
                bwd.bind(dlinear).call(y, args=acts)
    ir.num_host_transfers = STEPS
    session = popxl.Session(ir, "ipu_hw", executor=executor)
    with session:
        session.run({x_stream: data})
    return session, dlinear, linear


@pytest.mark.parametrize("executor", EXECUTORS)
def test_pipelined_gradient_accumulation_equals_the_sequential_program(executor):
    accum_seq, weight = _sequential(executor)
    session, dlinear, linear = _pipelined(executor)
    accum = session.get_tensor_data(dlinear.accum.weight)
    np.testing.assert_allclose(accum, accum_seq, rtol=1e-6, atol=1e-7)
    # and eager torch: d/dW of sum over micro batches of sum(((x + 1) W)^2), averaged
    # (autodiff_with_accumulation keeps a running mean, seeded with dy = y^2's value)
    w = torch.tensor(weight, requires_grad=True)
    total = torch.zeros_like(w)
    for x in torch.tensor(_data()):
        y = (x + 1) @ w
        (g,) = torch.autograd.grad(y, w, grad_outputs=y * y)
        total += g
    np.testing.assert_allclose(accum, (total / STEPS).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(session.get_tensor_data(dlinear.mean_accum_counter), STEPS)


def test_without_a_stash_the_gradient_stage_sees_another_micro_batch():
    # Upstream's reason for stashes: the forward stage has moved on by the time the gradient
    # stage runs, so passing the activation directly gives different (wrong) numbers.
    accum_seq, _ = _sequential("fast")
    session, dlinear, _ = _pipelined("fast", stash=False)
    assert not np.allclose(session.get_tensor_data(dlinear.accum.weight), accum_seq, rtol=1e-3)


def test_the_report_shows_the_schedules_copies_and_the_stash_per_ipu():
    session, dlinear, linear = _pipelined("fast")
    report = session.memory_report()
    stages = 3
    copies_run = STEPS + stages - 2  # every cycle but the last copies (Note [pipelining])
    copy_bytes = 2 * 4 * 4  # each copy moves one [2, 4] float32 micro batch
    assert report.op_counts["ipu_copy"] == 2 * copies_run
    assert report.traffic["ipu_copy"] == 2 * copies_run * copy_bytes
    per_ipu = {m.ipu: m for m in report.ipu_memory}
    assert sorted(per_ipu) == [0, 1]
    # IPU 0 holds the weight, its accumulator and counter, and the stash of the activation x
    # ([2, 4] float32, 3 slots: stage 2 - stage 0 + 1) with its two uint32 counters.
    weight = accum = 4 * 4 * 4
    stash = 3 * 2 * 4 * 4 + 2 * 4
    assert per_ipu[0].variable_bytes == weight + accum + 4 + stash
    assert per_ipu[1].variable_bytes == 0
    assert per_ipu[1].peak_intermediate_bytes > 0  # the squares live on IPU 1
    text = str(report)
    assert "On chip per IPU" in text and "ipu_copy" in text


def test_ops_outside_a_stage_and_too_few_steps_are_refused():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(2, np.float32))
        with pytest.raises(RuntimeError, match="created outside a stage"):
            with addons.pipelined_execution(4):
                x + 1
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(2, np.float32))
        n_ops = len(ir.main_graph.ops)
        with pytest.raises(ValueError, match=r"at least 2x the number of stages.*steps=3 stages=2"):
            with addons.pipelined_execution(3) as p:
                with p.stage(0), popxl.ipu(0):
                    y = (x + 1).copy_to_ipu(1)
                with p.stage(1), popxl.ipu(1):
                    y + 1
        assert len(ir.main_graph.ops) == n_ops + 3  # refused before anything moved
        with pytest.raises(ValueError, match="numbered 0..S-1 without gaps; got \\[0, 2\\]"):
            with addons.pipelined_execution(8) as p:
                with p.stage(0):
                    x + 1
                with p.stage(2):
                    x + 2
        for bad in (0, True, 2.0):
            with pytest.raises(ValueError, match="positive int"):
                with addons.pipelined_execution(bad):
                    pass
        with addons.pipelined_execution(4) as p:
            with pytest.raises(ValueError, match="non-negative int"):
                with p.stage(-1):
                    pass
            with p.stage(0):
                z = x + 1
            with pytest.raises(RuntimeError, match="in a `p.stage"):
                p.stash_and_restore_tensor(z)
            with p.stage(1):
                z + 1


def test_the_addons_namespaces_export_pipelined_execution():
    assert addons.pipelined_execution is addons.transforms.pipelined_execution
    assert addons.transforms.pipelining.pipelined_execution is addons.pipelined_execution


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_stashed_tensor_comes_back_for_its_own_micro_batch(executor):
    # Stage 0 loads x, stage 2 (two cycles later, same IPU) reads it back through a 3-slot
    # stash: each micro batch gets its own x, not the one stage 0 is loading now.
    steps = 7
    ir = popxl.Ir()
    with ir.main_graph:
        in_stream = popxl.h2d_stream((2,), popxl.float32, "x")
        out_stream = popxl.d2h_stream((2,), popxl.float32, "y")
        with addons.pipelined_execution(steps) as p:
            with p.stage(0), popxl.ipu(0):
                x = ops.host_load(in_stream)
                y = (x * 10).copy_to_ipu(1)
            with p.stage(1), popxl.ipu(1):
                y = (y + 1).copy_to_ipu(0)
            with p.stage(2), popxl.ipu(0):
                x_again = p.stash_and_restore_tensor(x)
                ops.host_store(out_stream, y - x_again)
            with p.stage(2), pytest.raises(ValueError, match="pass from_stage"):
                p.stash_and_restore_tensor(popxl.variable(np.ones(2, np.float32)))
    ir.num_host_transfers = steps
    data = np.arange(2 * steps, dtype=np.float32).reshape(steps, 2)
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        out = session.run({in_stream: data})[out_stream]
    np.testing.assert_allclose(out, data * 9 + 1)
