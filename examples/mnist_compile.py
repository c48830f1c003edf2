"""The seed 002 MNIST model (784-512-512-512-10 GELU MLP, Adam) trained through popxl.compile.

A plain ``torch.nn.Module`` and ``torch.optim.Adam`` become a PopXL program with data parallel
replicas, gradient accumulation, replica-sharded (RTS) and off-chip optimizer state.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
from common import mnist_arrays  # noqa: E402


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 10),
    )  # fmt: skip


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replication-factor", type=int, default=4)
    parser.add_argument("--gradient-accumulation", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument(
        "--rts-threshold",
        type=int,
        default=512,
        help="shard optimizer state with >= this many elements (0: off)",
    )
    parser.add_argument("--optimizer-state", choices=("on_chip", "remote"), default="remote")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--max-steps", type=int, default=0, help="limit optimizer steps per epoch (0: all)"
    )
    parser.add_argument("--data-dir", default=None, help="directory with the four MNIST .gz files")
    parser.add_argument("--download", action="store_true", help="download MNIST with torchvision")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(42)
    x_train, y_train, x_test, y_test = mnist_arrays(args.data_dir, args.download)
    model = make_model()
    trainer = popxl.compile(
        model,
        loss_fn=torch.nn.functional.cross_entropy,
        optimizer=torch.optim.Adam(model.parameters(), lr=args.lr),
        replication_factor=args.replication_factor,
        gradient_accumulation=args.gradient_accumulation,
        rts_threshold=args.rts_threshold or None,
        optimizer_state=args.optimizer_state,
        device=args.device,
    )
    batch = args.replication_factor * args.gradient_accumulation * args.micro_batch_size
    steps = len(x_train) // batch
    if args.max_steps:
        steps = min(steps, args.max_steps)
    start = time.time()
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(x_train))
        bar = tqdm(range(steps), desc=f"epoch {epoch}", disable=args.quiet, mininterval=1.0)
        for i in bar:
            idx = order[i * batch : (i + 1) * batch]
            loss = trainer.step(x_train[idx], y_train[idx])
            bar.set_postfix(loss=f"{loss:.4f}")
    train_s = time.time() - start

    model.eval()  # the module holds the trained parameters after every step
    with torch.no_grad():
        logits = model(torch.from_numpy(x_test))
    acc = float((logits.argmax(-1).numpy() == y_test).mean())
    print(
        f"test accuracy: {acc * 100:.2f}%  ({train_s:.1f} s training, {steps * args.epochs} steps of {batch} samples)"
    )
    print(trainer.memory_report())
    return acc


if __name__ == "__main__":
    main()
