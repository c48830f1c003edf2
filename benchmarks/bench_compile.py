"""The MNIST MLP configuration through popxl.compile versus eager torch, side by side.

MLP 784-512-512-512-10 (GELU), Adam; 4 replicas x micro-batch 8, gradient accumulation 8
(256 samples per optimizer step), in two layouts: everything on chip, and optimizer state
sharded (threshold 512) and off-chip. Eager references: the same schedule (8 micro-batches of
32, one Adam step) and one batch of 256. All programs are timed interleaved in one process;
prints ms per step as median (min-max), the ratios eager/simulator (>= 1: the simulator is
faster), and whether a program falls back to vmap (Note [explicit batching]).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from seed import GA, LAYOUTS, MICRO, R, batch, make_model, trainer  # noqa: E402
from timing import (  # noqa: E402
    add_aten_kernel_row,
    describe,
    interleaved_samples,
    print_aten_kernel_row,
    ratio,
    rounds_cli,
)


def main(repeats: int = 10) -> dict[str, float]:
    torch.manual_seed(0)
    x, y = batch()
    trainers = {name: trainer(layout) for name, layout in LAYOUTS.items()}
    eager_model = make_model()
    opt = torch.optim.Adam(eager_model.parameters(), 1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def eager_schedule():
        opt.zero_grad()
        for xc, yc in zip(xt.split(R * MICRO), yt.split(R * MICRO), strict=True):
            (torch.nn.functional.cross_entropy(eager_model(xc), yc) / GA).backward()
        opt.step()

    def eager_big():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(eager_model(xt), yt).backward()
        opt.step()

    fns = {name: (lambda t=t: t.step(x, y)) for name, t in trainers.items()}
    fns |= {"eager_schedule": eager_schedule, "eager_batch_256": eager_big}
    add_aten_kernel_row(
        fns, lambda: trainers["on-chip"].step(x, y)
    )  # the same, torch's matmul kernel
    cpu: dict[str, list[float]] = {}
    faults: dict[str, list[float]] = {}
    s = interleaved_samples(fns, repeats, cpu=cpu, faults=faults)
    print(f"MNIST MLP step (R={R}, GA={GA}, micro-batch {MICRO}, Adam), median (min-max):")
    print(f"  eager same schedule   {describe(s['eager_schedule'])}")
    print(f"  eager one batch of 256 {describe(s['eager_batch_256'])}")
    for name, compiled in trainers.items():
        fallbacks = compiled.explain()
        print(f"  popxl.compile {name:<10} {describe(s[name])}: eager schedule / simulator "
              f"{ratio(s['eager_schedule'], s[name])}, batch 256 / simulator "
              f"{ratio(s['eager_batch_256'], s[name])}; vmap fallback: "
              f"{'; '.join(fallbacks) if fallbacks else 'none'}")  # fmt: skip
    print_aten_kernel_row(s, "eager_schedule")
    print("  CPU time per step (process CPU seconds, not waiting for a core): "
          + ", ".join(f"{k} {describe(v)}" for k, v in cpu.items())
          + f"; eager schedule / on-chip {ratio(cpu['eager_schedule'], cpu['on-chip'])}, "
          f"/ remote+RTS {ratio(cpu['eager_schedule'], cpu['remote+RTS'])}")  # fmt: skip
    print("  minor page faults per step, median: "
          + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in faults.items()))  # fmt: skip
    return {k: statistics.median(v) for k, v in s.items()}


if __name__ == "__main__":
    main(rounds_cli(__doc__, {"rounds": 10}).rounds)
