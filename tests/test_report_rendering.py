"""The memory report for people: placements that match the program (sharded state shown as
sharded on chip and off-chip), savings against the same program unsharded and on chip, human
units, ``to_dict`` and ``plot`` (torch_popxl/runtime/report.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.runtime.report import format_bytes, format_seconds


def placement_program():
    """R=4 with every kind of placement; per-replica bytes in the comments."""
    ir = popxl.Ir(4)
    with ir.main_graph:
        popxl.variable(np.zeros((3, 5), np.float32))  # full copy: 60
        # On-chip RTS: a 3-element shard (12) on chip; its 1-entry home in streaming memory (12).
        popxl.replica_sharded_variable(np.zeros(10, np.float32))
        # Off-chip RTS: 2 slots of ceil(16 / 4) = 4 elements (32), full copies would be 2 * 64.
        buf = popxl.replica_sharded_buffer((16,), popxl.float32, entries=2)
        popxl.remote_replica_sharded_variable(np.zeros(16, np.float32), buf, 0)
        popxl.remote_buffer((2, 3), popxl.float32, entries=5)  # unsharded off-chip: 5 * 24
    return popxl.Session(ir, "ipu_model")


def test_placements_and_savings_match_hand_counts():
    report = placement_program().memory_report()
    assert report.variable_bytes == 60
    assert report.rts_shard_bytes == 12
    assert report.backing_streaming_bytes == 12
    assert report.sharded_streaming_bytes == 2 * 16
    assert report.unsharded_streaming_bytes == 5 * 24
    assert report.streaming_bytes == 12 + 32 + 120
    assert report.shard_counts == (4,)
    # Full copies: (40 - 12) for the on-chip RTS variable, 2 * (64 - 16) for the off-chip one.
    assert report.rts_saved_bytes == 28 + 96
    assert report.offchip_bytes == 32 + 120  # the home of on-chip shards is not "moved"
    assert report.unsharded_on_chip_bytes == report.on_chip_bytes + 124 + 152


def test_text_uses_human_units_and_states_the_savings():
    report = placement_program().memory_report()
    text = str(report)
    assert "sharded variables (RTS, 1/4 on each replica)" in text
    assert "sharded state (RTS, 1/4 on each replica)" in text
    assert "unsharded state" in text and "home of the on-chip RTS shards" in text
    assert "RTS saves 124 B per replica; off-chip moves 152 B to streaming memory." in text
    assert "Counters" not in text and "num_collectives" not in text  # internal: on request
    with_counters = report.format(counters=True)
    assert "Counters (IR vs runtime)" in with_counters and "num_collectives" in with_counters


def test_program_without_sharding_or_remote_state_says_so():
    ir = popxl.Ir(2)
    with ir.main_graph:
        popxl.variable(np.zeros(8, np.float32))
    report = popxl.Session(ir, "ipu_model").memory_report()
    assert report.unsharded_on_chip_bytes == report.on_chip_bytes
    assert "Nothing is sharded or off-chip" in str(report)
    assert "sharded variables" not in str(report) and "sharded state" not in str(report)


def test_human_units():
    assert format_bytes(136) == "136 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(803_840) == "785.0 KiB"
    assert format_bytes(7_458_900) == "7.11 MiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_seconds(583.83e-6) == "583.8 µs"
    assert format_seconds(0.0021) == "2.1 ms"
    assert format_seconds(5e-8) == "50.0 ns"


def test_to_dict_is_json_and_agrees_with_the_fields():
    session = placement_program()
    report = session.memory_report()
    d = json.loads(json.dumps(report.to_dict()))
    mem = d["memory_per_replica_bytes"]
    assert mem["on_chip"] == report.on_chip_bytes
    assert mem["streaming"] == (
        mem["streaming_sharded"]
        + mem["streaming_unsharded"]
        + mem["streaming_home_of_on_chip_shards"]
    )
    assert d["savings_per_replica_bytes"] == {
        "unsharded_on_chip": report.unsharded_on_chip_bytes,
        "rts_saved": 124,
        "moved_off_chip": 152,
    }
    time = d["modeled_time_s"]
    assert time["total"] == pytest.approx(report.estimated_step_time_s)
    assert time["total"] == pytest.approx(sum(v for k, v in time.items() if k != "total"))
    assert d["counters"]["runtime"] is None  # no run yet


def test_plot_draws_memory_and_time(tmp_path):
    pytest.importorskip("matplotlib")
    report = placement_program().memory_report()
    fig = report.plot(tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 10_000
    mem_ax, time_ax = fig.axes
    assert mem_ax.get_title() == "Memory per replica"
    assert len(time_ax.patches) == len(report.time_breakdown_s)


def _trainer(rts_threshold, state):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    trainer = popxl.compile(
        model,
        torch.nn.functional.cross_entropy,
        torch.optim.Adam(model.parameters(), lr=1e-3),
        replication_factor=4,
        rts_threshold=rts_threshold,
        optimizer_state=state,
    )
    g = torch.Generator().manual_seed(0)
    trainer.step(torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g))
    return trainer.memory_report()


def test_compile_placements_follow_the_options_and_the_baseline_is_the_unsharded_program():
    plain = _trainer(None, "on_chip")
    on_chip_rts = _trainer(64, "on_chip")
    remote_rts = _trainer(64, "remote")
    # Adam keeps 2 state tensors per parameter; weights (12*32, 32*4) have >= 64 elements.
    state_full = 2 * 4 * (12 * 32 + 32 * 4)
    state_shards = state_full // 4
    assert on_chip_rts.rts_shard_bytes == state_shards
    assert on_chip_rts.backing_streaming_bytes == state_shards
    assert on_chip_rts.rts_saved_bytes == state_full - state_shards
    assert remote_rts.rts_shard_bytes == 0
    assert remote_rts.sharded_streaming_bytes == state_shards
    assert remote_rts.unsharded_streaming_bytes == 2 * 4 * (32 + 4)  # the biases' state
    assert remote_rts.rts_saved_bytes == state_full - state_shards
    assert "sharded state (RTS, 1/4 on each replica)" in str(remote_rts)
    assert "sharded variables (RTS, 1/4 on each replica)" in str(on_chip_rts)
    # Persistent bytes of "the same program unsharded and on chip" are the unsharded on-chip
    # program's (intermediates differ: loads and all-gathers add their own).
    for report in (on_chip_rts, remote_rts):
        persistent = report.unsharded_on_chip_bytes - report.peak_intermediate_bytes
        assert persistent - report.constant_bytes == plain.variable_bytes


def test_readme_program_report_shows_the_sharded_weight():
    ir = popxl.Ir(replication=4)
    with ir.main_graph, popxl.in_sequence():
        _, w_shard = popxl.replica_sharded_variable(np.ones((3, 4), np.float32), name="w")
        ops.collectives.replicated_all_gather(w_shard)
    report = popxl.Session(ir, "ipu_hw").memory_report()
    assert report.rts_shard_bytes == 3 * 4  # 3 of the 12 elements per replica
    assert "sharded variables (RTS, 1/4 on each replica)          12 B" in str(report)
