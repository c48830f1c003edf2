"""``python -m torch_popxl plan``: the printed figures are those of ``trainer.plan`` for the same
setting, the optimizer state is the hand-computed size, and the best setting is the fastest that
fits the budget."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_popxl as popxl
from torch_popxl import plan
from torch_popxl.runtime.cost_model import CostModel

ROOT = Path(__file__).resolve().parent.parent
MLP = f"{ROOT / 'examples' / 'mnist_compile.py'}:make_model"  # the README's model
MiB = 2**20
ROW = re.compile(r"^(\*?)\s*(\d+)\s+(off|>=\d+)\s+(on_chip|remote)\s+(.*?)\s+(yes|no)$")
COLUMNS = ("variables", "shards", "state", "peak", "on_chip", "streaming", "links", "stream_io",
           "step_ms", "samples_per_s")  # fmt: skip


def table(text: str) -> dict[tuple[int, str, str], dict]:
    """The printed rows by (replicas, RTS, placement)."""
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            values = [float(v.replace(",", "")) for v in m.group(5).split()]
            row = dict(zip(COLUMNS, values, strict=True), best=m.group(1) == "*", fits=m.group(6))
            rows[(int(m.group(2)), m.group(3), m.group(4))] = row
    return rows


def report_of(model, loss_fn, optimizer, inputs, targets, **kwargs):
    """An independent build of one setting: popxl.compile and trainer.plan, as a user would."""
    trainer = popxl.compile(model, loss_fn, optimizer, keep_grads=False, **kwargs)
    trainer.plan(inputs, targets)
    return trainer.memory_report()


def assert_row_is_report(row, report, global_batch):
    R = report.num_replicas
    mib = {
        "variables": report.variable_bytes,
        "shards": report.rts_shard_bytes,
        "peak": report.peak_intermediate_bytes,
        "on_chip": report.on_chip_bytes,
        "streaming": report.streaming_bytes,
        "links": sum(report.traffic[k] for k in ("all_reduce", "all_gather", "reduce_scatter")) / R,
        "stream_io": (report.traffic["remote_load"] + report.traffic["remote_store"]) / R,
    }
    for name, nbytes in mib.items():
        assert row[name] == pytest.approx(nbytes / MiB, abs=0.006), name
    step = report.estimated_step_time_s
    assert row["step_ms"] == pytest.approx(step * 1e3, abs=0.006)
    assert row["samples_per_s"] == pytest.approx(global_batch / step, abs=0.6)


def test_mlp_table_matches_trainer_plan_and_hand_computed_state(capsys):
    rows = plan.main([MLP, "--input", "8x784:float32", "--target", "8:int64",
                      "--gradient-accumulation", "2", "--replicas", "1,2"])  # fmt: skip
    printed = table(capsys.readouterr().out)
    assert set(printed) == {
        (1, "off", "on_chip"), (1, "off", "remote"), (2, "off", "on_chip"),
        (2, "off", "remote"), (2, ">=512", "on_chip"), (2, ">=512", "remote"),
    }  # fmt: skip
    assert len(rows) == 6
    spec = importlib.util.spec_from_file_location(
        "mnist_compile", ROOT / "examples" / "mnist_compile.py"
    )
    mnist_compile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mnist_compile)
    torch.manual_seed(0)
    model = mnist_compile.make_model()
    x, y = torch.randn(2 * 2 * 8, 784), torch.zeros(2 * 2 * 8, dtype=torch.int64)
    report = report_of(
        model, torch.nn.functional.cross_entropy, torch.optim.Adam(model.parameters()), x, y,
        replication_factor=2, gradient_accumulation=2, rts_threshold=512, optimizer_state="remote",
    )  # fmt: skip
    assert_row_is_report(printed[(2, ">=512", "remote")], report, global_batch=32)
    # Adam keeps two float32 tensors per parameter; at threshold 512 every tensor of the MLP
    # but the last bias (10 elements) is split over the 2 replicas.
    sizes = [p.numel() for p in model.parameters()]
    sharded = sum(n for n in sizes if n >= 512)
    unsharded = sum(n for n in sizes if n < 512)
    assert unsharded == 10
    want = 2 * 4 * (sharded / 2 + unsharded)
    for placement in ("on_chip", "remote"):
        assert printed[(2, ">=512", placement)]["state"] == pytest.approx(want / MiB, abs=0.006)
    assert printed[(1, "off", "on_chip")]["state"] == pytest.approx(
        2 * 4 * sum(sizes) / MiB, abs=0.006
    )
    # The default budget is one GC200's memory; everything fits, and the best is the fastest.
    fastest = max(printed.values(), key=lambda r: r["samples_per_s"])
    assert fastest["best"] and sum(r["best"] for r in printed.values()) == 1


def test_best_is_fastest_within_the_budget(capsys):
    rows = plan.main([MLP, "--input", "8x784", "--target", "8:int64", "--replicas", "2",
                      "--budget", "15MiB"])  # fmt: skip
    out = capsys.readouterr().out
    fitting = [r for r in rows if r.on_chip_bytes <= 15 * MiB]
    assert 0 < len(fitting) < len(rows)  # the budget excludes some settings
    chosen = plan.best(rows, 15 * MiB)
    assert chosen is max(fitting, key=lambda r: r.samples_per_s)
    assert f"* best that fits: {chosen.setting.label()}" in out
    for r in rows:
        assert table(out)[(2, "off" if r.setting.rts_threshold is None else ">=512",
                           r.setting.optimizer_state)]["fits"] == ("yes" if r in fitting else "no")  # fmt: skip
    assert plan.best(rows, 1 * MiB) is None
    assert "No setting fits 1.0 MiB" in plan.format_table(rows, 1 * MiB)


def test_hf_gpt2_config_table_matches_trainer_plan(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    small = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 500, "n_positions": 64}
    argv = ["--hf-config", "gpt2", "--seq-len", "16", "--replicas", "2", "--state", "remote",
            "--optimizer", "AdamW", "--chart", str(tmp_path / "plan.png")]  # fmt: skip
    for key, value in small.items():
        argv += ["--set", f"{key}={value}"]
    plan.main(argv)
    out = capsys.readouterr().out
    printed = table(out)
    assert set(printed) == {(2, "off", "remote"), (2, ">=512", "remote")}
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**small))
    ids = torch.zeros(2, 16, dtype=torch.int64)  # two replicas' micro-batches of one sequence
    report = report_of(
        model, None, torch.optim.AdamW(model.parameters()), {"input_ids": ids, "labels": ids}, None,
        replication_factor=2, rts_threshold=512, optimizer_state="remote",
    )  # fmt: skip
    assert_row_is_report(printed[(2, ">=512", "remote")], report, global_batch=2)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "plan.png").stat().st_size > 10_000
        assert f"chart: {tmp_path / 'plan.png'}" in out


def test_table_names_the_modeled_device_and_budget(capsys):
    plan.main(
        [MLP, "--input", "8x784", "--target", "8:int64", "--replicas", "1", "--state", "on_chip"]
    )
    out = capsys.readouterr().out
    assert f"on one {CostModel.DEVICE}" in out
    assert f"budget {CostModel.DEVICE_MEMORY_BYTES / MiB:,.1f} MiB" in out
    assert CostModel.DEVICE_MEMORY_BYTES == 1472 * 624 * 1024  # GC200: 1472 tiles x 624 KiB


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input", "8by784"], "[NAME=]SHAPE[:DTYPE]"),
        (["--input", "8x784:float33"], "got '8x784:float33'"),
        (["--budget", "9 parsecs"], "a memory size is a number"),
        (["--rts-threshold", "-3"], "an RTS threshold is 'off' or a positive"),
    ],
)
def test_bad_arguments_say_what_was_given_and_expected(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        plan.main([MLP, "--target", "8:int64", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_model_and_optimizer_are_clear_errors():
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        plan.load_factory("just_a_module")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        plan.load_factory(f"{ROOT / 'examples' / 'mnist_compile.py'}:nope")
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'.*adamw"):
        plan.sweep(
            lambda: torch.nn.Linear(2, 2), [plan.parse_tensor_spec("4x2")], optimizer="adamm"
        )
    assert plan.parse_size("900MB") == 900_000_000 and plan.parse_size("2GiB") == 2 * 2**30


def test_command_line_help_lists_plan_and_the_matmul_kernel():
    from torch_popxl.runtime import gemm

    out = subprocess.run([sys.executable, "-m", "torch_popxl", "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "plan" in out.stdout and "env" in out.stdout
    assert f"matmul kernel on this machine: {gemm.kernel()}" in out.stdout
    out = subprocess.run([sys.executable, "-m", "torch_popxl", "plan", "--help"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0 and "--hf-config" in out.stdout and "--budget" in out.stdout
    out = subprocess.run([sys.executable, "-m", "torch_popxl", "env"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert re.search(rf"^matmul kernel\s+{gemm.kernel()} \(", out.stdout, re.M), out.stdout


def test_plan_errors_exit_2_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "torch_popxl", "plan", "no_such_module_xyz:f",
                          "--input", "2x2"], capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: No module named 'no_such_module_xyz'")


BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))


@pytest.mark.parametrize("script", BENCHMARKS)
def test_every_benchmark_answers_help(script):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.lower().startswith("usage")
