"""Timing helpers: interleaved medians so the ratio survives a noisy shared machine."""

from __future__ import annotations

import platform
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torch_popxl.runtime import gemm


def interleaved_samples(
    fns: dict[str, Callable[[], object]],
    repeats: int = 30,
    warmup: int = 3,
    cpu: dict[str, list[float]] | None = None,
    faults: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds of every call of each function, measured round-robin (one call of each in
    turn), so a slow spell of the machine hits every function alike. ``cpu``, when given, is
    filled with the process CPU seconds of the same calls: on a machine shared by more jobs
    than cores a call also waits for a core, which wall time counts and CPU time does not.
    ``faults``, when given, with the minor page faults of each call (fresh memory the kernel
    hands out and zero-fills: Note [step cache] in csrc/step_cache.cpp)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for extra in (cpu, faults):
        if extra is not None:
            extra.update({k: [] for k in fns})
    for _ in range(repeats):
        for name, fn in fns.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu[name].append(time.process_time() - c0)
            if faults is not None:
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return samples


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int = 30, warmup: int = 3
) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin."""
    samples = interleaved_samples(fns, repeats, warmup)
    return {k: statistics.median(v) for k, v in samples.items()}


def describe(samples: list[float]) -> str:
    """``median (min-max) ms`` of a list of seconds."""
    ms = [s * 1e3 for s in samples]
    return f"{statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f})"


def ratio(eager: list[float], simulator: list[float]) -> str:
    """``eager / simulator`` of the medians, with the range of the per-round ratios (>= 1:
    the simulator is faster)."""
    per_round = [e / s for e, s in zip(eager, simulator, strict=True)]
    med = statistics.median(eager) / statistics.median(simulator)
    return f"{med:.2f}x ({min(per_round):.2f}-{max(per_round):.2f})"


ATEN_ROW = "on-chip, aten gemm"


def add_aten_kernel_row(fns: dict[str, Callable[[], object]], step: Callable[[], object]) -> None:
    """Add ``step`` run with torch's own matmul kernel as the row ``ATEN_ROW`` (when the
    simulator's default kernel is another: Note [gemm kernel] in csrc/gemm.cpp)."""
    if gemm.kernel() == "aten":
        return

    def aten_kernel():
        with gemm.using("aten"):
            step()

    fns[ATEN_ROW] = aten_kernel


def print_aten_kernel_row(s: dict[str, list[float]], eager: str) -> None:
    """The kernel in use, and the ``ATEN_ROW`` step against ``eager`` when it was timed."""
    print(f"  matmul kernel: {gemm.kernel()!r} (Note [gemm kernel] in csrc/gemm.cpp)")
    if ATEN_ROW in s:
        print(f"  popxl.compile on-chip with torch's matmul kernel ('aten') {describe(s[ATEN_ROW])}: "
              f"eager / simulator {ratio(s[eager], s[ATEN_ROW])}")  # fmt: skip


def device_name(device: torch.device | str = "cpu") -> str:
    """The GPU's or CPU's model name, for the figures a benchmark prints."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def rounds_cli(doc: str | None, counts: dict[str, int], argv: list[str] | None = None, **flags):
    """Parse a benchmark's command line: optional positional counts (``counts``: name ->
    default, in order) and boolean ``--flag`` options (``flags``: name -> help), so that
    ``--help`` prints the benchmark's docstring instead of failing as a count."""
    import argparse

    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, default in counts.items():
        what = name.replace("_", " ")
        parser.add_argument(
            name, type=int, nargs="?", default=default, help=f"{what} (default: {default})"
        )
    for name, text in flags.items():
        parser.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=text)
    return parser.parse_args(argv)
