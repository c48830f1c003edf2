"""``addons.performance_utils``: popxl-addons' estimate of a program's floating-point operations.

``evaluate_FLOPs(graph)`` walks the graph's ops: matmuls count ``2 * K * output elements``,
element-wise add / sub / mul / div one per output element, a group normalisation the operations
of its mean, variance, normalisation, scale and shift; a call counts its callee once, a repeat
``repeat_count`` times. The breakdown maps each op type to ``{op name: FLOPs}`` (a called graph's
ops under ``"<Call|Repeat>_<op index>(<graph>)"``) and ``"TOT"`` to the total. Other ops count
nothing, as upstream. An op is keyed by its index in its graph, where upstream has PopART's
op id.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Literal

from ..errors import given
from ..ir.graph import Graph, Op, OpKind
from ..ir.ir import Ir
from ..opdefs.compute import matmul_flops

__all__ = ["evaluate_FLOPs", "evaluate_ir_FLOPs", "total_FLOPs", "print_FLOPs",
           "format_flops_scientific"]  # fmt: skip

_ELEMENTWISE = {"add": "Add", "add_": "Add", "sub": "Sub", "sub_": "Sub", "mul": "Mul",
                "mul_": "Mul", "div": "Div", "div_": "Div"}  # fmt: skip


def _aten_name(op: Op) -> str | None:
    if op.kind != OpKind.TORCH or getattr(op.attrs.target, "namespace", None) != "aten":
        return None
    return op.attrs.target._schema.name.split("::")[-1]


def _group_norm_flops(op: Op) -> int:
    # upstream's count: mean (one op per averaged element), variance <x^2> - <x>^2 (two per
    # averaged element, two per mean), normalise (two per output), scale and shift (one each).
    x, out, mean = op.tensor_arg(0), op.outputs[0], op.outputs[1]
    n_means = math.prod(mean.shape)
    groups = n_means // x.shape[0]
    averaged = x.shape[-1] * x.shape[-2] // groups
    return averaged + (2 * averaged + 2 * n_means) + 4 * math.prod(out.shape)


def _op_flops(op: Op) -> tuple[str, int] | None:
    flops = matmul_flops(op)
    if flops is not None:
        return "MatMul", flops
    name = _aten_name(op)
    if name in _ELEMENTWISE and len(op.inputs) >= 1:
        return _ELEMENTWISE[name], math.prod(op.outputs[0].shape)
    if name == "native_group_norm":
        return "GroupNormalization", _group_norm_flops(op)
    return None


def _scaled(breakdown: Any, factor: int) -> Any:
    if isinstance(breakdown, dict):
        return {k: _scaled(v, factor) for k, v in breakdown.items()}
    return breakdown * factor


def _evaluate(graph: Graph, seen: dict[Graph, dict[str, Any]]) -> dict[str, Any]:
    if graph in seen:
        return seen[graph]
    total = 0
    breakdown: defaultdict[str, Any] = defaultdict(dict)
    for index, op in enumerate(graph.ops):
        if op.kind in (OpKind.CALL, OpKind.REPEAT):
            called = _evaluate(op.attrs.graph, seen)
            site = "Call"
            if op.kind == OpKind.REPEAT:
                called, site = _scaled(called, op.attrs.repeat_count), "Repeat"
            total += called["TOT"]
            key = f"{site}_{index}({op.attrs.graph.id})"
            for kind, value in called.items():
                breakdown[kind][key] = value
            continue
        counted = _op_flops(op)
        if counted is not None:
            kind, flops = counted
            total += flops
            breakdown[kind][index] = flops
    result = dict(breakdown)
    result["TOT"] = total
    seen[graph] = result
    return result


def evaluate_FLOPs(graph: Graph) -> dict[str, Any]:
    """The FLOPs breakdown of one execution of ``graph`` (see the module docstring)."""
    if not isinstance(graph, Graph):
        raise TypeError(f"evaluate_FLOPs expects a popxl Graph; got {given(graph)}.")
    return _evaluate(graph, {})


def evaluate_ir_FLOPs(ir: Ir) -> dict[str, Any]:
    """``evaluate_FLOPs(ir.main_graph)`` summed over the Ir's replicas."""
    if not isinstance(ir, Ir):
        raise TypeError(f"evaluate_ir_FLOPs expects a popxl Ir; got {given(ir)}.")
    return _scaled(evaluate_FLOPs(ir.main_graph), ir.replication_factor)


def total_FLOPs(ir: Ir) -> int:
    """The FLOPs of one run of ``ir`` over all its replicas."""
    return evaluate_ir_FLOPs(ir)["TOT"]


def _sum(v: Any) -> int:
    return sum(_sum(x) for x in v.values()) if isinstance(v, dict) else v


def format_flops_scientific(val: float,
                            format: Literal["K", "M", "G", "T", "nearest3"] = "nearest3") -> str:  # fmt: skip
    """``val`` as ``"<mantissa with 3 decimals>E<sign><2-digit exponent>"``: the exponent of
    ``format`` (K=3 ... T=12), or for "nearest3" the multiple of 3 nearest to ``val``'s power."""
    exponents = {"K": 3, "M": 6, "G": 9, "T": 12}
    if format == "nearest3":
        power = math.floor(math.log10(abs(val))) if val > 0 else 0
        exponent = 3 * (power // 3 + int(power % 3 == 2))
    elif format in exponents:
        exponent = exponents[format]
    else:
        raise ValueError(
            f"format_flops_scientific: unknown format {format!r}; expected 'K', 'M', 'G', 'T' "
            "or 'nearest3'."
        )
    sign = "-" if exponent < 0 else "+"
    return f"{val * 10.0**-exponent:.3f}E{sign}{abs(exponent):02d}"


def print_FLOPs(flops_breakdown: dict[str, Any], mode: Literal["type", "flat"] = "type",
                numerical_format: Literal["K", "M", "G", "T", "nearest3"] = "nearest3") -> None:  # fmt: skip
    """Print the breakdown as a table: per op type with its share of the total ("type"), or one
    row per op ("flat"), largest first."""
    if mode == "type":
        rows = [["Op Type", "FLOPs", "%"]]
        totals = {k: _sum(v) for k, v in flops_breakdown.items()}
        for k, v in sorted(totals.items(), key=lambda kv: kv[1], reverse=True):
            share = 100 * v / totals["TOT"] if totals["TOT"] else 0.0
            rows.append([k, format_flops_scientific(v, numerical_format), f"{share:.1f}"])
    elif mode == "flat":
        rows = [["Op Type", "FLOPs", "Op Name"]]
        flat: dict[str, int] = {}

        def walk(d: dict[str, Any], prefix: str) -> None:
            for k, v in d.items():
                key = f"{prefix}.{k}" if prefix else str(k)
                walk(v, key) if isinstance(v, dict) else flat.__setitem__(key, v)

        walk(flops_breakdown, "")
        for k, v in sorted(flat.items(), key=lambda kv: kv[1], reverse=True):
            rows.append([k.split(".")[0], format_flops_scientific(v, numerical_format), k])
    else:
        raise ValueError(f"print_FLOPs: unknown mode {mode!r}; use 'type' or 'flat'.")
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    print("\n".join(lines))
