"""``addons.patterns.apply_pre_alias_patterns`` (popxl-addons ``patterns``).

Upstream runs PopART's pre-alias patterns over every graph of the Ir: rewrites of gradient and
composite ops into the primitive ops Poplar lowers (``SqrtGradOp`` into a division, ``OpToIdentity``
and the like), chosen by a level. A captured program is already made of aten ops that torch
runs as they are, so no rewrite is needed for it to run; the simulator checks the arguments,
records the level (``patterns_level(ir)``) and leaves every graph unchanged, which is what the
patterns promise for results.
"""

from __future__ import annotations

import weakref
from typing import Literal

from ..errors import given
from ..ir.ir import Ir

__all__ = ["apply_pre_alias_patterns", "patterns_level", "PATTERNS_LEVELS"]

PATTERNS_LEVELS = ("no_patterns", "minimal", "default", "all")
_LEVELS: weakref.WeakKeyDictionary[Ir, str] = weakref.WeakKeyDictionary()


def patterns_level(ir: Ir) -> str | None:
    """The level last applied to ``ir`` by ``apply_pre_alias_patterns`` (None: never)."""
    return _LEVELS.get(ir)


def apply_pre_alias_patterns(
    ir: Ir, level: Literal["no_patterns", "minimal", "default", "all"] = "default"
) -> None:
    """Apply the pre-alias patterns of ``level`` to all graphs of ``ir`` (recorded only: the
    simulator's graphs need no rewrite, so results are unchanged)."""
    if not isinstance(ir, Ir):
        raise TypeError(
            f"apply_pre_alias_patterns expects a popxl Ir; got {given(ir)}. Pass the "
            "program's Ir (graph.ir for a graph)."
        )
    if level not in PATTERNS_LEVELS:
        raise ValueError(
            f"apply_pre_alias_patterns: unknown patterns level {level!r}; expected one of "
            f"{PATTERNS_LEVELS}."
        )
    ir._check_mutable()
    _LEVELS[ir] = level
