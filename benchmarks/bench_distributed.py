"""The simulator against torch.distributed on one data-parallel training step.

Same program (popxl.compile of a 784-512-512-512-10 GELU MLP with Adam, R=4 replicas, 32
samples per replica) run three ways on this machine:

* the simulator: one process holding all 4 replicas (vmap);
* 2 gloo processes x 2 replicas, and 4 gloo processes x 1 replica, under torchrun.

    python benchmarks/bench_distributed.py [--steps 30] [--worlds 2 4]

Prints the median step time of each, the ratio to the simulator, and the launch overhead
(process start to first step). On a 2-core machine expect the simulator to win: the processes
oversubscribe the cores and pay for gloo copies.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import torch_popxl as popxl
from torch_popxl.runtime import distributed

R, MICRO = 4, 32


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 10),
    )  # fmt: skip


def _time_steps(steps: int, warmup: int = 3) -> dict:
    """Median seconds per Trainer.step; every instance feeds its share of one global batch."""
    model = _model()
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                            torch.optim.Adam(model.parameters(), lr=1e-3), replication_factor=R)  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.standard_normal((R * MICRO, 784)).astype(np.float32)
    t = rng.integers(0, 10, R * MICRO).astype(np.int64)
    xs, ts = distributed.instance_batch(x, R), distributed.instance_batch(t, R)
    samples, losses = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        losses.append(trainer.step(xs, ts))
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(samples),
        "final_loss": losses[-1],
        "threads": torch.get_num_threads(),
    }


def _worker(out: Path, steps: int) -> None:
    started = float(os.environ["BENCH_LAUNCHED_AT"])
    distributed.num_instances()  # start the process group
    first = time.time() - started
    result = _time_steps(steps)
    result["launch_s"] = first
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "BENCH_LAUNCHED_AT": repr(time.time()), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", __file__,
               "--worker", str(out), "--steps", str(steps)]  # fmt: skip
        start = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        wall = time.time() - start
        if proc.returncode != 0:
            raise RuntimeError(
                f"torchrun with {world} processes failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        result = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.worker, args.steps)
        return

    sim = _time_steps(args.steps)
    rows = [("simulator, 1 process x 4 replicas", sim)]
    for world in args.worlds:
        rows.append(
            (f"gloo, {world} processes x {R // world} replica(s)", _launch(world, args.steps))
        )
    print(f"MLP 784-512-512-512-10, Adam, R={R}, {MICRO} samples/replica, median of {args.steps} steps, "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(f"{'':38}{'ms/step':>9}{'vs sim':>8}{'threads':>9}{'launch s':>10}{'final loss':>12}")
    for name, r in rows:
        launch = f"{r['launch_s']:.1f}" if "launch_s" in r else "-"
        print(f"{name:38}{r['median_s'] * 1e3:9.1f}{r['median_s'] / sim['median_s']:7.2f}x"
              f"{r['threads']:9d}{launch:>10}{r['final_loss']:12.4g}")  # fmt: skip


if __name__ == "__main__":
    main()
