"""popxl-addons' remaining public names (issue 15): route_tensor_into_graph, fp8_amax_scale,
ops.static_sparse_ops and seed_variable, each checked against numpy / hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.addons import fp8_amax_scale, route_tensor_into_graph
from torch_popxl.addons.layers import GroupNorm
from torch_popxl.addons.ops.static_sparse_ops import dense_const_sparse_matmul, random_sparse
from torch_popxl.addons.performance_utils import (
    evaluate_FLOPs,
    evaluate_ir_FLOPs,
    format_flops_scientific,
    print_FLOPs,
    total_FLOPs,
)
from torch_popxl.addons.seed_variable import seed_variable


def _run(ir, read=(), inputs=None, executor="fast"):
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run(inputs or {})
        data = session.get_tensors_data(list(read)) if read else {}
    return out, data


# ---- route_tensor_into_graph ---------------------------------------------------------------


@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_route_tensor_into_a_repeated_sub_subgraph_accumulates_into_the_variable(executor):
    # Upstream's docstring example: main repeats sg (3x), sg calls sg1, sg1 updates main's `a`.
    ir = popxl.Ir()
    sg1 = ir.create_empty_graph("sg1")
    sg = ir.create_empty_graph("sg")
    with ir.main_graph:
        a = popxl.variable(np.float32(0.5), name="a")
    with sg:
        ops.call(sg1)
    with ir.main_graph:
        ops.repeat(sg, 3)
    with sg1:
        a_ = route_tensor_into_graph(a, modified=True)
        ops.var_updates.accumulate_(a_, popxl.constant(np.float32(2.0)))
    assert a_ in sg1.inputs and len(sg.inputs) == 1 and sg1.is_input_by_ref(a_)
    _, got = _run(ir, read=[a], executor=executor)
    assert got[a] == 0.5 + 3 * 2.0


def test_route_tensor_reads_a_parent_value_and_reuses_the_routed_input():
    ir = popxl.Ir()
    sg = ir.create_empty_graph("sg")
    with ir.main_graph:
        x = popxl.variable(np.arange(3, dtype=np.float32), name="x")
        y = popxl.variable(np.ones(3, np.float32), name="y")
        ops.call(sg)
    with sg:
        x_sg = route_tensor_into_graph(x)
        assert route_tensor_into_graph(x, sg) is x_sg  # routed once, reused
        y_sg = route_tensor_into_graph(y, modified=True)
        ops.var_updates.copy_var_update_(y_sg, x_sg * 10.0 + y_sg)
    assert not sg.is_input_by_ref(x_sg) and sg.is_input_by_ref(y_sg)
    assert route_tensor_into_graph(x, ir.main_graph) is x
    _, got = _run(ir, read=[x, y])
    np.testing.assert_array_equal(got[y], np.arange(3, dtype=np.float32) * 10 + 1)
    np.testing.assert_array_equal(got[x], np.arange(3, dtype=np.float32))  # read-only input


def test_route_tensor_errors_leave_the_graphs_unchanged():
    ir = popxl.Ir()
    sg = ir.create_empty_graph("sg")
    other = ir.create_empty_graph("other")
    with ir.main_graph:
        a = popxl.variable(np.float32(1.0), name="a")
        ops.call(sg)
    with other:
        ops.call(sg)  # `other` is never called from main: it cannot see `a`
    with ir.main_graph:
        ops.call(other)
    lonely = ir.create_empty_graph("lonely")
    with pytest.raises(ValueError, match="not in a known parent graph"):
        route_tensor_into_graph(a, lonely)
    assert not lonely.inputs
    # sg is called from main (sees `a`) and from other, which does get `a` routed too.
    with sg:
        a_sg = route_tensor_into_graph(a)
    assert a_sg in sg.inputs and len(other.inputs) == 1
    with pytest.raises(TypeError, match="modified must be True or False"):
        route_tensor_into_graph(a, sg, modified=[0])


def test_route_tensor_refuses_a_graph_also_called_from_outside_the_tensors_reach():
    ir = popxl.Ir()
    sg = ir.create_empty_graph("sg")
    side = ir.create_empty_graph("side")
    with side:
        b = popxl.graph_input((), popxl.float32, "b")
        ops.call(sg)
    with ir.main_graph:
        ops.call(sg)
        ops.call(side, popxl.constant(np.float32(0)))
    with pytest.raises(ValueError, match="also called from 'main"):
        route_tensor_into_graph(b, sg)
    assert not sg.inputs and all(len(op.inputs) == 0 for op in ir.main_graph.ops[:1])


# ---- fp8_amax_scale ------------------------------------------------------------------------


def _amax_scale_numpy(x: np.ndarray, fp8_max: float) -> int:
    amax = np.abs(x.astype(np.float32)).max()
    return int(np.clip(np.floor(np.log2(np.float32(fp8_max) / amax)), -31, 31))


@pytest.mark.parametrize("dtype,fp8_max", [(popxl.float8_143, 240.0), (popxl.float8_152, 57344.0)])
@pytest.mark.parametrize("src_dtype,amax", [
    (np.float32, 0.3), (np.float32, 3.0), (np.float32, 1000.0), (np.float32, 1e-9),
    (np.float32, 1e12), (np.float16, 0.3), (np.float16, 1000.0), (np.float16, 0.01),
])  # fmt: skip
def test_fp8_amax_scale_matches_the_log2_formula(dtype, fp8_max, src_dtype, amax):
    rng = np.random.default_rng(0)
    x = (rng.uniform(-1, 1, (4, 5)) * amax).astype(np.float32)
    x[1, 2] = -amax  # the absolute maximum is a negative value
    x = x.astype(src_dtype)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(x)
        scale = fp8_amax_scale(t, dtype)
        s = popxl.d2h_stream(scale.shape, scale.dtype, "s")
        ops.host_store(s, scale)
    assert scale.dtype == popxl.int32 and scale.shape == ()
    out, _ = _run(ir)
    want = _amax_scale_numpy(x, fp8_max)
    assert int(out[s]) == want
    # The bias puts the scaled maximum in the format's top binade: (max/2, max].
    if -31 < want < 31:
        assert fp8_max / 2 < float(np.abs(x.astype(np.float32)).max()) * 2.0**want <= fp8_max


def test_fp8_amax_scale_of_zeros_is_the_largest_bias_and_rejects_other_dtypes():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.zeros((3,), np.float32))
        scale = fp8_amax_scale(t, popxl.float8_152)
        s = popxl.d2h_stream(scale.shape, scale.dtype, "s")
        ops.host_store(s, scale)
        with pytest.raises(TypeError, match="float16 or float32"):
            fp8_amax_scale(popxl.variable(np.zeros(2, np.int32)))
        with pytest.raises(TypeError, match="float8_143 or popxl.float8_152"):
            fp8_amax_scale(t, popxl.float16)
    out, _ = _run(ir)
    assert int(out[s]) == 31


# ---- static sparse ops ---------------------------------------------------------------------


class _CSR:
    """The three arrays of a CSR matrix (scipy's ``csr_matrix`` has the same attributes)."""

    def __init__(self, dense: np.ndarray):
        rows, cols = np.nonzero(dense)
        self.data = dense[rows, cols]
        self.indices = cols
        self.indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=dense.shape[0]))])


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-6), (np.float16, 2e-3)])
@pytest.mark.parametrize("lhs_shape", [(3, 6), (1, 3, 6)])
def test_dense_const_sparse_matmul_matches_the_dense_product(dtype, rtol, lhs_shape):
    rng = np.random.default_rng(1)
    dense = rng.normal(size=(6, 5)).astype(np.float32)
    sparse = random_sparse(dense, density=0.3, seed=3)
    assert np.count_nonzero(sparse) < dense.size and np.count_nonzero(dense) == dense.size
    lhs = rng.normal(size=lhs_shape).astype(dtype)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(lhs)
        y = dense_const_sparse_matmul(x, _CSR(sparse), 5)
        s = popxl.d2h_stream(y.shape, y.dtype, "s")
        ops.host_store(s, y)
    assert y.shape == (*lhs_shape[:-1], 5) and y.dtype == x.dtype
    out, _ = _run(ir)
    want = lhs.astype(np.float32) @ sparse.astype(dtype).astype(np.float32)
    np.testing.assert_allclose(out[s].astype(np.float32), want, rtol=rtol, atol=rtol)


