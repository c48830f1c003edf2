"""Op definitions: one traffic formula per collective, the same one the C++ counters use, and
clear errors for missing rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import opdefs, ops
from torch_popxl.opdefs import collectives as C
from torch_popxl.opdefs import kernels as K

GROUPINGS = [(4, 1, 1), (4, 2, 1), (4, 2, 2), (4, 4, 1), (6, 3, 2), (8, 2, 4)]


@pytest.mark.parametrize("R, G, S", GROUPINGS)
@pytest.mark.parametrize("num_elements", [1, 5, 12])
def test_python_formulas_equal_the_bytes_the_cpp_kernels_count(R, G, S, num_elements):
    x = torch.randn(R, num_elements)
    row = num_elements * x.element_size()
    cases = [
        (lambda: K._ops.all_reduce_stacked(x, "add", G, S), C.all_reduce_bytes(R, G, row)),
        (lambda: K._ops.all_gather_stacked(x, G, S), C.all_gather_bytes(R, G, row)),
        (
            lambda: K._ops.reduce_scatter_stacked(x, "add", G, S),
            C.reduce_scatter_bytes(R, G, num_elements, x.element_size(), "add"),
        ),
        (lambda: K._ops.take_own_stacked(x.reshape(R, 1, -1).expand(R, G, -1), G, S), 0),
    ]
    for run, expected in cases:
        with K.traffic_scope() as delta:
            run()
        assert delta["collective_bytes"] == expected
        assert delta["num_collectives"] == 1


def test_hand_computed_ring_bytes():
    # 4 replicas in 2 pairs, 12 float32 per replica (48 bytes).
    assert C.all_reduce_bytes(4, 2, 48) == 4 * 2 * 1 * 48 // 2
    assert C.all_gather_bytes(4, 2, 48) == 4 * 1 * 48
    assert C.reduce_scatter_bytes(4, 4, 10, 4, "add") == 4 * 3 * 3 * 4  # ceil(10 / 4) = 3
    assert C.reduce_scatter_bytes(4, 4, 10, 4, "local") == 0


def test_every_collective_in_a_program_finds_its_definition_and_traffic():
    ir = popxl.Ir(4)
    with ir.main_graph:
        x = popxl.variable(np.ones(10, np.float32))
        rg = ir.replica_grouping(group_size=2)
        ops.collectives.replicated_all_reduce(x, group=rg)
        ops.collectives.replicated_all_gather(x, group=rg)
        ops.collectives.replicated_reduce_scatter(x, group=rg)
    found = [(opdefs.lookup(op), op) for op in ir.main_graph.ops]
    traffic = [d.traffic(op, 4) for d, op in found if d is not None]
    assert [(t.kind, t.total_bytes, t.group_size) for t in traffic] == [
        ("all_reduce", 4 * 2 * 1 * 40 // 2, 2),
        ("all_gather", 4 * 1 * 40, 2),
        ("reduce_scatter", 4 * 1 * 5 * 4, 2),
    ]


def test_a_missing_rule_names_the_op_and_the_rule():
    with pytest.raises(opdefs.MissingRuleError, match="op 'host_load' has no 'reference' rule"):
        opdefs.transfers.host_load_p.rule("reference")
