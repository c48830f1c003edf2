"""PopXL internals that programs reach: ``Graph._by_ref_inputs``, ``ReplicaGrouping``
properties, ``RemoteBuffer.set_remote_buffer_info`` / ``_current_ir``,
``popxl.context._execution_context`` and the stream sets of ``Ir``."""

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.context import _execution_context


def test_by_ref_inputs_is_a_live_set_of_the_graphs_by_reference_inputs():
    ir = popxl.Ir()

    def inc(x: popxl.TensorByRef, y: popxl.Tensor):
        ops.var_updates.accumulate_(x, y)

    spec = popxl.TensorSpec((2,), popxl.float32)
    g = ir.create_graph(inc, spec, spec)
    x_in, y_in = g.inputs
    assert set(g._by_ref_inputs) == {x_in} and y_in not in g._by_ref_inputs
    g._by_ref_inputs.add(y_in)
    assert g.is_input_by_ref(y_in)
    g._by_ref_inputs.discard(y_in)
    assert not g.is_input_by_ref(y_in)
    with pytest.raises(ValueError, match="only graph inputs can be passed by reference"):
        g._by_ref_inputs.add(ir.main_graph)


@pytest.mark.parametrize("how", ["call", "repeat"])
def test_by_ref_input_changes_reach_the_caller_and_by_value_ones_do_not(how):
    ir = popxl.Ir()

    def inc(x: popxl.TensorByRef, y: popxl.Tensor):
        ops.var_updates.accumulate_(x, popxl.constant(np.ones(2, np.float32)))
        ops.var_updates.accumulate_(y, popxl.constant(np.ones(2, np.float32)))

    spec = popxl.TensorSpec((2,), popxl.float32)
    g = ir.create_graph(inc, spec, spec)
    with ir.main_graph:
        a = popxl.variable(np.zeros(2, np.float32), name="a")
        b = popxl.variable(np.zeros(2, np.float32), name="b")
        if how == "call":
            info = ops.call_with_info(g, a, b)
        else:
            info = ops.repeat_with_info(g, 3, a, b)
    # The call site records the by-reference input as modified (CallSiteInfo), not the other.
    assert info._op.attrs.modified == frozenset({0})
    with popxl.Session(ir) as session:
        session.run()
    expected = 1 if how == "call" else 3
    np.testing.assert_array_equal(session.get_tensor_data(a), [expected] * 2)
    np.testing.assert_array_equal(session.get_tensor_data(b), [0, 0])


def test_replica_grouping_properties_of_constant_and_non_constant_groupings():
    ir = popxl.Ir(replication=8)
    rg = ir.replica_grouping(stride=2, group_size=4)
    assert (rg.num_replicas, rg.stride, rg.group_size, rg.num_groups) == (8, 2, 4, 2)
    assert rg.is_const and rg.assignment == [0, 1, 0, 1, 0, 1, 0, 1]
    nc = ir.replica_grouping_from_assignments([0, 0, 1, 1, 1, 1, 0, 0])
    assert (nc.num_replicas, nc.group_size, nc.num_groups) == (8, 4, 2)
    assert not nc.is_const
    with pytest.raises(NotImplementedError):
        _ = nc.stride


def test_set_remote_buffer_info_resets_the_buffer_and_current_ir_is_its_ir():
    ir = popxl.Ir()
    with ir.main_graph:
        rb = popxl.remote_buffer((2, 3), popxl.float32, 2)
    assert rb._current_ir is ir
    rb.set_remote_buffer_info(popxl.int32, (4,), 5)
    assert (rb.tensor_dtype, rb.tensor_shape, rb.entries) == (popxl.int32, (4,), 5)
    with pytest.raises(ValueError, match=r"^Entries must be a non-zero, positive integer\. Got 0"):
        rb.set_remote_buffer_info(popxl.float32, (1,), 0)
    assert (rb.tensor_dtype, rb.tensor_shape, rb.entries) == (popxl.int32, (4,), 5)  # unchanged
    rb.entries = 3
    assert rb.entries == 3 and rb.tensor_shape == (4,)


def test_execution_context_puts_ops_in_the_weights_from_host_fragment():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.zeros(2, np.float32), name="v")
        with _execution_context(popxl.ExecutionContext.WeightsFromHostFragment):
            ops.var_updates.accumulate_(v, popxl.constant(np.full(2, 10.0, np.float32)))
        ops.var_updates.accumulate_(v, popxl.constant(np.ones(2, np.float32)))
        s = popxl.d2h_stream((2,), popxl.float32)
        ops.host_store(s, v)
    with popxl.Session(ir) as session:
        first = session.run()[s]
        second = session.run()[s]
    # +10 once when the weights are uploaded, +1 on each run.
    np.testing.assert_array_equal(first, [11, 11])
    np.testing.assert_array_equal(second, [12, 12])
    with ir.main_graph, pytest.raises(ValueError, match="not supported by the simulator"):
        with _execution_context(popxl.ExecutionContext.Subgraph):
            pass


def test_stream_sets_hold_the_stream_objects_that_have_host_ops():
    ir = popxl.Ir()
    with ir.main_graph:
        used_in = popxl.h2d_stream((2,), popxl.float32, "x")
        unused_in = popxl.h2d_stream((2,), popxl.float32, "unused")
        out = popxl.d2h_stream((2,), popxl.float32, "y")
        ops.host_store(out, ops.host_load(used_in) + 1)
    h2d, d2h = ir.get_all_h2d_streams(), ir.get_all_d2h_streams()
    assert h2d == {used_in} and d2h == {out} and unused_in not in h2d
    # The members are the very objects the program created (usable as run() keys).
    assert next(iter(h2d)) is used_in and next(iter(d2h)) is out
    assert ir.get_all_h2d_streams() == h2d  # stable across calls
