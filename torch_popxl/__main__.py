"""``python -m torch_popxl [env | plan ...]``: the environment, and will-it-fit planning.

``env`` (the default) prints the versions of torch_popxl, Python, torch and the other packages
it works with, whether the C++ extension is built and where, the matmul kernel the simulator
uses on this machine (``gemm.kernel()``) and the devices torch sees: for bug reports and a
first check of an install. ``plan`` builds a model's training program for a sweep of replica
counts, sharding thresholds and optimizer-state placements and prints the memory, traffic and
modeled step time of each (``torch_popxl/plan.py``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

import numpy
import torch

import torch_popxl
import torch_popxl._C  # the package import above already needs it; named here for its path
from torch_popxl import plan
from torch_popxl.runtime import gemm

_OPTIONAL = (
    "torchvision",
    "matplotlib",
    "tqdm",
    "transformers",
    "pytest",
    "hypothesis",
    "ruff",
    "ninja",
)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def environment() -> list[tuple[str, str]]:
    """(label, value) rows describing this environment."""
    rows = [
        ("torch_popxl", f"{torch_popxl.__version__} ({os.path.dirname(torch_popxl.__file__)})"),
        ("C++ extension", f"built ({torch_popxl._C.__file__})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'})"),
        ("numpy", numpy.__version__),
    ]
    rows += [(name, _version(name)) for name in _OPTIONAL]
    rows.append(
        ("CPU", f"{_cpu_cores()} cores usable, torch uses {torch.get_num_threads()} threads")
    )
    rows.append(("matmul kernel", _kernel_line()))
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        rows.append(("CUDA devices", ", ".join(names)))
    else:
        rows.append(("CUDA devices", "none (the simulator runs on the CPU)"))
    rows.append(
        (
            "MNIST for examples",
            os.environ.get("TORCH_POPXL_MNIST_DIR") or "TORCH_POPXL_MNIST_DIR unset",
        )
    )
    return rows


def _kernel_line() -> str:
    """The float32 CPU matmul kernel (Note [gemm kernel] in csrc/gemm.cpp)."""
    return f"{gemm.kernel()} (float32 CPU matmuls; TORCH_POPXL_GEMM=aten|onednn chooses)"


def print_environment() -> None:
    rows = environment()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m torch_popxl",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog=f"matmul kernel on this machine: {_kernel_line()}",
    )
    sub = top.add_subparsers(dest="command", metavar="{env,plan}")
    sub.add_parser("env", help="print the environment (the default)")
    plan_parser = sub.add_parser(
        "plan",
        help="memory, traffic and modeled step time of a model over replica counts, sharding "
        "and optimizer-state placements; the best setting that fits a budget",
        description=plan.DESCRIPTION,
        epilog=plan.EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_arguments(plan_parser)
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "plan":
        try:
            plan.run(args)
        except (ValueError, TypeError, ImportError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    else:
        print_environment()


if __name__ == "__main__":
    main()
