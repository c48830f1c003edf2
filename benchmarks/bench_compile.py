"""The seed MNIST configuration through popxl.compile versus eager torch, side by side.

MLP 784-512-512-512-10 (GELU), Adam; 4 replicas x micro-batch 8, gradient accumulation 8
(256 samples per optimizer step), optimizer state sharded (threshold 512) and off-chip.
Eager references: the same schedule (8 micro-batches of 32, one Adam step) and one batch of
256. Prints ms per step and the ratios eager/simulator (>= 1: the simulator is faster).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch_popxl as popxl  # noqa: E402
from timing import interleaved  # noqa: E402
from mnist_compile import make_model  # noqa: E402

R, GA, MICRO = 4, 8, 8


def main(repeats: int = 10) -> dict[str, float]:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(R * GA * MICRO, 784)).astype(np.float32)
    y = rng.integers(0, 10, R * GA * MICRO)
    model = make_model()
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy, torch.optim.Adam(model.parameters(), 1e-3),
                            replication_factor=R, gradient_accumulation=GA, rts_threshold=512,
                            optimizer_state="remote")  # fmt: skip
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

    t = interleaved({"simulator": lambda: trainer.step(x, y), "eager_schedule": eager_schedule,
                     "eager_batch_256": eager_big}, repeats)  # fmt: skip
    print(f"seed MNIST step (R={R}, GA={GA}, micro {MICRO}, RTS 512, off-chip Adam): "
          f"simulator {t['simulator'] * 1e3:.1f} ms, eager same schedule {t['eager_schedule'] * 1e3:.1f} ms, "
          f"eager one batch of 256 {t['eager_batch_256'] * 1e3:.1f} ms; ratios eager/simulator "
          f"{t['eager_schedule'] / t['simulator']:.2f} (schedule), {t['eager_batch_256'] / t['simulator']:.2f} (batch 256)")  # fmt: skip
    return t


if __name__ == "__main__":
    main()
