"""executed_ops: a program's ops as they run, calls and repeats entered with multiplicities."""

from __future__ import annotations

from collections import Counter

import numpy as np

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.ir.walk import executed_ops


def test_ops_inside_a_call_inside_a_repeat_run_repeat_count_times_per_run():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(4, np.float32))
        inner = ir.create_graph(lambda a: a * 2.0, x)
        outer = ir.create_graph(lambda a: ops.call(inner, a)[0] + 1.0, x)
        (y,) = ops.repeat(outer, 3, x)
        _ = y - 1.0
    counts = Counter()
    for op, n in executed_ops(ir.main_graph.ops):
        counts[str(op.attrs.target)] += n
    assert counts["aten.mul.Tensor"] == 3  # the inner call, once per iteration
    assert counts["aten.add.Tensor"] == 3
    assert counts["aten.sub.Tensor"] == 1
    assert not any(op.kind in ("call", "repeat") for op, _ in executed_ops(ir.main_graph.ops))
