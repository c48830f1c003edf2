"""``python -m torch_popxl``: the environment, for bug reports and a first check of an install.

Prints the versions of torch_popxl, Python, torch and the other packages it works with,
whether the C++ extension is built and where, and the devices torch sees.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import numpy
import torch

import torch_popxl
import torch_popxl._C  # the package import above already needs it; named here for its path

_OPTIONAL = ("torchvision", "matplotlib", "tqdm", "pytest", "hypothesis", "ruff", "ninja")


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


def main() -> None:
    rows = environment()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


if __name__ == "__main__":
    main()
