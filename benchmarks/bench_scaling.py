"""Simulated replicas scale flat: the MNIST MLP step (784-512x3-10, Adam) at a fixed global
batch of 256 samples with R = 1, 4, 64 and 256 replicas (gradient accumulation and
micro-batch chosen so that R x GA x micro = 256), on chip and with sharded, off-chip optimizer
state.

Every setting first trains 3 steps and is checked against eager torch on the whole batch
(weights, rtol 1e-4: the settings sum the same gradients in different orders). Then all are
timed in interleaved rounds in one process (ms per step, median (min-max), and each one's
ratio to R = 1), and each setting's peak resident memory is measured in a fresh process of its
own (``--no-rss`` skips that). The step should take the same time at every R, since the
simulator runs the replicas as one stacked program: ``spread`` is the slowest median over the
fastest.

On a loaded machine ``--cpu-time --threads 1`` times each step by the process's CPU time on
one thread (as ``bench_peers.py``): with more runnable processes than cores, two threads wait
for each other at every parallel region and wall-clock time says little.

Usage: ``python benchmarks/bench_scaling.py [--replicas 1,4,64,256] [--rounds N] [--no-rss]
[--cpu-time] [--threads N]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from seed import LAYOUTS, make_model  # noqa: E402
from timing import describe, device_name, interleaved_samples  # noqa: E402

import torch_popxl as popxl  # noqa: E402

GLOBAL = 256
# replicas -> (gradient accumulation, micro-batch); R x GA x micro = GLOBAL
SPLITS = {1: (8, 32), 2: (8, 16), 4: (8, 8), 8: (8, 4), 16: (8, 2), 32: (8, 1), 64: (4, 1),
          128: (2, 1), 256: (1, 1)}  # fmt: skip


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(GLOBAL, 784)).astype(np.float32), rng.integers(0, 10, GLOBAL)


def build(replicas: int, layout: str):
    torch.manual_seed(0)
    model = make_model()
    ga, _ = SPLITS[replicas]
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                            torch.optim.Adam(model.parameters(), 1e-3),
                            replication_factor=replicas, gradient_accumulation=ga,
                            **LAYOUTS[layout])  # fmt: skip
    return model, trainer


def check(model, trainer, x, y, steps: int = 3) -> None:
    """``steps`` steps train as eager torch does on the whole batch. Adam's step lr * m /
    (sqrt(v) + eps) turns float32 rounding of a gradient near zero into up to one step (lr =
    1e-3) per weight, and the settings sum the same gradients in different orders, so: no
    weight further than lr from eager's, and 99.9 % of them within 1e-5 (as bench_peers)."""
    torch.manual_seed(0)
    eager = make_model()
    opt = torch.optim.Adam(eager.parameters(), 1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(steps):
        trainer.step(x, y)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(eager(xt), yt).backward()
        opt.step()
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    d = (got - torch.cat([p.detach().flatten() for p in eager.parameters()])).abs()
    close = float((d <= 1e-5).double().mean())
    if not float(d.max()) <= 1e-3 or close < 0.999:
        raise AssertionError(f"R={trainer.replication_factor} trains differently from eager: "
                             f"max |w - eager| {float(d.max()):.2e}, {100 * close:.2f} % within 1e-5")  # fmt: skip


def peak_rss_mib(replicas: int, layout: str, steps: int = 5) -> float:
    """Peak resident memory of a fresh process that builds the setting and runs ``steps``."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        str(replicas),
        layout,
        str(steps),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def child(replicas: int, layout: str, steps: int) -> None:
    x, y = data()
    _, trainer = build(replicas, layout)
    for _ in range(steps):
        trainer.step(x, y)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="1,4,64,256",
                        help=f"comma-separated replica counts, each one of {sorted(SPLITS)}")  # fmt: skip
    parser.add_argument("--layouts", default="on-chip,remote+RTS",
                        help=f"comma-separated, of {', '.join(LAYOUTS)}")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default: 10)")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time steps by process CPU time (robust on a loaded machine)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads (default: torch's own choice)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    replicas = [int(r) for r in args.replicas.split(",")]
    layouts = args.layouts.split(",")
    for r in replicas:
        if r not in SPLITS:
            parser.error(f"--replicas: {r} is not one of {sorted(SPLITS)}")
    for layout in layouts:
        if layout not in LAYOUTS:
            parser.error(f"--layouts: {layout!r} is not one of {', '.join(LAYOUTS)}")
    print(f"{device_name()}, {torch.get_num_threads()} threads; global batch {GLOBAL}, MNIST "
          f"MLP, Adam; {'CPU' if args.cpu_time else 'wall-clock'} time per step")  # fmt: skip
    x, y = data()
    fns = {}
    for layout in layouts:
        for r in replicas:
            model, trainer = build(r, layout)
            check(model, trainer, x, y)
            fns[f"{layout} R={r}"] = lambda t=trainer: t.step(x, y)
    cpu: dict[str, list[float]] = {}
    samples = interleaved_samples(fns, repeats=args.rounds, warmup=2, cpu=cpu)
    if args.cpu_time:
        samples = cpu
    for layout in layouts:
        rows = {k: v for k, v in samples.items() if k.startswith(layout + " ")}
        base = statistics.median(next(iter(rows.values())))
        medians = [statistics.median(v) for v in rows.values()]
        for (name, v), r in zip(rows.items(), replicas, strict=True):
            ga, micro = SPLITS[r]
            rss = "" if args.no_rss else f"  peak RSS {peak_rss_mib(r, layout):,.0f} MiB"
            print(f"  {name:<18} GA={ga:<2} micro={micro:<3} {describe(v)}  "
                  f"x{statistics.median(v) / base:.2f} of R={replicas[0]}{rss}")  # fmt: skip
        print(f"  {layout}: spread (slowest / fastest median) {max(medians) / min(medians):.2f}")
    return samples


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        main()
