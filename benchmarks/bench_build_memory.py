"""Build time and peak memory of the seed MNIST program through popxl.compile.

* Build time (issue 14 item 5): seconds from ``popxl.compile`` to the end of the first step
  (capture, autodiff, program build, code generation), less one steady-state step.
* Peak RSS (item 6): each layout trains R=8 replicas in its own fresh process; the peak
  resident set of that process is compared: optimizer state sharded (RTS) and off-chip
  against everything on chip and unsharded.

Usage: ``python benchmarks/bench_build_memory.py`` (spawns the per-layout processes itself).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch_popxl as popxl  # noqa: E402
from mnist_compile import make_model  # noqa: E402

GA, MICRO = 8, 8
LAYOUTS = {
    "on-chip": {},
    "remote+RTS": {"rts_threshold": 512, "optimizer_state": "remote"},
}


def _data(R: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(R * GA * MICRO, 784)).astype(np.float32)
    return x, rng.integers(0, 10, R * GA * MICRO)


def _trainer(R: int, layout: dict):
    model = make_model()
    return popxl.compile(model, torch.nn.functional.cross_entropy,
                         torch.optim.Adam(model.parameters(), 1e-3), replication_factor=R,
                         gradient_accumulation=GA, **layout)  # fmt: skip


def build_seconds(R: int, layout: dict) -> tuple[float, float]:
    """(build seconds, one steady-state step's seconds)."""
    x, y = _data(R)
    t0 = time.perf_counter()
    trainer = _trainer(R, layout)
    trainer.step(x, y)
    first = time.perf_counter() - t0
    steps = []
    for _ in range(3):
        t = time.perf_counter()
        trainer.step(x, y)
        steps.append(time.perf_counter() - t)
    step = sorted(steps)[1]
    return first - step, step


def peak_rss_child(layout_name: str, R: int) -> None:
    """Run in a fresh process: train two steps, print the peak RSS in MiB as JSON."""
    x, y = _data(R)
    trainer = _trainer(R, LAYOUTS[layout_name])
    for _ in range(2):
        trainer.step(x, y)
    print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> dict:
    results = {}
    for name, layout in LAYOUTS.items():
        build, step = build_seconds(4, layout)
        results[f"build_{name}"] = build
        print(f"seed MNIST (R=4, GA={GA}) {name}: build {build:.2f} s (capture + program "
              f"build + code generation), steady step {step * 1e3:.1f} ms")  # fmt: skip
    for name in LAYOUTS:
        out = subprocess.run([sys.executable, __file__, "--rss", name, "8"], check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        results[f"rss_{name}"] = json.loads(out.strip().splitlines()[-1])["peak_rss_mib"]
    print(f"peak RSS at R=8: on-chip unsharded {results['rss_on-chip']:.0f} MiB, remote+RTS "
          f"{results['rss_remote+RTS']:.0f} MiB (ratio {results['rss_remote+RTS'] / results['rss_on-chip']:.2f})")  # fmt: skip
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rss":
        peak_rss_child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
