"""How close the seed MLP's step can come to the machine's GEMM rate: its parts' floors, measured.

The peers benchmark (``bench_peers.py``) reports the step's achieved matmul rate as a share of
the device's float32 GEMM rate (square products). This script measures, interleaved on the same
machine, what bounds that share for the seed workload (784-512x3-10, Adam, 256 samples per
step):

* ``matmuls``: the step's 11 matmuls alone (4 forward, 3 input gradients, 4 weight gradients)
  over the whole global batch (M = 256 rows, the folded accumulation loop's shapes) through the
  simulator's GEMM, hot in cache: the most the step's matmuls can run at;
* ``optimizer floor``: the bytes any Adam update must move, read 4 parameter-sized float32
  streams (parameter, gradient, two moments) and write 3, timed as plain streaming passes of
  the same size (no arithmetic): no Adam update, fused or not, bit-exact or not, is faster;
* ``eager Adam`` (torch's default single-tensor step) and the compiled ``popxl step`` for
  reference.

It prints the best share of the GEMM rate the step could reach: FLOPs / (matmuls + optimizer
floor) / rate, before any activation, loss or bookkeeping work.

Usage: ``python benchmarks/bench_mlp_floor.py [--rounds N] [--threads N] [--cpu-time]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import seed  # noqa: E402
from bench_peers import gemm_rate  # noqa: E402
from timing import device_name, interleaved_samples  # noqa: E402

WIDTHS = (784, 512, 512, 512, 10)
ROWS = seed.R * seed.GA * seed.MICRO  # the global batch: 256


def _matmuls():
    """The step's matmuls over the global batch through the simulator's GEMM; their FLOPs."""
    gemm = torch.ops.torch_popxl.gemm
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(i, o, generator=g) for i, o in zip(WIDTHS, WIDTHS[1:], strict=False)]
    wts = [w.t().contiguous() for w in ws]
    acts = [torch.randn(ROWS, i, generator=g) for i in WIDTHS[:-1]]
    grads = [torch.randn(ROWS, o, generator=g) for o in WIDTHS[1:]]
    acts_t = [a.t().contiguous() for a in acts]

    def run():
        for a, w in zip(acts, ws, strict=True):  # forward
            gemm(a, w, None)
        for gr, wt in zip(grads[1:], wts[1:], strict=True):  # input gradients (not layer 0's)
            gemm(gr, wt, None)
        for at, gr in zip(acts_t, grads, strict=True):  # weight gradients
            gemm(at, gr, None)

    flops = 2 * ROWS * sum(i * o for i, o in zip(WIDTHS, WIDTHS[1:], strict=False))
    flops += 2 * ROWS * sum(i * o for i, o in zip(WIDTHS[1:], WIDTHS[2:], strict=False))
    flops += 2 * ROWS * sum(i * o for i, o in zip(WIDTHS, WIDTHS[1:], strict=False))
    return run, flops


def _optimizer_floor(numel: int):
    """Reads of 4 and writes of 3 float32 streams of ``numel`` elements: two ``a + b -> c``
    passes (4 reads, 2 writes) and one copy (read, write; one read more than the floor)."""
    streams = [torch.rand(numel) for _ in range(7)]

    def run():
        p, g, m, v, p2, m2, v2 = streams
        torch.add(p, g, out=p2)
        torch.add(m, v, out=m2)
        v2.copy_(p)

    return run


def _eager_adam(params: list[torch.nn.Parameter]):
    opt = torch.optim.Adam(params, 1e-3)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return opt.step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads")
    parser.add_argument("--cpu-time", action="store_true",
                        help="process CPU time (robust on a loaded machine with --threads 1)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    rate = gemm_rate(cpu, time.process_time if args.cpu_time else time.perf_counter)
    matmuls, flops = _matmuls()
    model = seed.make_model()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    trainer = seed.trainer()
    x, y = seed.batch()
    fns = {
        "matmuls": matmuls,
        "optimizer floor": _optimizer_floor(numel),
        "eager Adam": _eager_adam(params),
        "popxl step": lambda: trainer.step(x, y),
    }
    cpu_s: dict[str, list[float]] = {}
    wall = interleaved_samples(fns, args.rounds, cpu=cpu_s)
    ms = {k: 1e3 * statistics.median(v) for k, v in (cpu_s if args.cpu_time else wall).items()}
    step_flops = flops  # as FlopCounterMode counts eager's step (no input gradient)
    best = step_flops / ((ms["matmuls"] + ms["optimizer floor"]) * 1e-3) / rate
    print(f"device: {device_name(cpu)}; {torch.get_num_threads()} threads, "
          f"{'process CPU' if args.cpu_time else 'wall-clock'} time; GEMM rate "
          f"{rate / 1e9:.0f} GFLOP/s; {numel:,} parameters; {step_flops / 1e9:.2f} GFLOP per "
          "step")  # fmt: skip
    for k, v in ms.items():
        print(f"  {k:<16} {v:7.2f} ms")
    print(f"  matmuls alone run at {step_flops / (ms['matmuls'] * 1e-3) / rate:.0%} of the GEMM "
          f"rate; with the optimizer floor the step could reach at most {best:.0%}; the "
          f"compiled step reaches {step_flops / (ms['popxl step'] * 1e-3) / rate:.0%}")  # fmt: skip
    return {"ms": ms, "best_share": best}


if __name__ == "__main__":
    main()
