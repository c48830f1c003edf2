"""Training steps of the popxl-addons examples: phased execution and pipelining.

``examples/mnist_phased.py`` (7 phases, remote weights and Adam state, RTS over 2 replicas,
batch serialisation over 4 micro-batches of 32) and ``examples/mnist_pipelined.py`` (3 stages
over two IPUs, 6 micro-batches of 5, Adam; one replica by default, also run with two). Each
program trains on random MNIST-shaped data (no download); steps are timed interleaved and
printed as ms per step, median (min-max), with the fragments that fall back to vmap and the
first op of each without an explicit-batching rule (Note [explicit batching]). An epoch is
234 steps of the phased program and 2000 of the pipelined one.

Usage: ``python benchmarks/bench_examples.py [rounds]``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import mnist_phased  # noqa: E402
import mnist_pipelined  # noqa: E402
from timing import describe, interleaved_samples, rounds_cli  # noqa: E402


def _fallbacks(session) -> list[str]:
    executor = session._executor
    return [
        f"{name}: {fn.vmap_reason or 'vmap'}"
        for name, fn in executor.fns.items()
        if not getattr(fn, "explicit", True) and executor.R > 1
    ]


def _phased():
    opts = mnist_phased.Options()
    session, (img, lab), _, _ = mnist_phased.train_program(opts)
    GA, DP, micro = opts.gradient_accumulation, opts.data_parallel, opts.micro_batch_size
    rng = np.random.default_rng(0)
    feed = {
        img: rng.normal(size=(GA, DP, micro, 784)).astype(np.float32),
        lab: rng.integers(0, 10, (GA, DP, micro)).astype(np.int32),
    }
    return session, feed


def _pipelined(data_parallel: int):
    opts = mnist_pipelined.parse_args(["--data-parallel", str(data_parallel)])
    session, streams, _, _ = mnist_pipelined.train_program(opts)
    GA, micro = opts.gradient_accumulation, opts.train_micro_batch_size
    shape = (GA, data_parallel, micro) if data_parallel > 1 else (GA, micro)
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.normal(size=(*shape, 784)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 10, shape).astype(np.int32))
    return session, dict(zip(streams, [images, labels], strict=True))


def main(rounds: int = 20) -> dict[str, float]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as mnist_pipelined.py runs (tiny matmuls gain nothing from more)
    try:
        programs = {
            "phased (R=2)": _phased(),
            "pipelined (R=1)": _pipelined(1),
            "pipelined (R=2)": _pipelined(2),
        }
        for session, _ in programs.values():
            session.__enter__()
        fns = {name: (lambda s=s, f=f: s.run(f)) for name, (s, f) in programs.items()}
        samples = interleaved_samples(fns, rounds)
        print("popxl-addons example training steps, median (min-max):")
        for name, (session, _) in programs.items():
            fallbacks = _fallbacks(session)
            print(f"  {name:<16} {describe(samples[name])}; vmap fallback: "
                  f"{'; '.join(fallbacks) if fallbacks else 'none'}")  # fmt: skip
        for session, _ in programs.values():
            session.__exit__(None, None, None)
    finally:
        torch.set_num_threads(previous)
    return {k: statistics.median(v) for k, v in samples.items()}


if __name__ == "__main__":
    main(rounds_cli(__doc__, {"rounds": 20}).rounds)
