"""Reproduces the popxl-addons sharding-threshold study: the off-chip-optimizer MNIST program
(784-512-512-512-10 GELU MLP, Adam; data parallel 4, gradient accumulation 8, micro-batch 8)
for each row of the published table, and sets the cost model's throughput beside the published
IPU throughput, both relative to the on-chip optimizer.

Rows: no sharding (threshold inf), only the state of fc1.weight (262145), all state of the
weights (1024), all state (512), and the on-chip optimizer. The modeled device time is the
default ``CostModel`` (docs/cost_model.md) pricing each program's workload; ``--fit`` refits
its fitted parameters to the published times and prints them. The measured samples/s is this
machine running the simulator (not comparable with the IPU).
"""

from __future__ import annotations

import dataclasses
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
)
from mnist_compile import make_model  # noqa: E402
from torch_popxl.runtime.cost_model import (  # noqa: E402
    FITTED_PARAMETERS,
    PUBLISHED_SHARDING_STUDY,
    CostModel,
    fit,
    workload,
)

ROWS = tuple((name, thr, state) for name, thr, state, _ in PUBLISHED_SHARDING_STUDY)
PUBLISHED = {name: samples for name, _, _, samples in PUBLISHED_SHARDING_STUDY}
R, GA, MICRO = 4, 8, 8
BATCH = R * GA * MICRO


def build(threshold, state, x, y):
    """The compiled trainer of one row, after one step (the program is built then)."""
    torch.manual_seed(0)
    model = make_model()
    # keep_grads=False: as the published programs, no full gradients are kept after a step
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy, torch.optim.Adam(model.parameters(), 1e-3),
                            replication_factor=R, gradient_accumulation=GA, rts_threshold=threshold,
                            optimizer_state=state, keep_grads=False)  # fmt: skip
    trainer.step(x[:BATCH], y[:BATCH])
    return trainer


def study_workloads(x=None, y=None) -> list:
    """Each row's per-replica workload (random inputs unless given: only shapes matter)."""
    if x is None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH, 784, generator=gen).numpy()
        y = torch.randint(0, 10, (BATCH,), generator=gen).numpy().astype(np.int32)
    return [workload(build(thr, state, x, y).session.ir) for _, thr, state in ROWS]


def refit(works) -> CostModel:
    """The default model with ``FITTED_PARAMETERS`` refitted to the published step times."""
    times = [BATCH / PUBLISHED[name] for name, _, _ in ROWS]
    return fit(works, times, FITTED_PARAMETERS)


def run_row(name, threshold, state, x, y, steps: int, model: CostModel) -> dict:
    trainer = build(threshold, state, x, y)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        sl = slice(i * BATCH, (i + 1) * BATCH)
        trainer.step(x[sl], y[sl])
    elapsed = time.perf_counter() - start
    report = trainer.memory_report(model)
    traffic = report.traffic
    return {
        "measured_samples_per_s": steps * BATCH / elapsed if steps else float("nan"),
        "modeled_step_s": report.estimated_step_time_s,
        "modeled_samples_per_s": BATCH / report.estimated_step_time_s,
        "published_samples_per_s": PUBLISHED[name],
        "on_chip_bytes": report.on_chip_bytes,
        "streaming_bytes": report.streaming_bytes,
        "collective_bytes": traffic["all_reduce"]
        + traffic["all_gather"]
        + traffic["reduce_scatter"],
        "streaming_traffic_bytes": traffic["remote_load"] + traffic["remote_store"],
        "workload": report.workload,
    }


def add_ratios(results) -> None:
    """Throughput relative to the on-chip optimizer (the last row), published and modeled."""
    _, _, base = results[-1]
    for _, _, r in results:
        r["published_ratio"] = r["published_samples_per_s"] / base["published_samples_per_s"]
        r["modeled_ratio"] = r["modeled_samples_per_s"] / base["modeled_samples_per_s"]
        r["ratio_error"] = r["modeled_ratio"] / r["published_ratio"] - 1


