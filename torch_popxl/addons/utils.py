"""Small helpers shared by the addons: a readable ``OrderedDict``, ``WeightsDict``, ``timer``."""

from __future__ import annotations

import collections
import contextlib
import re
import time
from collections.abc import Iterator

from ..runtime.session import check_host_data

__all__ = ["OrderedDict", "WeightsDict", "null_context", "suffix_graph_name", "timer"]


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
def timer(title: str = "", print_fn=print) -> Iterator[None]:
    """Print how long the block took."""
    start = time.perf_counter()
    try:
        yield
    finally:
        print_fn(f"{title} took {time.perf_counter() - start:.3f}s")


@contextlib.contextmanager
def null_context() -> Iterator[None]:
    """A context manager that does nothing (for ``with io_tiles() if x else null_context():``)."""
    yield


def suffix_graph_name(name: str, suffix: str) -> str:
    """``name`` without its ``_subgraph(N)`` counters, then ``_<suffix>``."""
    base = re.sub(r"_subgraph\(\d+\)", "", name)
    return f"{base}_{suffix}"
