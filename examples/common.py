"""Shared helpers for the examples: finding (or fetching) MNIST and loading it as arrays, where
outputs go (``--out``), a progress bar.

Where MNIST is looked for, in order (the first place that holds all four files wins):

1. ``--data-dir`` on the command line (if given, it must hold the files: no fallback);
2. ``$TORCH_POPXL_MNIST_DIR``;
3. the user cache, ``$XDG_CACHE_HOME/torch_popxl/mnist`` (default ``~/.cache/torch_popxl/mnist``);
4. otherwise torchvision downloads it into the user cache (about 11 MB), once.

A directory may hold the four files gzipped (``train-images-idx3-ubyte.gz``, ...) or unpacked,
directly or in torchvision's ``MNIST/raw/`` layout. If none is found and the download fails
(no network, or no torchvision), ``MnistNotFoundError`` says what was looked for and how to
provide the data; ``load_mnist_or_exit`` turns that into a message and exit status 2.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT_DATA_ENV",
    "HelpFormatter",
    "add_data_dir_argument",
    "add_out_argument",
    "default_out_dir",
    "example_parser",
    "MnistNotFoundError",
    "find_mnist",
    "load_mnist_or_exit",
    "mnist_arrays",
    "mnist_files",
    "mnist_tensor_datasets",
    "progress",
    "user_cache_dir",
]

DEFAULT_DATA_ENV = "TORCH_POPXL_MNIST_DIR"
FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
MEAN, STD = 0.1307, 0.3081  # of the training images: the usual MNIST normalisation


class MnistNotFoundError(FileNotFoundError):
    """MNIST is in none of the places looked at and could not be downloaded."""


def user_cache_dir() -> Path:
    """Where a download goes: ``$XDG_CACHE_HOME/torch_popxl/mnist`` or ``~/.cache/...``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_popxl" / "mnist"


def _files_in(directory: Path) -> dict[str, Path] | None:
    """The four files (gzipped or not) in ``directory`` or its ``MNIST/raw``, else None."""
    for d in (directory, directory / "MNIST" / "raw"):
        found = {}
        for name in FILES:
            for candidate in (d / name, d / f"{name}.gz"):
                if candidate.is_file():
                    found[name] = candidate
                    break
        if len(found) == len(FILES):
            return found
    return None


def _places(data_dir: str | os.PathLike | None) -> list[tuple[str, Path]]:
    places = []
    if data_dir is not None:
        places.append(("--data-dir", Path(data_dir)))
    if os.environ.get(DEFAULT_DATA_ENV):
        places.append((f"${DEFAULT_DATA_ENV}", Path(os.environ[DEFAULT_DATA_ENV])))
    places.append(("user cache", user_cache_dir()))
    return places


def find_mnist(data_dir: str | os.PathLike | None = None) -> dict[str, Path] | None:
    """The four MNIST files from the first place that has them all (no download), or None.

    ``data_dir`` (the ``--data-dir`` option) is looked at first, so it wins over any cache.
    """
    for _, place in _places(data_dir):
        files = _files_in(place)
        if files is not None:
            return files
    return None


def _download(target: Path) -> dict[str, Path]:
    """Fetch MNIST with torchvision into ``target`` (all or nothing: it downloads into a
    temporary directory, so a failure leaves nothing behind)."""
    import torchvision  # optional: only needed to download

    staging = Path(tempfile.mkdtemp(prefix="torch_popxl-mnist-"))
    try:
        torchvision.datasets.MNIST(str(staging), train=True, download=True)
        torchvision.datasets.MNIST(str(staging), train=False, download=True)
        raw = staging / "MNIST" / "raw"
        target.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(raw / f"{name}.gz", target / f"{name}.gz")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = _files_in(target)
    assert files is not None, f"download into {target} is incomplete"
    return files


def _not_found_message(data_dir, reason: str) -> str:
    looked = "\n".join(f"  {label:<22} {place}" for label, place in _places(data_dir))
    names = ", ".join(f"{n}.gz" for n in FILES)
    return (
        "MNIST was not found and could not be downloaded.\n"
        f"Looked for the four files ({names}) in:\n{looked}\n"
        f"Download into the user cache failed: {reason}\n"
        "To provide it: put the four files in a directory and pass --data-dir DIR (or set "
        f"{DEFAULT_DATA_ENV}=DIR), or run once on a machine with internet access and "
        "torchvision installed (pip install 'torch_popxl[examples]') to fill the user cache."
    )


