"""torchvision's resnet18 through popxl.compile versus eager torch on the same schedule.

resnet18 (10 classes) on 32x32 inputs, SGD with momentum; 2 replicas x micro-batch 8,
gradient accumulation 2 (32 images per optimizer step), optimizer state on chip. BatchNorm
keeps per-micro-batch, per-replica statistics as on the device (the eager schedule runs the
same micro-batches of 8). Prints build seconds, ms per step as median (min-max) over
interleaved rounds, eager/simulator (>= 1: the simulator is faster) and any vmap fallback.
Skips with a message when torchvision is not installed.

Usage: ``python benchmarks/bench_resnet.py [rounds]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
from timing import describe, interleaved_samples, ratio, rounds_cli  # noqa: E402

R, GA, MICRO = 2, 2, 8


def make_model() -> torch.nn.Module:
    import torchvision  # optional: not a dependency of the project

    return torchvision.models.resnet18(num_classes=10)


def main(repeats: int = 5) -> dict[str, float] | None:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        print("bench_resnet: torchvision is not installed; skipped.")
        return None
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(R * GA * MICRO, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, R * GA * MICRO)
    model = make_model()
    t0 = time.perf_counter()
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                            torch.optim.SGD(model.parameters(), 1e-2, momentum=0.9),
                            replication_factor=R, gradient_accumulation=GA)  # fmt: skip
    trainer.step(x, y)
    build = time.perf_counter() - t0
    eager_model = make_model()
    opt = torch.optim.SGD(eager_model.parameters(), 1e-2, momentum=0.9)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def eager_schedule():  # micro-batches of 8 (one replica's), mean over the 4 of them
        opt.zero_grad()
        for xc, yc in zip(xt.split(MICRO), yt.split(MICRO), strict=True):
            (torch.nn.functional.cross_entropy(eager_model(xc), yc) / (R * GA)).backward()
        opt.step()

    cpu: dict[str, list[float]] = {}
    s = interleaved_samples({"simulator": lambda: trainer.step(x, y), "eager": eager_schedule},
                            repeats, warmup=1, cpu=cpu)  # fmt: skip
    fallbacks = trainer.explain()
    print(f"resnet18 (32x32, R={R}, GA={GA}, micro-batch {MICRO}, SGD momentum), median (min-max):")
    print(f"  eager same schedule      {describe(s['eager'])}")
    print(f"  popxl.compile on-chip    {describe(s['simulator'])}: eager / simulator "
          f"{ratio(s['eager'], s['simulator'])}; build {build - statistics.median(s['simulator']):.2f} s; "
          f"vmap fallback: {'; '.join(fallbacks) if fallbacks else 'none'}")  # fmt: skip
    print(
        f"  CPU time per step: eager {describe(cpu['eager'])}, simulator "
        f"{describe(cpu['simulator'])}; eager / simulator {ratio(cpu['eager'], cpu['simulator'])}"
    )
    return {k: statistics.median(v) for k, v in s.items()}


if __name__ == "__main__":
    main(rounds_cli(__doc__, {"rounds": 5}).rounds)
