"""Small helpers shared by the addons: a readable ``OrderedDict``, ``WeightsDict``, ``timer``,
``overrides`` and ``duplicate_items``."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..runtime.session import check_host_data

__all__ = ["OrderedDict", "WeightsDict", "null_context", "suffix_graph_name", "timer", "overrides",
           "duplicate_items", "WANDB_IMPORTED"]  # fmt: skip

# Upstream imports wandb here and says whether it could; nothing here logs to W&B, and importing
# it would slow every import, so this only says whether it is installed.
WANDB_IMPORTED = importlib.util.find_spec("wandb") is not None


class OrderedDict(collections.OrderedDict):
    """An ``OrderedDict`` whose repr prints one ``key: value,`` per line."""

    def __repr__(self) -> str:
        if not self:
            return "{}"
        lines = "".join(f"  {k}: {v!r},\n" for k, v in self.items())
        return "{\n" + lines + "}"


class WeightsDict(dict):
    """``{Variable: ndarray}`` that checks dtype and ``shape_on_host`` on insertion."""

    def __setitem__(self, var, data) -> None:
        data = check_host_data(var, data, "WeightsDict")
        super().__setitem__(var, data)

    def update(self, *args, **kwargs) -> None:  # route through the checks
        for k, v in dict(*args, **kwargs).items():
            self[k] = v


@contextlib.contextmanager
def timer(title: str | None = None, log_to_wandb: bool = True,
          print_fn: Callable[[str], Any] | None = None) -> Iterator[None]:  # fmt: skip
    """Log ``Starting <title>`` and then ``<title> duration: N.NN mins`` (with ``logging.info``
    as upstream, or ``print_fn``). ``log_to_wandb`` is accepted for upstream's signature;
    nothing is sent to Weights & Biases here."""
    log = print_fn or logging.info
    start = time.perf_counter()
    log(f"Starting {title or ''}")
    try:
        yield
    finally:
        minutes = (time.perf_counter() - start) / 60
        log(f"{f'{title} duration' if title else 'Duration'}: {minutes:.2f} mins")


@contextlib.contextmanager
def null_context() -> Iterator[None]:
    """A context manager that does nothing (for ``with io_tiles() if x else null_context():``)."""
    yield


def suffix_graph_name(name: str, suffix: str) -> str:
    """``name`` without its ``_subgraph(N)`` counters, then ``_<suffix>``."""
    base = re.sub(r"_subgraph\(\d+\)", "", name)
    return f"{base}_{suffix}"


def overrides(cls: type, base: type, method: str) -> bool:
    """Whether ``cls`` (a subclass of ``base``) defines its own ``method``."""
    return getattr(cls, method) is not getattr(base, method)


def duplicate_items(items: Iterable[Any]) -> list[Any]:
    """The items that occur more than once, each listed once, in order of first repeat
    (compared by hash and equality, so popxl tensors compare by identity)."""
    counts: collections.Counter = collections.Counter()
    dups: list[Any] = []
    for x in items:
        counts[x] += 1
        if counts[x] == 2:
            dups.append(x)
    return dups