def mnist_files(data_dir: str | os.PathLike | None = None, download: bool = True):
    """The four MNIST files: found locally (``find_mnist``) or, with ``download``, fetched.

    A ``data_dir`` that lacks them is an error (no fallback to a cache or a download).

    Raises ``MnistNotFoundError`` (a ``FileNotFoundError``) saying where it looked and how to
    provide the data.
    """
    if data_dir is not None and _files_in(Path(data_dir)) is None:
        # An explicit --data-dir is never silently replaced by a cached copy.
        names = ", ".join(f"{n}.gz" for n in FILES)
        raise MnistNotFoundError(
            f"--data-dir {data_dir} does not hold the four MNIST files ({names}, gzipped or "
            "not, directly or under MNIST/raw/). Point --data-dir at a directory that has "
            "them, or leave it out to use $TORCH_POPXL_MNIST_DIR, the user cache or a download."
        )
    files = find_mnist(data_dir)
    if files is not None:
        return files
    if not download:
        raise MnistNotFoundError(_not_found_message(data_dir, "not attempted (download=False)"))
    try:
        return _download(user_cache_dir())
    except ImportError:
        reason = "torchvision is not installed"
    except Exception as e:  # urllib / torchvision raise several kinds when offline
        reason = " ".join(str(e).split())[:300] or type(e).__name__
    raise MnistNotFoundError(_not_found_message(data_dir, reason))


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format: big-endian header, then uint8 data), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (header {data[:4]!r}).")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def mnist_arrays(data_dir: str | os.PathLike | None = None, download: bool = True):
    """``(x_train, y_train, x_test, y_test)``: normalised float32 images ``[N, 784]`` and
    int32 labels. Whole arrays are much faster than a per-sample DataLoader on a small CPU.
    """
    files = mnist_files(data_dir, download)

    def images(name):
        x = _read_idx(files[name]).astype(np.float32).reshape(-1, 28 * 28)
        return (x / 255.0 - MEAN) / STD

    def labels(name):
        return _read_idx(files[name]).astype(np.int32)

    return (
        images("train-images-idx3-ubyte"),
        labels("train-labels-idx1-ubyte"),
        images("t10k-images-idx3-ubyte"),
        labels("t10k-labels-idx1-ubyte"),
    )


def mnist_tensor_datasets(data_dir: str | os.PathLike | None = None, download: bool = True):
    """``(train, test)`` ``TensorDataset`` s of ``[1, 28, 28]`` images and int64 labels, the
    values ``torchvision.datasets.MNIST`` gives with ``ToTensor()`` and ``Normalize``."""
    import torch

    x_train, y_train, x_test, y_test = mnist_arrays(data_dir, download)

    def dataset(x, y):
        return torch.utils.data.TensorDataset(
            torch.from_numpy(x).reshape(-1, 1, 28, 28), torch.from_numpy(y).long()
        )

    return dataset(x_train, y_train), dataset(x_test, y_test)


def load_mnist_or_exit(loader, *args, **kwargs):
    """``loader(*args, **kwargs)``; if MNIST is missing, print why and exit with status 2."""
    try:
        return loader(*args, **kwargs)
    except MnistNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and appends ``(default: X)`` to options that have a
    meaningful default (not ``None``, not an off switch, not already stated in the help)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or "default:" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def example_parser(doc: str | None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` whose description is the example's docstring."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


def add_data_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="directory holding the four MNIST files (gzipped or not); looked at before "
        f"${DEFAULT_DATA_ENV} and the user cache ({user_cache_dir()}); if MNIST is in none of "
        "them, it is downloaded into the user cache.",
    )


def default_out_dir(example: str) -> Path:
    """Where an example writes its outputs unless ``--out`` says otherwise:
    ``$XDG_CACHE_HOME/torch_popxl/outputs/EXAMPLE`` (default ``~/.cache/...``), never the
    checkout."""
    return user_cache_dir().parent / "outputs" / example


def add_out_argument(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out_dir(example),
        metavar="DIR",
        help="directory for the example's outputs (charts); created if missing",
    )


def progress(iterable, total: int, desc: str, disable: bool = False):
    """``iterable`` with a progress bar: tqdm's when it is installed, else a line every 10 %.
    ``set_postfix(**values)`` on the result shows values beside the bar."""
    try:
        from tqdm import tqdm  # optional (pip install 'torch_popxl[examples]')
    except ImportError:
        return _PlainProgress(iterable, total, desc, disable)
    return tqdm(iterable, total=total, desc=desc, disable=disable, mininterval=1.0)


class _PlainProgress:
    def __init__(self, iterable, total: int, desc: str, disable: bool):
        self.iterable, self.total, self.desc, self.disable = iterable, total, desc, disable
        self.postfix = ""

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def __iter__(self):
        every = max(1, self.total // 10)
        for i, item in enumerate(self.iterable, 1):
            yield item
            if not self.disable and (i % every == 0 or i == self.total):
                print(f"{self.desc}: {i}/{self.total} {self.postfix}".rstrip(), flush=True)
