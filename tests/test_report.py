"""``Session.memory_report``: memory, traffic computed from the IR versus the runtime counters,
and the cost model (torch_popxl/runtime/report.py, Note [traffic formulas])."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.runtime.executor import ExecutorFacts, fragment_signature
from torch_popxl.runtime.report import TRAFFIC_KINDS, CostModel, build_report

F32 = 4


def host_store(t):
    stream = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(stream, t)
    return stream


def build_traffic_program():
    """R=4: every traffic kind, some inside a called graph and a repeat(3)."""
    ir = popxl.Ir(4)
    with ir.main_graph, popxl.in_sequence(True):
        pairs = ir.replica_grouping(group_size=2)
        x = popxl.variable(np.arange(8, dtype=np.float32))  # 32 bytes per replica
        y = popxl.variable(np.ones(10, np.float32))  # 40 bytes, ceil(10/4) = 3 per chunk
        buf = popxl.remote_buffer((8,), popxl.float32, 2)  # 32-byte slots
        popxl.remote_variable(np.ones(8, np.float32), buf, 1)
        in_stream = popxl.h2d_stream((8,), popxl.float32, "in")
        a = ops.host_load(in_stream)

        ops.collectives.replicated_all_reduce(x)  # (4/4)*2*3*32 = 192
        ops.collectives.replicated_all_reduce(x, group=pairs)  # (4/2)*2*1*32 = 128
        ops.collectives.replicated_all_gather(x)  # 4*3*32 = 384
        ops.collectives.replicated_reduce_scatter(y)  # 4*3*3*4 = 144
        ops.collectives.replica_sharded_slice(y)  # local: 0
        ops.collectives.replicated_slice(x)  # take_own: 0

        def body(t: popxl.Tensor) -> popxl.Tensor:
            loaded = ops.remote_load(buf, 1)  # 4*32 = 128 per call
            out = ops.collectives.replicated_all_reduce(t + loaded)  # 192 per call
            ops.remote_store(buf, 0, out)  # 128 per call
            return out

        g = ir.create_graph(body, a)
        (b,) = ops.call(g, a)
        (c,) = ops.repeat(g, 3, b)
        ops.remote_load_(buf, 0, c)  # 128
        host_store(c)  # 4*32 = 128
    return ir, in_stream


EXPECTED_BYTES = {
    "all_reduce": 192 + 128 + 4 * 192,
    "all_gather": 384,
    "reduce_scatter": 144,
    "local_slice": 0,
    "remote_load": 4 * 128 + 128,
    "remote_store": 4 * 128,
    "host_to_device": 128,
    "device_to_host": 128,
    "ipu_copy": 0,  # one IPU per replica: no copies between IPUs
}
EXPECTED_COUNTS = {
    "all_reduce": 2 + 4,
    "all_gather": 1,
    "reduce_scatter": 1,
    "local_slice": 2,
    "remote_load": 5,
    "remote_store": 4,
    "host_to_device": 1,
    "device_to_host": 1,
    "ipu_copy": 0,
}


def test_ir_traffic_matches_hand_formulas_and_runtime_counters():
    ir, in_stream = build_traffic_program()
    s = popxl.Session(ir, "ipu_model")
    with s:
        for _ in range(2):  # counters are reset at every run, not accumulated
            s.run({in_stream: np.ones((4, 8), np.float32)})
            report = s.memory_report()
            assert dict(report.traffic) == EXPECTED_BYTES
            assert dict(report.op_counts) == EXPECTED_COUNTS
            assert dict(report.predicted_counters) == dict(report.measured_counters)
    assert report.predicted_counters["collective_bytes"] == 192 + 128 + 4 * 192 + 384 + 144
    assert report.predicted_counters["num_collectives"] == 10
    assert report.predicted_counters["host_bytes"] == 256


def test_measured_counters_are_none_before_a_run_and_with_the_reference_executor():
    ir, in_stream = build_traffic_program()
    s = popxl.Session(ir, "ipu_model")
    assert s.memory_report().measured_counters is None
    ir, in_stream = build_traffic_program()
    s = popxl.Session(ir, "ipu_model", executor="reference")
    with s:
        s.run({in_stream: np.ones((4, 8), np.float32)})
        report = s.memory_report()
    assert report.measured_counters is None
    assert dict(report.traffic) == EXPECTED_BYTES  # the IR side does not depend on the executor


def test_build_report_reads_the_ir_the_executor_facts_and_the_counters_not_a_session():
    ir, in_stream = build_traffic_program()
    s = popxl.Session(ir, "ipu_model")
    with s:
        s.run({in_stream: np.ones((4, 8), np.float32)})
        via_session = s.memory_report()
    facts = fragment_facts(ir)
    counters = dict(via_session.measured_counters)
    report = build_report(ir, facts, counters)
    assert dict(report.measured_counters) == counters
    assert dict(report.traffic) == dict(via_session.traffic) == EXPECTED_BYTES
    assert report.variable_bytes == via_session.variable_bytes
    assert report.rts_shard_bytes == via_session.rts_shard_bytes
    # an executor whose kernels count nothing (the reference) gives no measured counters
    unmeasured = dataclasses.replace(facts, measures_traffic=False)
    assert build_report(ir, unmeasured, counters).measured_counters is None


def fragment_facts(ir) -> ExecutorFacts:
    on_chip, defined = fragment_signature(ir)
    return ExecutorFacts(tuple(on_chip), tuple(defined), measures_traffic=True)


def test_weights_transfers_are_not_counted_as_run_traffic():
    ir = popxl.Ir(2)
    with ir.main_graph:
        w, shard = popxl.replica_sharded_variable(np.ones(6, np.float32))
        host_store(shard)
    s = popxl.Session(ir, "ipu_model")
    with s:
        s.run()
        s.get_tensor_data(w)  # runs WeightsToHost (a remote_store) after the run
        report = s.memory_report()
    assert report.measured_counters["num_remote_stores"] == 0
    assert report.measured_counters["host_bytes"] == 2 * 3 * F32


def test_memory_per_replica_variables_shards_constants_and_buffers():
    ir = popxl.Ir(4)
    with ir.main_graph:
        popxl.variable(np.zeros((3, 5), np.float32))  # 60 bytes
        rg = ir.replica_grouping(group_size=2)
        popxl.variable(np.zeros((2, 7), np.int32), replica_grouping=rg)  # 28 bytes per replica
        popxl.variable(np.zeros(4, np.float16))  # 8 bytes
        popxl.replica_sharded_variable(np.zeros(10, np.float32))  # shard 3 -> 12 bytes
        popxl.constant(np.zeros(6, np.float32))  # 24 bytes
        popxl.remote_buffer((2, 3), popxl.float32, entries=5)  # 5 * 24 = 120
    s = popxl.Session(ir, "ipu_model")
    report = s.memory_report()
    assert report.variable_bytes == 60 + 28 + 8
    assert report.rts_shard_bytes == 12
    assert report.streaming_bytes == 120 + 12  # the RTS variable's own buffer: 1 entry of 3
    assert report.buffers == ((1, 1, 12), (2, 5, 24))
    assert report.constant_bytes >= 24  # plus the RTS load's offset constant
    assert report.on_chip_bytes == (
        report.variable_bytes
        + report.rts_shard_bytes
        + report.constant_bytes
        + report.peak_intermediate_bytes
    )


def test_peak_intermediates_follow_liveness_and_include_callee_peaks():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(4, np.float32))
        a = x + 1  # live: a (16)
        b = a * 2  # live: a, b (32)
        c = a + b  # live: a, b, c (48); a and b die here
        d = c * c  # live: c, d (32)

        def sub(t: popxl.Tensor) -> popxl.Tensor:
            u = ops.concat([t, t, t])  # 48
            return ops.reduce_sum(u)  # + 4 = 52 while both live

        g = ir.create_graph(sub, d)
        (e,) = ops.call(g, d)  # live while the callee runs: d (16) + 52 = 68
        host_store(e)
    report = popxl.Session(ir, "ipu_model").memory_report()
    assert report.peak_intermediate_bytes == 68


def test_matmul_flops_count_calls_and_repeats():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.ones((3, 4), np.float32))
        b = popxl.variable(np.ones((4, 5), np.float32))
        a @ b  # 2*3*4*5 = 120

        def body(t: popxl.Tensor, w: popxl.Tensor) -> popxl.Tensor:
            return t @ w  # 2*3*5*5 = 150

        sq = popxl.variable(np.ones((5, 5), np.float32))
        g = ir.create_graph(body, a @ b, sq)  # a second 120
        ops.repeat(g, 4, a @ b, sq)  # a third 120 and 4 * 150
    report = popxl.Session(ir, "ipu_model").memory_report()
    assert report.flops == 3 * 120 + 4 * 150


def test_bandwidth_only_cost_model_turns_traffic_into_step_time():
    ir, in_stream = build_traffic_program()
    s = popxl.Session(ir, "ipu_model")
    with s:
        s.run({in_stream: np.ones((4, 8), np.float32)})
    # No latencies, no per-op overhead, full matmul efficiency: bytes over rates only.
    slow_links = CostModel(replica_link_bytes_per_s=1e9, streaming_memory_bytes_per_s=1e8,
                           host_bytes_per_s=2e8, flops_per_s=1e12, op_overhead_s=0,
                           collective_step_latency_s=0, remote_latency_s=0, host_latency_s=0,
                           matmul_half_efficiency_flops=1e-30, on_chip_bytes_per_s=1e30)  # fmt: skip
    report = s.memory_report(slow_links)
    links = sum(EXPECTED_BYTES[k] for k in ("all_reduce", "all_gather", "reduce_scatter")) / 4
    remote = (EXPECTED_BYTES["remote_load"] + EXPECTED_BYTES["remote_store"]) / 4
    host = (EXPECTED_BYTES["host_to_device"] + EXPECTED_BYTES["device_to_host"]) / 4
    expected = links / 1e9 + remote / 1e8 + host / 2e8 + report.flops / 1e12
    assert report.estimated_step_time_s == pytest.approx(expected, rel=1e-12)
    default = s.memory_report()
    assert default.cost_model == CostModel()
    # Bytes this small are latency-bound: the default model's fixed costs dominate.
    assert default.estimated_step_time_s > 10 * report.estimated_step_time_s


def test_cost_model_and_report_are_frozen_and_validated():
    with pytest.raises(ValueError, match="flops_per_s must be a positive finite number"):
        CostModel(flops_per_s=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CostModel().host_bytes_per_s = 1.0
    ir, _ = build_traffic_program()
    report = popxl.Session(ir, "ipu_model").memory_report()
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.flops = 0
    with pytest.raises(TypeError):
        report.traffic["all_reduce"] = 0


def test_report_prints_as_a_table():
    ir, in_stream = build_traffic_program()
    s = popxl.Session(ir, "ipu_model")
    with s:
        s.run({in_stream: np.ones((4, 8), np.float32)})
    report = s.memory_report()
    text = str(report)
    assert "Memory per replica (4 replicas" in text
    assert "streaming memory (off-chip)" in text
    for label in ("all-reduce", "all-gather", "reduce-scatter", "loads", "stores"):
        assert label in text
    assert EXPECTED_BYTES["all_reduce"] == 1088 and "1.06 KiB" in text  # human units
    assert "Modeled device time per run" in text and "total" in text
    for kind in TRAFFIC_KINDS:  # the counters table, on request
        assert kind.split("_")[0] in report.format(counters=True)


def test_fused_matmul_all_reduce_is_counted_as_an_all_reduce():
    # The fast executor folds all_reduce(x @ w) into one fused kernel; it still counts as one
    # all-reduce of the (2, 5) product: (4/4) * 2 * 3 * 40 bytes.
    ir = popxl.Ir(4)
    with ir.main_graph:
        x = ops.host_load(popxl.h2d_stream((2, 3), popxl.float32, "x"))
        w = popxl.variable(np.ones((3, 5), np.float32))
        host_store(ops.collectives.replicated_all_reduce(x @ w))
    s = popxl.Session(ir, "ipu_model")
    with s:
        s.run({ir.get_all_h2d_streams().pop(): np.ones((4, 2, 3), np.float32)})
        report = s.memory_report()
    assert report.traffic["all_reduce"] == 240 and report.flops == 2 * 2 * 3 * 5
    assert dict(report.predicted_counters) == dict(report.measured_counters)
