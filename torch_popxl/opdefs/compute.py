"""The captured matmul family: how many FLOPs one execution does (the report and the cost
model both count with this)."""

from __future__ import annotations

import math

from ..ir.graph import Op, OpKind

__all__ = ["matmul_flops"]

# The tensor argument whose last dim is the contraction size K, per matmul-like aten op.
_MATMUL_K_ARG = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1, "mv": 0, "dot": 0}


def matmul_flops(op: Op) -> int | None:
    """``2 * output elements * K`` for a captured aten matmul, None for any other op."""
    if op.kind != OpKind.TORCH or getattr(op.attrs.target, "namespace", None) != "aten":
        return None
    k_arg = _MATMUL_K_ARG.get(op.attrs.target._schema.name.split("::")[-1])
    if k_arg is None:
        return None
    k = op.tensor_arg(k_arg).shape[-1]
    return 2 * max(1, math.prod(op.outputs[0].shape)) * k
