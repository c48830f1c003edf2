"""``disable_fc_pass`` / ``enable_fc_pass``: the matmuls' fully-connected pass (popxl-addons'
``transforms.use_fc_pass``).

On an IPU the fully-connected pass lays a matmul's weight out for the transposed use the
backward graph makes of it, which costs memory an inference-only program does not need. The
simulator has no tile layouts: the setting is recorded per matmul op (``fc_pass_enabled``) and
changes neither results nor the memory report.
"""

from __future__ import annotations

import weakref

from ...errors import given
from ...ir.graph import Op
from ...ir.ir import Ir
from ...opdefs.compute import matmul_flops

__all__ = ["disable_fc_pass", "enable_fc_pass", "fc_pass_enabled"]

# Per Ir: id(matmul op) -> whether it uses the pass. Ops live as long as their graph, which the
# Ir holds, so their ids stay valid while the entry does.
_SETTINGS: weakref.WeakKeyDictionary[Ir, dict[int, bool]] = weakref.WeakKeyDictionary()


def _matmuls(ir: Ir, fn: str) -> list[Op]:
    if not isinstance(ir, Ir):
        raise TypeError(f"{fn} expects a popxl Ir; got {given(ir)}. Pass the program's Ir.")
    return [op for g in ir.graphs for op in g.ops if matmul_flops(op) is not None]


def _set(ir: Ir, enabled: bool, fn: str) -> None:
    matmuls = _matmuls(ir, fn)
    settings = _SETTINGS.setdefault(ir, {})
    for op in matmuls:
        settings[id(op)] = enabled


def disable_fc_pass(ir: Ir) -> None:
    """Turn the fully-connected pass off for every matmul now in ``ir`` (useful for
    inference-only programs on hardware; matmuls created later keep the default, on)."""
    _set(ir, False, "disable_fc_pass")


def enable_fc_pass(ir: Ir) -> None:
    """Turn the fully-connected pass back on for every matmul now in ``ir``."""
    _set(ir, True, "enable_fc_pass")


def fc_pass_enabled(ir: Ir, op: Op) -> bool:
    """Whether ``op`` (a matmul of ``ir``) uses the fully-connected pass (default: on)."""
    if matmul_flops(op) is None:
        raise ValueError(
            f"fc_pass_enabled: op {op.name!r} is not a matmul; only matmuls have the pass."
        )
    return _SETTINGS.get(ir, {}).get(id(op), True)
