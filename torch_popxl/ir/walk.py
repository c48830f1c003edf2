"""Walking a program as it runs: calls and repeats entered, each op with how often it runs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .attrs import CallSite
from .graph import Op

__all__ = ["executed_ops"]


def executed_ops(ops: Iterable[Op], times: int = 1) -> Iterator[tuple[Op, int]]:
    """``(op, count)`` for every op that runs when ``ops`` run ``times`` times.

    A call or repeat is entered instead of yielded: its callee's ops come with ``count``
    multiplied by the call's ``repeat_count`` (1 for a call), recursively.
    """
    for op in ops:
        if isinstance(op.attrs, CallSite):
            yield from executed_ops(op.attrs.graph._ops, times * op.attrs.repeat_count)
        else:
            yield op, times