def test_random_sparse_keeps_at_least_one_value_and_does_not_modify_its_input():
    dense = np.ones((4, 4), np.float32)
    out = random_sparse(dense, density=0.0, seed=0)
    assert np.count_nonzero(out) == 1 and (dense == 1).all()
    kept = random_sparse(np.ones((200, 200)), density=0.25, seed=0)
    assert abs(np.count_nonzero(kept) / kept.size - 0.25) < 0.01


def test_dense_const_sparse_matmul_errors():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones((2, 3), np.float32))
        with pytest.raises(ValueError, match="rhs has 2 rows but lhs has 3 columns"):
            dense_const_sparse_matmul(x, _CSR(np.eye(2, dtype=np.float32)), 2)
        with pytest.raises(TypeError, match="CSR matrix"):
            dense_const_sparse_matmul(x, np.eye(3), 3)
        with pytest.raises(ValueError, match="outside"):
            dense_const_sparse_matmul(x, _CSR(np.eye(3, dtype=np.float32)), 2)
        with pytest.raises(TypeError, match="float16 or float32"):
            dense_const_sparse_matmul(popxl.variable(np.ones((2, 3), np.int32)), _CSR(np.eye(3)), 3)


# ---- seed_variable -------------------------------------------------------------------------


def test_seed_variable_holds_create_seeds_per_group_and_keeps_device_updates():
    ir = popxl.Ir(replication=4)
    with ir.main_graph, popxl.in_sequence():  # the store reads the seed before its update
        var, seed = seed_variable(7)
        s = popxl.d2h_stream(seed.shape, seed.dtype, "s")
        ops.host_store(s, seed)
        nxt, _ = ops.split_random_seed(seed)
        ops.var_updates.copy_var_update_(seed, nxt)
    assert seed.shape == (2,) and seed.dtype == popxl.uint32 and var.shape == (2,)
    initial = popxl.create_seeds(7, replicas=4)
    with popxl.Session(ir, "ipu_model") as session:
        first = session.run()[s]
        advanced = session.get_tensor_data(var)
        second = session.run()[s]
        # A restored seed is reloaded on device: the run after it sees the written value.
        session.write_variables_data({var: initial})
        third = session.run()[s]
    np.testing.assert_array_equal(first, initial)  # replica r holds group r's seed
    assert len({tuple(r) for r in first}) == 4
    np.testing.assert_array_equal(second, advanced)
    assert not np.array_equal(advanced, initial)
    np.testing.assert_array_equal(third, initial)


