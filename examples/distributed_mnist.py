"""Data-parallel MNIST on several processes: a ``popxl.compile`` program, unchanged, under
torchrun (PopXL's multi-instance model, with ``torch.distributed`` between processes).

    torchrun --nproc_per_node=2 examples/distributed_mnist.py --max-steps 100

Every process is one PopXL instance holding replication_factor / nproc replicas. All processes
draw the same global batch and feed the rows of their own replicas
(``distributed.instance_batch``), so the job computes exactly what one process computes with
``python examples/distributed_mnist.py`` (the simulator holding all replicas), up to the order
of floating-point sums. Reading the trained model back is collective: every rank evaluates.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
from common import add_data_dir_argument, example_parser, load_mnist_or_exit, mnist_arrays  # noqa: E402
from torch_popxl.runtime import distributed  # noqa: E402


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 10),
    )  # fmt: skip


def main(argv=None) -> float:
    parser = example_parser(__doc__)
    parser.add_argument(
        "--replication-factor", type=int, default=4, help="global replicas (a multiple of nproc)"
    )
    parser.add_argument(
        "--gradient-accumulation", type=int, default=2, help="micro-batches per optimizer step"
    )
    parser.add_argument("--micro-batch-size", type=int, default=16, help="samples per micro-batch")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this many optimizer steps (0: one epoch)",
    )
    add_data_dir_argument(parser)
    args = parser.parse_args(argv)

    R, GA = args.replication_factor, args.gradient_accumulation
    instances = distributed.num_instances()  # starts the process group under torchrun
    rank = int(os.environ.get("RANK", 0))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{instances} instance(s) x {distributed.local_replicas(R)} replicas = R={R}")

    torch.manual_seed(42)  # the same initial weights on every instance
    x_train, y_train, x_test, y_test = load_mnist_or_exit(mnist_arrays, args.data_dir)
    model = make_model()
    trainer = popxl.compile(
        model,
        loss_fn=torch.nn.functional.cross_entropy,
        optimizer=torch.optim.Adam(model.parameters(), lr=args.lr),
        replication_factor=R,
        gradient_accumulation=GA,
    )
    batch = R * GA * args.micro_batch_size
    steps = len(x_train) // batch
    if args.max_steps:
        steps = min(steps, args.max_steps)
    order = np.random.default_rng(0).permutation(len(x_train))  # the same on every instance
    start = time.time()
    for i in range(steps):
        idx = order[i * batch : (i + 1) * batch]
        x = distributed.instance_batch(x_train[idx], R, GA)
        y = distributed.instance_batch(y_train[idx], R, GA)
        loss = trainer.step(x, y)  # the mean loss over all instances
        if i % 50 == 0 or i == steps - 1:
            say(f"step {i:4d}  loss {loss:.4f}")
    train_s = time.time() - start

    model.eval()  # weights flow back from the session on first use: a collective read
    with torch.no_grad():
        logits = model(torch.from_numpy(x_test))
    acc = float((logits.argmax(-1).numpy() == y_test).mean())
    say(f"test accuracy: {acc * 100:.2f}%  ({train_s:.1f} s, {steps} steps of {batch} samples, "
        f"{train_s / max(steps, 1) * 1e3:.1f} ms/step)")  # fmt: skip
    return acc


if __name__ == "__main__":
    main()
