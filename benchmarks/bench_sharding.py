"""Measured simulator step time of the sharding-study rows, as ratios with their spread.

The rows of examples/sharding_study.py (MLP 784-512-512-512-10, Adam, R=4, GA=8, micro-batch
8) are built once, then timed round-robin: every round times each row for a few steps, and
the ratio "row / no sharding" is taken within the round, so that a busy shared machine slows
both sides alike. Prints the min-max of those ratios over the rounds, next to the cost model's
ratio. Random data: the step time does not depend on the values.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch_popxl as popxl  # noqa: E402
from mnist_compile import make_model  # noqa: E402
from sharding_study import GA, MICRO, ROWS, R  # noqa: E402


def main(argv=None) -> dict[str, tuple[float, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=4, help="steps per row and round")
    args = parser.parse_args(argv)
    batch = R * GA * MICRO
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    trainers = {}
    for name, threshold, state in ROWS:
        torch.manual_seed(0)
        model = make_model()
        trainers[name] = popxl.compile(model, torch.nn.functional.cross_entropy,
                                       torch.optim.Adam(model.parameters(), 1e-3),
                                       replication_factor=R, gradient_accumulation=GA,
                                       rts_threshold=threshold, optimizer_state=state)  # fmt: skip
        trainers[name].step(x, y)  # build and warm up
    ratios: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.rounds):
        seconds = {}
        for name, trainer in trainers.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.step(x, y)
            seconds[name] = (time.perf_counter() - start) / args.steps
        base = seconds[ROWS[0][0]]
        for name in trainers:
            ratios[name].append(seconds[name] / base)
    modeled_base = trainers[ROWS[0][0]].memory_report().estimated_step_time_s
    print(f"step time relative to 'no sharding' ({args.rounds} interleaved rounds of "
          f"{args.steps} steps; measured min-max, modeled)")  # fmt: skip
    out = {}
    for name, trainer in trainers.items():
        modeled = trainer.memory_report().estimated_step_time_s / modeled_base
        lo, hi = min(ratios[name]), max(ratios[name])
        out[name] = (lo, hi, modeled)
        print(f"  {name:<36} measured {lo:.2f}-{hi:.2f}   modeled {modeled:.2f}")
    return out


if __name__ == "__main__":
    main()
