"""Train an ordinary torch MNIST model on simulated replicas with ``popxl.compile``.

A plain ``torch.nn.Module`` (784-512-512-512-10 MLP with GELU) and ``torch.optim.Adam``
become a PopXL program that shows three PopXL techniques together: data-parallel replicas
(``--replication-factor``), gradient accumulation over micro-batches, and optimizer state that
is split across replicas (replicated tensor sharding, ``--rts-threshold``) and kept off-chip in
streaming memory (``--optimizer-state remote``). It trains one epoch, prints the test accuracy
and the per-replica memory report (what sharding and off-chip state saved, the traffic they
cost and the step time modeled for one Mk2 GC200 IPU per replica), and saves the report's chart
under ``--out``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
from common import (  # noqa: E402
    add_data_dir_argument,
    add_out_argument,
    example_parser,
    load_mnist_or_exit,
    mnist_arrays,
    progress,
)
from torch_popxl.runtime.cost_model import CostModel  # noqa: E402


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 10),
    )  # fmt: skip


def main(argv=None) -> float:
    parser = example_parser(__doc__)
    parser.add_argument("--replication-factor", type=int, default=4, help="data-parallel replicas")
    parser.add_argument(
        "--gradient-accumulation", type=int, default=8, help="micro-batches per optimizer step"
    )
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch")
    parser.add_argument(
        "--rts-threshold",
        type=int,
        default=512,
        help="shard optimizer state tensors with at least this many elements across the "
        "replicas; 0 turns sharding off",
    )
    parser.add_argument(
        "--optimizer-state",
        choices=("on_chip", "remote"),
        default="remote",
        help="where the Adam state lives: on chip, or in streaming memory (loaded and stored "
        "around each update)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training set")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop each epoch after this many optimizer steps (0: all)",
    )
    add_data_dir_argument(parser)
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device the simulator computes on, e.g. cpu or cuda",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_out_argument(parser, "mnist_compile")
    parser.add_argument(
        "--no-chart", action="store_true", help="do not save the memory report's chart"
    )
    args = parser.parse_args(argv)

    torch.manual_seed(42)
    x_train, y_train, x_test, y_test = load_mnist_or_exit(mnist_arrays, args.data_dir)
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
        keep_grads=False,  # the loop never reads p.grad: no full gradients kept (or gathered)
    )
    batch = args.replication_factor * args.gradient_accumulation * args.micro_batch_size
    steps = len(x_train) // batch
    if args.max_steps:
        steps = min(steps, args.max_steps)
    print(
        f"{args.replication_factor} simulated replicas on {args.device}; modeled device: one "
        f"{CostModel().device} per replica"
    )
    start = time.time()
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(x_train))
        bar = progress(range(steps), steps, f"epoch {epoch}", disable=args.quiet)
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
    report = trainer.memory_report()
    print(report)
    if not args.no_chart:
        path = args.out / "memory_report.png"
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            report.plot(path)
            print(f"chart: {path}")
        except ImportError as e:  # matplotlib is optional
            print(f"no chart: {e}")
    return acc


if __name__ == "__main__":
    main()
