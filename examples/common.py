"""Shared helpers for the examples: MNIST loading (online or from local .gz files)."""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import numpy as np
import torch

__all__ = ["mnist_root", "mnist_datasets", "mnist_arrays", "DEFAULT_DATA_ENV"]

DEFAULT_DATA_ENV = "TORCH_POPXL_MNIST_DIR"
_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_REPO = Path(__file__).resolve().parent.parent


def _candidates(data_dir: str | None) -> list[Path]:
    out = []
    if data_dir:
        out.append(Path(data_dir))
    if os.environ.get(DEFAULT_DATA_ENV):
        out.append(Path(os.environ[DEFAULT_DATA_ENV]))
    out.append(_REPO.parent / "shared" / "data" / "mnist")
    return out


def mnist_root(data_dir: str | None = None, download: bool = False) -> Path:
    """A directory in torchvision's layout (``<root>/MNIST/raw/<name>``), unpacked once.

    Looks in ``data_dir``, then ``$TORCH_POPXL_MNIST_DIR``, then ``../shared/data/mnist``
    for the four gzipped IDX files; with ``download=True`` torchvision fetches them instead.
    """
    cache = _REPO / "data"
    raw = cache / "MNIST" / "raw"
    if all((raw / f).exists() for f in _FILES):
        return cache
    for d in _candidates(data_dir):
        if all((d / f"{f}.gz").exists() for f in _FILES):
            raw.mkdir(parents=True, exist_ok=True)
            for f in _FILES:
                with gzip.open(d / f"{f}.gz", "rb") as src, open(raw / f, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                shutil.copy(d / f"{f}.gz", raw / f"{f}.gz")
            return cache
    if download:
        return cache
    raise FileNotFoundError(
        "MNIST not found. Either pass --data-dir (or set $TORCH_POPXL_MNIST_DIR) to a directory "
        "holding the four files "
        + ", ".join(f + ".gz" for f in _FILES)
        + ", or run on a connected "
        "machine with --download to let torchvision fetch them."
    )


def mnist_datasets(data_dir: str | None = None, download: bool = False):
    """(train, test) ``torchvision.datasets.MNIST`` with the usual normalisation."""
    import torchvision
    from torchvision import transforms

    root = mnist_root(data_dir, download)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train = torchvision.datasets.MNIST(root, train=True, download=download, transform=tf)
    test = torchvision.datasets.MNIST(root, train=False, download=download, transform=tf)
    return train, test


def mnist_arrays(data_dir: str | None = None, download: bool = False):
    """Normalised float32 images ``[N, 784]`` and int32 labels, for train and test.

    Whole-array access is much faster than a per-sample DataLoader on a 2-core machine.
    """
    train, test = mnist_datasets(data_dir, download)

    def arrays(ds):
        x = ds.data.to(torch.float32).div_(255.0).sub_(0.1307).div_(0.3081).reshape(len(ds), -1)
        return x.numpy(), ds.targets.numpy().astype(np.int32)

    return (*arrays(train), *arrays(test))
