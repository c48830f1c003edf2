"""Reproduces the sharding-threshold study of seed 002: the off-chip-optimizer MNIST program
(784-512-512-512-10 GELU MLP, Adam; data parallel 4, gradient accumulation 8, micro-batch 8)
for each row of the seed's table, with measured and modeled throughput and memory.

Rows: no sharding (threshold inf), only the state of fc1.weight (262145), all state of the
weights (1024), all state (512), and the on-chip optimizer. The modeled device time comes from
the session's cost model (replica links vs streaming memory bandwidths); the measured
samples/s is this machine running the simulator.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
from common import mnist_arrays  # noqa: E402
from mnist_compile import make_model  # noqa: E402

ROWS = (
    ("no sharding", None, "remote"),
    ("only state related to fc1.weight", 262145, "remote"),
    ("all state related to weights", 1024, "remote"),
    ("all state", 512, "remote"),
    ("on-chip optimizer", None, "on_chip"),
)
R, GA, MICRO = 4, 8, 8


def run_row(threshold, state, x, y, steps: int) -> dict:
    torch.manual_seed(0)
    model = make_model()
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy, torch.optim.Adam(model.parameters(), 1e-3),
                            replication_factor=R, gradient_accumulation=GA, rts_threshold=threshold,
                            optimizer_state=state)  # fmt: skip
    batch = R * GA * MICRO
    trainer.step(x[:batch], y[:batch])  # build and warm up
    start = time.perf_counter()
    for i in range(1, steps + 1):
        sl = slice(i * batch, (i + 1) * batch)
        trainer.step(x[sl], y[sl])
    elapsed = time.perf_counter() - start
    report = trainer.memory_report()
    traffic = report.traffic
    return {
        "measured_samples_per_s": steps * batch / elapsed,
        "modeled_step_s": report.estimated_step_time_s,
        "modeled_samples_per_s": batch / report.estimated_step_time_s,
        "on_chip_bytes": report.on_chip_bytes,
        "streaming_bytes": report.streaming_bytes,
        "collective_bytes": traffic["all_reduce"]
        + traffic["all_gather"]
        + traffic["reduce_scatter"],
        "streaming_traffic_bytes": traffic["remote_load"] + traffic["remote_store"],
    }


def table(results: list[tuple[str, object, dict]]) -> str:
    head = ("case", "threshold", "measured samples/s", "modeled step (us)", "modeled samples/s",
            "on-chip B/replica", "streaming B/replica", "collective B/step", "streaming B/step")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, thr, r in results:
        cells = (name, "inf" if thr is None else str(thr), f"{r['measured_samples_per_s']:.0f}",
                 f"{r['modeled_step_s'] * 1e6:.1f}", f"{r['modeled_samples_per_s']:.0f}",
                 f"{r['on_chip_bytes']:,}", f"{r['streaming_bytes']:,}", f"{r['collective_bytes']:,}",
                 f"{r['streaming_traffic_bytes']:,}")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _, _ in results]
    pos = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    on_chip = [r["on_chip_bytes"] / 2**20 for _, _, r in results]
    streaming = [r["streaming_bytes"] / 2**20 for _, _, r in results]
    ax1.bar(pos - 0.2, on_chip, 0.4, label="on-chip")
    ax1.bar(pos + 0.2, streaming, 0.4, label="streaming memory")
    ax1.set_ylabel("MiB per replica")
    ax1.set_title("Memory per replica")
    ax1.legend()
    ax2.bar(pos, [r["modeled_samples_per_s"] for _, _, r in results], color="tab:green")
    ax2.set_ylabel("samples/s (cost model)")
    ax2.set_title("Modeled device throughput")
    for ax in (ax1, ax2):
        ax.set_xticks(
            pos, [n.replace(" related to", "\nrelated to") for n in names], fontsize=8, rotation=15
        )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per row")
    parser.add_argument(
        "--chart",
        default=str(Path(__file__).resolve().parent.parent / "out" / "sharding_study.png"),
    )
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--download", action="store_true")
    args = parser.parse_args(argv)
    x, y, _, _ = mnist_arrays(args.data_dir, args.download)
    results = [(name, thr, run_row(thr, state, x, y, args.steps)) for name, thr, state in ROWS]
    print(table(results))
    chart(results, Path(args.chart))
    print(f"chart: {args.chart}")
    return results


if __name__ == "__main__":
    main()