def table(results) -> str:
    head = ("case", "threshold", "published samples/s", "modeled samples/s", "published ratio",
            "modeled ratio", "error", "modeled step (ms)", "simulator samples/s",
            "on chip (MiB/replica)", "streaming (MiB/replica)", "collectives (MiB/step)",
            "streaming traffic (MiB/step)")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, thr, r in results:
        cells = (name, "inf" if thr is None else str(thr), f"{r['published_samples_per_s']:.0f}",
                 f"{r['modeled_samples_per_s']:.0f}", f"{r['published_ratio']:.3f}",
                 f"{r['modeled_ratio']:.3f}", f"{r['ratio_error']:+.1%}",
                 f"{r['modeled_step_s'] * 1e3:.3f}", f"{r['measured_samples_per_s']:.0f}",
                 *(f"{r[k] / 2**20:.2f}" for k in ("on_chip_bytes", "streaming_bytes",
                                                    "collective_bytes", "streaming_traffic_bytes")))  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def settings(model: CostModel) -> str:
    """The cost model's parameters in one line (for the chart's title)."""
    parts = []
    for f in dataclasses.fields(model):
        v = getattr(model, f.name)
        if f.name.endswith("bytes_per_s"):
            parts.append(f"{f.name.removesuffix('_bytes_per_s')} {v / 1e9:g} GB/s")
        elif f.name == "flops_per_s":
            parts.append(f"peak {v / 1e12:g} TFLOP/s")
        elif f.name.endswith("_s"):
            parts.append(f"{f.name.removesuffix('_s')} {v * 1e6:g} us")
        else:
            parts.append(f"{f.name} {v:g}")
    return ", ".join(parts)


def chart(results, path: Path, model: CostModel) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _, _ in results]
    pos = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    on_chip = [r["on_chip_bytes"] / 2**20 for _, _, r in results]
    streaming = [r["streaming_bytes"] / 2**20 for _, _, r in results]
    ax1.bar(pos - 0.2, on_chip, 0.4, label="on-chip")
    ax1.bar(pos + 0.2, streaming, 0.4, label="streaming memory")
    ax1.set_ylabel("MiB per replica")
    ax1.set_title("Memory per replica")
    ax1.legend()
    published = [r["published_ratio"] for _, _, r in results]
    modeled = [r["modeled_ratio"] for _, _, r in results]
    ax2.bar(pos - 0.2, published, 0.4, label="published (IPU, popxl-addons tutorial)")
    ax2.bar(pos + 0.2, modeled, 0.4, label="cost model")
    for p, m, v in zip(pos, modeled, [r["ratio_error"] for _, _, r in results], strict=True):
        ax2.annotate(f"{v:+.0%}", (p + 0.2, m), ha="center", va="bottom", fontsize=8)
    ax2.set_ylabel("throughput relative to on-chip optimizer")
    ax2.set_title("Throughput: published vs modeled")
    ax2.legend(loc="upper left", fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(
            pos, [n.replace(" related to", "\nrelated to") for n in names], fontsize=8, rotation=15
        )
    config = (f"MNIST MLP 784-512-512-512-10, Adam; replicas {R}, gradient accumulation {GA}, "
              f"micro-batch {MICRO}")  # fmt: skip
    text = settings(model)
    cut = text.index(", ", len(text) // 2)
    fig.suptitle(f"{config}\ncost model: {text[:cut]}\n{text[cut + 2 :]}", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> list:
    parser = example_parser(__doc__)
    parser.add_argument("--steps", type=int, default=20, help="timed simulator steps per row")
    add_out_argument(parser, "sharding_study")
    parser.add_argument(
        "--chart",
        type=Path,
        default=None,
        help="where to save the chart of modeled against published throughput (default: "
        "OUT/sharding_study.png)",
    )
    parser.add_argument(
        "--fit", action="store_true", help="refit the fitted parameters and print them"
    )
    add_data_dir_argument(parser)
    args = parser.parse_args(argv)
    x, y, _, _ = load_mnist_or_exit(mnist_arrays, args.data_dir)
    model = CostModel()
    results = [
        (name, thr, run_row(name, thr, state, x, y, args.steps, model)) for name, thr, state in ROWS
    ]
    add_ratios(results)
    print(table(results))
    if args.fit:
        fitted = refit([r["workload"] for _, _, r in results])
        print("\nfitted to the published step times (default -> fitted):")
        for name in ("streaming_memory_bytes_per_s", "remote_latency_s", "host_latency_s",
                     "op_overhead_s"):  # fmt: skip
            print(f"  {name:<30} {getattr(model, name):.4g} -> {getattr(fitted, name):.4g}")
    path = args.chart or args.out / "sharding_study.png"
    chart(results, path, model)
    print(f"chart: {path}")
    return results


if __name__ == "__main__":
    main()
