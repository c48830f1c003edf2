"""Op definitions: one traffic formula per collective, the same one the C++ counters use, and
clear errors for missing rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import opdefs, ops
from torch_popxl.opdefs import backends
from torch_popxl.opdefs.all_gather import all_gather_bytes
from torch_popxl.opdefs.all_reduce import all_reduce_bytes
from torch_popxl.opdefs.reduce_scatter import reduce_scatter_bytes

GROUPINGS = [(4, 1, 1), (4, 2, 1), (4, 2, 2), (4, 4, 1), (6, 3, 2), (8, 2, 4)]


@pytest.mark.parametrize("R, G, S", GROUPINGS)
@pytest.mark.parametrize("num_elements", [1, 5, 12])
def test_python_formulas_equal_the_bytes_the_cpp_kernels_count(R, G, S, num_elements):
    x = torch.randn(R, num_elements)
    row = num_elements * x.element_size()
    cases = [
        (
            lambda: torch.ops.torch_popxl.all_reduce_stacked(x, "add", G, S),
            all_reduce_bytes(R, G, row),
        ),
        (lambda: torch.ops.torch_popxl.all_gather_stacked(x, G, S), all_gather_bytes(R, G, row)),
        (
            lambda: torch.ops.torch_popxl.reduce_scatter_stacked(x, "add", G, S),
            reduce_scatter_bytes(R, G, num_elements, x.element_size(), "add"),
        ),
        (
            lambda: torch.ops.torch_popxl.take_own_stacked(
                x.reshape(R, 1, -1).expand(R, G, -1), G, S
            ),
            0,
        ),
    ]
    for run, expected in cases:
        with backends.traffic_scope() as delta:
            run()
        assert delta["collective_bytes"] == expected
        assert delta["num_collectives"] == 1


def test_hand_computed_ring_bytes():
    # 4 replicas in 2 pairs, 12 float32 per replica (48 bytes).
    assert all_reduce_bytes(4, 2, 48) == 4 * 2 * 1 * 48 // 2
    assert all_gather_bytes(4, 2, 48) == 4 * 1 * 48
    assert reduce_scatter_bytes(4, 4, 10, 4, "add") == 4 * 3 * 3 * 4  # ceil(10 / 4) = 3
    assert reduce_scatter_bytes(4, 4, 10, 4, "local") == 0


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
        opdefs.host.host_load_opdef.rule("reference")


# ---- every stanza is complete ----------------------------------------------------------------

# What a consumer may ask of every collective's definition (runtime/lower.py, explicit.py,
# executor.py, report.py, cost_model.py, the distributed vmap path, popxl.ops), and of every
# remote transfer's.
COLLECTIVE_RULES = {"traffic", "reference", "distributed", "explicit", "output_batched",
                    "passthrough", "no_gradient", "sum_read", "matmul_fusion", "wrapper"}  # fmt: skip
REMOTE_RULES = {"traffic", "reference", "explicit", "wrapper"}


def _by_effect(effect):
    return [d for d in opdefs.registered() if effect in d.effects]


def test_every_collective_and_remote_op_is_registered():
    assert {d.name for d in _by_effect(opdefs.Effect.COLLECTIVE)} == {
        "replicated_all_reduce",
        "replicated_all_reduce_TP",
        "replicated_all_gather",
        "replicated_reduce_scatter",
        "replicated_take_own",
    }
    assert {d.name for d in _by_effect(opdefs.Effect.REMOTE)} == {
        "remote_load",
        "remote_load_",
        "remote_store",
    }


def test_every_runtime_opdef_brings_its_lowering_rules():
    """Note [lowering rules]: the fast compiler lowers a runtime op only through its
    definition, so every runtime op (one whose ``op.kind`` is its definition) has both rules."""
    runtime = [d for d in opdefs.registered() if d.attrs is not None]
    assert {d.name for d in runtime} >= {"remote_load", "remote_load_", "remote_store",
                                         "host_load", "host_store", "print"}  # fmt: skip
    for opdef in runtime:
        missing = {"lower_analyse", "lower_emit"} - set(opdef.rules)
        assert not missing, f"{opdef.name} lacks the rules {sorted(missing)}"


@pytest.mark.parametrize("effect, rules", [(opdefs.Effect.COLLECTIVE, COLLECTIVE_RULES),
                                           (opdefs.Effect.REMOTE, REMOTE_RULES)])  # fmt: skip
def test_every_collective_and_remote_opdef_has_the_full_rule_set(effect, rules):
    for opdef in _by_effect(effect):
        missing = rules - set(opdef.rules)
        assert not missing, f"{opdef.name} lacks the rules {sorted(missing)}"
        for name in rules:
            assert callable(opdef.rule(name)), (opdef.name, name)


def test_the_wrappers_users_import_are_the_stanzas_wrappers():
    by_name = {d.name: d for d in opdefs.registered()}
    assert by_name["replicated_all_reduce"].rule("wrapper") is ops.collectives.replicated_all_reduce
    assert by_name["replicated_all_gather"].rule("wrapper") is ops.collectives.replicated_all_gather
    assert (
        by_name["replicated_reduce_scatter"].rule("wrapper")
        is ops.collectives.replicated_reduce_scatter
    )
    assert by_name["replicated_take_own"].rule("wrapper") is ops.collectives.replicated_slice
    assert by_name["remote_load"].rule("wrapper") is ops.remote_load
    assert by_name["remote_load_"].rule("wrapper") is ops.remote_load_
    assert by_name["remote_store"].rule("wrapper") is ops.remote_store
    assert by_name["host_load"].rule("wrapper") is ops.host_load
    assert by_name["host_store"].rule("wrapper") is ops.host_store


def test_a_missing_rule_of_a_collective_names_the_op_and_the_rule():
    bare = opdefs.OpDef("replicated_frobnicate", opdefs.Effect.COLLECTIVE, {"traffic": len})
    with pytest.raises(opdefs.MissingRuleError) as info:
        bare.rule("distributed")
    message = str(info.value)
    assert "'replicated_frobnicate'" in message and "'distributed'" in message
    assert "traffic" in message  # says which rules it does have
    remote = next(d for d in opdefs.registered() if d.name == "remote_load")
    with pytest.raises(opdefs.MissingRuleError, match="op 'remote_load' has no 'distributed'"):
        remote.rule("distributed")


def _program_ops(R=4, group_size=4):
    ir = popxl.Ir(R)
    with ir.main_graph:
        x = popxl.variable(np.arange(8, dtype=np.float32))
        rg = ir.replica_grouping(group_size=group_size)
        ops.collectives.replicated_all_reduce(x, group=rg)
        ops.collectives.replicated_all_gather(x, group=rg)
        ops.collectives.replicated_reduce_scatter(x, group=rg)
        ops.collectives.replicated_slice(x.reshape((group_size, -1)), group=rg)
    return [(opdefs.lookup(op), op) for op in ir.main_graph.ops if opdefs.lookup(op)]


def test_the_compiler_facts_of_the_collectives():
    found = {d.name: (d, op) for d, op in _program_ops()}
    ar, ar_op = found["replicated_all_reduce"]
    ag, ag_op = found["replicated_all_gather"]
    rs, rs_op = found["replicated_reduce_scatter"]
    to, to_op = found["replicated_take_own"]
    # a full group's result is the same on every replica; a slice's never is
    assert ar.rule("output_batched")(ar_op, 4, True) is False
    assert ag.rule("output_batched")(ag_op, 4, True) is False
    assert rs.rule("output_batched")(rs_op, 4, False) is True
    assert to.rule("output_batched")(to_op, 4, False) is True
    # ... but over 8 replicas a group of 4 is not the whole set
    assert ar.rule("output_batched")(ar_op, 8, False) is True
    with pytest.raises(ValueError, match="does not tile R=6"):
        ar.rule("output_batched")(ar_op, 6, True)
    # only an add/mean all-reduce over all replicas folds into a matmul
    assert ar.rule("matmul_fusion")(ar_op, 4) == "add"
    assert ar.rule("matmul_fusion")(ar_op, 8) is None
    assert ag.rule("matmul_fusion")(ag_op, 4) is None
    # sum reads: the all-reduce and the reduce-scatter of an accumulator, not the others
    assert ar.rule("sum_read")(ar_op, 4) is not None and rs.rule("sum_read")(rs_op, 4) is not None
    assert ag.rule("sum_read")(ag_op, 4) is None and to.rule("sum_read")(to_op, 4) is None
    assert not any(d.rule("passthrough")(op) for d, op in found.values())  # groups of 4


def test_a_sum_read_gives_the_collectives_value_and_counts_its_bytes():
    found = {d.name: (d, op) for d, op in _program_ops()}
    summed = torch.arange(8, dtype=torch.float32)  # the sum over 4 replicas, already taken
    ar, ar_op = found["replicated_all_reduce"]
    with backends.traffic_scope() as delta:
        out = ar.rule("sum_read")(ar_op, 4)(summed, lambda v: v)
    torch.testing.assert_close(out, summed)
    assert delta["collective_bytes"] == all_reduce_bytes(4, 4, 32)
    assert delta["num_collectives"] == 1


def test_the_explicit_rule_of_a_full_group_all_reduce_matches_the_reference():
    found = {d.name: (d, op) for d, op in _program_ops()}
    ar, ar_op = found["replicated_all_reduce"]
    x = torch.randn(4, 6)
    run = ar.rule("explicit")(ar_op, [True], 4)
    want = opdefs.all_reduce.reference(list(x), "add", 4, 1)[0]
    torch.testing.assert_close(run(x, "add", 4, 1), want)
    # an unbatched input is the same value on every replica: R times it
    torch.testing.assert_close(ar.rule("explicit")(ar_op, [False], 4)(x[0], "add", 4, 1), 4 * x[0])


@pytest.mark.parametrize("R,group_size", [(4, 4), (8, 4), (4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("x_batched", [True, False])
def test_the_explicit_rules_of_the_collectives_match_the_reference(R, group_size, x_batched):
    """Every collective's stacked form equals the reference per replica, grouped and full,
    on batched and replica-invariant inputs, with the batched-ness ``output_batched`` says."""
    references = {
        "replicated_all_reduce": opdefs.all_reduce.reference,
        "replicated_all_gather": opdefs.all_gather.reference,
        "replicated_reduce_scatter": opdefs.reduce_scatter.reference,
        "replicated_take_own": opdefs.take_own.reference,
    }
    torch.manual_seed(R * 10 + group_size)
    for opdef, op in _program_ops(R, group_size):
        shape = (group_size, 8 // group_size) if opdef.name == "replicated_take_own" else (8,)
        rows = torch.randn(R, *shape) if x_batched else torch.randn(*shape).expand(R, *shape)
        rest = op.attrs.args[1:]
        want = references[opdef.name](list(rows), *rest)
        run = opdef.rule("explicit")(op, [x_batched], R)
        assert run is not None, opdef.name
        got = run(rows if x_batched else rows[0], *rest)
        if opdef.rule("output_batched")(op, R, x_batched):
            torch.testing.assert_close(got, torch.stack(want), msg=opdef.name)
        else:  # one value, the same on every replica
            for w in want:
                torch.testing.assert_close(got, w, msg=opdef.name)