def test_seed_variable_shares_a_seed_within_a_replica_group():
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        var, seed = seed_variable(3, ir.replica_grouping(group_size=2))
        s = popxl.d2h_stream(seed.shape, seed.dtype, "s")
        ops.host_store(s, seed)
        with pytest.raises(TypeError, match="seed must be an int"):
            seed_variable(1.5)
    out, _ = _run(ir)
    seeds = popxl.create_seeds(3, replicas=2)
    np.testing.assert_array_equal(out[s], seeds[[0, 0, 1, 1]])
    assert torch is not None


# ---- performance_utils: the FLOPs estimate -----------------------------------------------------


def test_evaluate_flops_counts_matmuls_elementwise_ops_and_called_graphs():
    ir = popxl.Ir(replication=2)
    with ir.main_graph, popxl.in_sequence(True):
        ones = lambda *shape: popxl.constant(np.ones(shape, np.float32))  # noqa: E731
        _ = ones(4) @ ones(4, 8)  # vector-matrix: 2 * 4 * 8
        _ = ones(4) @ ones(4)  # dot: 2 * 4
        _ = ones(10, 9) @ ones(9, 5)  # 2 * 9 * 10 * 5
        _ = popxl.ops.matmul(ones(3, 5, 10, 9), ones(3, 5, 9, 3))  # 2 * 9 * (3*5*10*3)
        sub = ir.create_graph(lambda a, b: a * b + b, ones(2, 3), ones(2, 3))  # 6 + 6 per call
        popxl.ops.repeat(sub, 3, ones(2, 3), ones(2, 3))
        x = popxl.variable(np.random.default_rng(0).normal(size=(2, 6, 16)).astype(np.float32))
        facts, gn = GroupNorm(2).create_graph(x)
        gn.bind(facts.init()).call(x)
    flops = evaluate_FLOPs(ir.main_graph)
    assert sorted(flops["MatMul"].values()) == [8, 64, 900, 8100]
    (repeat_key,) = flops["Mul"]  # the repeat's callee, counted three times
    assert repeat_key.startswith("Repeat_") and flops["Mul"][repeat_key] == {0: 18}
    assert flops["Add"][repeat_key] == {1: 18}
    # Group norm of (N=2, C=6, 16) in G=2 groups (upstream's count): mean 48, variance
    # 2 * 48 + 2 * 4, normalise 2 * 192, scale and shift 2 * 192.
    (call_key,) = flops["GroupNormalization"]
    assert sum(flops["GroupNormalization"][call_key].values()) == 48 + 104 + 4 * 192
    tot = 8 + 64 + 900 + 8100 + 36 + 920
    assert flops["TOT"] == tot
    assert evaluate_ir_FLOPs(ir)["TOT"] == total_FLOPs(ir) == 2 * tot  # two replicas
    assert format_flops_scientific(9072) == "9.072E+03"
    assert format_flops_scientific(123456) == "0.123E+06"
    assert format_flops_scientific(64, "K") == "0.064E+03"
    with pytest.raises(ValueError, match="unknown format"):
        format_flops_scientific(1, "P")
    print_FLOPs(flops)
    print_FLOPs(flops, "flat")
