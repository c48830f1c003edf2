"""Build time and peak memory of the MNIST MLP program (784-512-512-512-10, Adam) through popxl.compile.

* Build time: seconds from ``popxl.compile`` to the end of the first step
  (capture, autodiff, program build, code generation), less one steady-state step.
* Peak RSS (item 6): each layout trains R=8 replicas in its own fresh process; the peak
  resident set of that process is compared: optimizer state sharded (RTS) and off-chip
  against everything on chip and unsharded. Also printed: the growth of the RSS over the
  process with torch and torch_popxl imported (most of the peak is the libraries), the
  training state the simulator holds between steps, and, for contrast, the on-chip variables
  that 8 IPUs would hold. The simulator stores replica-invariant state once (Note
  [replica-invariant values]), so unsharded on-chip state costs one copy, not R, and the
  sharded layout holds its shards plus the off-chip store: also one copy.

Usage: ``python benchmarks/bench_build_memory.py`` (spawns the per-layout processes itself).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

from seed import GA, LAYOUTS, batch, trainer  # noqa: E402
from timing import rounds_cli  # noqa: E402


def build_seconds(R: int, layout: dict) -> tuple[float, float]:
    """(build seconds, one steady-state step's seconds)."""
    x, y = batch(R)
    t0 = time.perf_counter()
    compiled = trainer(layout, R)
    compiled.step(x, y)
    first = time.perf_counter() - t0
    steps = []
    for _ in range(3):
        t = time.perf_counter()
        compiled.step(x, y)
        steps.append(time.perf_counter() - t)
    step = sorted(steps)[1]
    return first - step, step


def _rss_mib() -> float:
    """The process's resident set now (``/proc/self/statm``), MiB; the peak where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _held_state_mib(session) -> float:
    """MiB of the tensors the simulator holds between runs: on-chip variables (one storage for
    a replica-invariant one, R rows otherwise) and the remote buffers (off-chip store)."""
    state = session._state
    seen: dict[int, int] = {}
    for t in [*state.vars.values(), *state.persistent.values(), *state.buffers.values()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / 2**20


def peak_rss_child(layout_name: str, R: int) -> None:
    """Run in a fresh process: train two steps, print as JSON the peak RSS, the RSS the
    process had before training (torch and torch_popxl imported), and the state it holds."""
    x, y = batch(R)
    before = _rss_mib()
    compiled = trainer(LAYOUTS[layout_name], R)
    for _ in range(2):
        compiled.step(x, y)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    held = _held_state_mib(compiled.session)
    device = compiled.session.memory_report().to_dict()["memory_per_replica_bytes"]["variables"]
    print(json.dumps({"peak_rss_mib": peak, "before_mib": before, "state_mib": held,
                      "device_variables_mib": device * R / 2**20}))  # fmt: skip


def main() -> dict:
    results = {}
    for name, layout in LAYOUTS.items():
        build, step = build_seconds(4, layout)
        results[f"build_{name}"] = build
        print(f"MNIST MLP (R=4, GA={GA}) {name}: build {build:.2f} s (capture + program "
              f"build + code generation), steady step {step * 1e3:.1f} ms")  # fmt: skip
    for name in LAYOUTS:
        out = subprocess.run([sys.executable, __file__, "--rss", name, "8"], check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
        child = json.loads(out.strip().splitlines()[-1])
        results[f"rss_{name}"] = child["peak_rss_mib"]
        results[f"rss_growth_{name}"] = child["peak_rss_mib"] - child["before_mib"]
        results[f"state_{name}"] = child["state_mib"]
        results[f"device_{name}"] = child["device_variables_mib"]
    on, rts = "on-chip", "remote+RTS"
    print(f"peak RSS at R=8: on-chip unsharded {results[f'rss_{on}']:.0f} MiB, remote+RTS "
          f"{results[f'rss_{rts}']:.0f} MiB (ratio {results[f'rss_{rts}'] / results[f'rss_{on}']:.2f}); "
          f"growth over the imported process {results[f'rss_growth_{on}']:.0f} / "
          f"{results[f'rss_growth_{rts}']:.0f} MiB; training state held "
          f"{results[f'state_{on}']:.1f} / {results[f'state_{rts}']:.1f} MiB "
          f"(on-chip variables of 8 IPUs: {results[f'device_{on}']:.1f} / "
          f"{results[f'device_{rts}']:.1f} MiB)")  # fmt: skip
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rss":
        peak_rss_child(sys.argv[2], int(sys.argv[3]))
    else:
        rounds_cli(__doc__, {})  # no options: --help only
        main()
