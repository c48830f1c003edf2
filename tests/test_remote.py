"""Remote buffers, remote variables and RTS against spec/popxl.md §4, §6.4 and §11.1-4, 22, 23.

Every program is built by a function so it can run on both executors (an Ir has one Session);
values are checked per replica. Integer programs are compared exactly; float programs with the
tolerances stated at the assertion.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.transforms import autodiff

EXECUTORS = ("fast", "reference")


def session(ir, executor="fast"):
    return popxl.Session(ir, "ipu_model", executor=executor)


def host_store(t):
    stream = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(stream, t)
    return stream


def buffers(s):
    """The simulator's stacked remote buffers, ``{id: [R, entries, *shape]}`` as numpy."""
    return {k: v.detach().cpu().numpy().copy() for k, v in s._state.buffers.items()}


# ---- remote buffers (§4.2) ----------------------------------------------------------------


def test_remote_buffer_ids_shapes_and_entries_rules():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.remote_buffer((2, 3), popxl.float32)
        b = popxl.remote_buffer((4,), popxl.int32, entries=3)
        with pytest.raises(ValueError, match="Entries must be a non-zero, positive integer"):
            popxl.remote_buffer((1,), popxl.float32, 0)
    assert (a.remote_buffer_id, b.remote_buffer_id) == (1, 2)
    assert (a.tensor_shape, a.tensor_dtype, a.entries, a.meta_shape) == (
        (2, 3),
        popxl.float32,
        1,
        (),
    )
    with pytest.raises(AttributeError):
        a.tensor_shape = (1,)
    with pytest.raises(ValueError):
        b.entries = 0
    b.entries = 5
    assert b.entries == 5


def test_remote_load_store_shape_and_dtype_must_match_buffer():
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32)
        with pytest.raises(ValueError, match=r"^Tensor does not match buffer\. Tensor 't'"):
            ops.remote_store(buf, 0, popxl.variable(np.zeros(3, np.float32)))
        with pytest.raises(ValueError, match="does not match buffer"):
            ops.remote_load_(buf, 0, popxl.variable(np.zeros(2, np.int32)))


# ---- §11.1 / §11.2: remote variables ------------------------------------------------------


def build_remote_variable():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        buf = popxl.remote_buffer((), popxl.int32, 1)
        remote_x = popxl.remote_variable(np.array(1, np.int32), buf, 0)
        y = popxl.variable(np.array(2, np.int32))
        loaded = ops.remote_load(buf, 0)
        ops.var_updates.accumulate_(loaded, y)
        ops.remote_store(buf, 0, loaded)
        out = host_store(loaded)
    return ir, remote_x, out


@pytest.mark.parametrize("executor", EXECUTORS)
def test_remote_variable_accumulate_and_store_gives_3(executor):
    ir, remote_x, out = build_remote_variable()
    s = session(ir, executor)
    with s:
        result = s.run()[out]
        assert result.shape == () and result == 3
        assert s.get_tensor_data(remote_x) == 3
    assert remote_x.shape == () and remote_x.shape_on_host == ()


def build_grouped_remote_variable():
    ir = popxl.Ir(2)
    with ir.main_graph, popxl.in_sequence(True):
        rg = ir.replica_grouping(group_size=1)
        v_h = np.arange(64, dtype=np.int32).reshape(2, 32)
        buf = popxl.remote_buffer((32,), popxl.int32, 1)
        remote_v = popxl.remote_variable(v_h, buf, 0, replica_grouping=rg)
        v = ops.remote_load(buf, 0)
        initial = host_store(v)
        v += 1
        ops.remote_store(buf, 0, v)
    return ir, remote_v, v_h, initial


@pytest.mark.parametrize("executor", EXECUTORS)
def test_grouped_remote_variable_each_replica_uses_its_row(executor):
    ir, remote_v, v_h, initial = build_grouped_remote_variable()
    assert remote_v.shape == (32,) and remote_v.shape_on_host == (2, 32)
    s = session(ir, executor)
    with s:
        out = s.run()
        np.testing.assert_array_equal(out[initial], v_h)  # replica r loaded row r
        np.testing.assert_array_equal(s.get_tensor_data(remote_v), v_h + 1)


def test_remote_variable_shape_rules_follow_variable():
    ir = popxl.Ir(4)
    with ir.main_graph:
        rg = ir.replica_grouping(group_size=2)
        buf = popxl.remote_buffer((3,), popxl.float32)
        with pytest.raises(ValueError, match="group dimension"):
            popxl.remote_variable(np.zeros(3, np.float32), buf, 0, replica_grouping=rg)
        with pytest.raises(ValueError, match="retrieval_mode"):
            popxl.remote_variable(np.zeros(3, np.float32), buf, 0, retrieval_mode="first")
        with pytest.raises(TypeError, match="RemoteBuffer"):
            popxl.remote_variable(np.zeros(3, np.float32), "buffer", 0)
        with pytest.raises(ValueError, match="offset"):
            popxl.remote_variable(np.zeros(3, np.float32), buf, -1)
        v = popxl.remote_variable(np.zeros((2, 3), np.float32), buf, 0, replica_grouping=rg)
        assert v.shape == (3,) and v.shape_on_host == (2, 3) and v.retrieval_mode == "one_per_group"
        g = ir.create_empty_graph("sub")
    with g, pytest.raises(ValueError, match="main graph"):
        popxl.remote_variable(np.zeros(3, np.float32), buf, 0)


def test_remote_variable_has_no_on_chip_storage():
    ir = popxl.Ir(2)
    with ir.main_graph:
        buf = popxl.remote_buffer((5,), popxl.float32, 2)
        v = popxl.remote_variable(np.ones(5, np.float32), buf, 1)
    s = session(ir)
    assert v.id not in s._state.vars
    with s:
        b = buffers(s)[buf.remote_buffer_id]
    np.testing.assert_array_equal(b[:, 1], np.ones((2, 5)))
    np.testing.assert_array_equal(b[:, 0], np.zeros((2, 5)))  # unbacked slots start at zero


# ---- §4.4 / §4.5: divergence, retrieval modes, tensor offsets ------------------------------


def build_divergence(retrieval_mode="one_per_group"):
    """R=4, one group; every replica stores its own value at its own (host-loaded) offset."""
    ir = popxl.Ir(4)
    with ir.main_graph, popxl.in_sequence(True):
        buf = popxl.remote_buffer((2,), popxl.int32, 3)
        a = popxl.remote_variable(np.array([1, 2], np.int32), buf, 0, retrieval_mode=retrieval_mode)
        b = popxl.remote_variable(np.array([3, 4], np.int32), buf, 2, retrieval_mode=retrieval_mode)
        off_stream = popxl.h2d_stream((), popxl.int32, "offset")
        val_stream = popxl.h2d_stream((2,), popxl.int32, "value")
        offset = ops.host_load(off_stream)
        ops.remote_store(buf, offset, ops.host_load(val_stream))
        slots = [host_store(ops.remote_load(buf, i)) for i in range(3)]
        at_offset = host_store(ops.remote_load(buf, offset))
    inputs = {
        off_stream: np.array([0, 1, 2, 0], np.int32),
        val_stream: np.array([[10, 11], [20, 21], [30, 31], [40, 41]], np.int32),
    }
    return ir, (a, b), inputs, slots, at_offset


@pytest.mark.parametrize("executor", EXECUTORS)
def test_stores_with_per_replica_offsets_diverge_per_replica(executor):
    ir, (a, b), inputs, slots, at_offset = build_divergence()
    s = session(ir, executor)
    with s:
        out = s.run(inputs)
        # slot 0: replicas 0 and 3 overwrote it; 1 and 2 keep a's value.
        np.testing.assert_array_equal(out[slots[0]], [[10, 11], [1, 2], [1, 2], [40, 41]])
        np.testing.assert_array_equal(out[slots[1]], [[0, 0], [20, 21], [0, 0], [0, 0]])
        np.testing.assert_array_equal(out[slots[2]], [[3, 4], [3, 4], [30, 31], [3, 4]])
        np.testing.assert_array_equal(out[at_offset], inputs[tuple(inputs)[1]])
        # one_per_group reports the first member (replica 0), divergence is not reconciled.
        np.testing.assert_array_equal(s.get_tensor_data(a), [10, 11])
        np.testing.assert_array_equal(s.get_tensor_data(b), [3, 4])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_all_replicas_remote_variable_reads_every_replica(executor):
    ir, (a, b), inputs, _, _ = build_divergence("all_replicas")
    s = session(ir, executor)
    with s:
        s.run(inputs)
        np.testing.assert_array_equal(s.get_tensor_data(a), [[10, 11], [1, 2], [1, 2], [40, 41]])
        np.testing.assert_array_equal(s.get_tensor_data(b), [[3, 4], [3, 4], [30, 31], [3, 4]])
        with pytest.raises(NotImplementedError):
            s.write_variable_data(a, np.array([0, 0], np.int32))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_in_place_remote_load_updates_tensor_and_meta_shape(executor):
    ir = popxl.Ir(2)
    with ir.main_graph, popxl.in_sequence(True):
        buf = popxl.replica_sharded_buffer((2, 3), popxl.float32)
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        popxl.remote_replica_sharded_variable(x, buf, 0)
        t = popxl.variable(np.full(3, -1.0, np.float32))
        before = host_store(t)
        loaded = ops.remote_load_(buf, 0, t)
        assert loaded.meta_shape == (2, 3) and t.meta_shape == (2, 3)
        after = host_store(t)
        gathered = host_store(ops.collectives.replicated_all_gather(loaded))
    s = session(ir, executor)
    with s:
        out = s.run()
    np.testing.assert_array_equal(out[before], np.full((2, 3), -1.0))
    np.testing.assert_array_equal(out[after], [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(out[gathered], [x, x])


# ---- §11.3 / §11.4: RTS -------------------------------------------------------------------


def build_remote_rts():
    ir = popxl.Ir(2)
    with ir.main_graph, popxl.in_sequence(True):
        x = np.array([1, 2], np.int32)
        buf = popxl.remote_buffer((1,), popxl.int32, 1)
        remote_x = popxl.remote_replica_sharded_variable(x, buf, 0)
        assert buf.meta_shape == (2,)
        loaded = ops.remote_load(buf, 0)
        shards = host_store(loaded)
        full = ops.collectives.replicated_all_gather(loaded)
        assert full.shape == (2,)
        gathered = host_store(full)
        ops.var_updates.accumulate_(full, popxl.constant(np.array([3, 4], np.int32)))
        sliced = ops.collectives.replica_sharded_slice(full)
        ops.remote_store(buf, 0, sliced)
    return ir, remote_x, shards, gathered


@pytest.mark.parametrize("executor", EXECUTORS)
def test_remote_rts_variable_gather_update_slice_store_gives_4_6(executor):
    ir, remote_x, shards, gathered = build_remote_rts()
    assert remote_x.shape == (2,)
    s = session(ir, executor)
    with s:
        out = s.run()
        np.testing.assert_array_equal(out[shards], [[1], [2]])
        np.testing.assert_array_equal(out[gathered], [[1, 2], [1, 2]])
        np.testing.assert_array_equal(s.get_tensor_data(remote_x), [4, 6])


def build_rts_variable():
    ir = popxl.Ir(2)
    with ir.main_graph, popxl.in_sequence(True):
        remote_x, loaded_x = popxl.replica_sharded_variable(np.array([1, 2], np.int32), popxl.int32)
        sharded_y = ops.collectives.replica_sharded_slice(
            popxl.variable(np.array([3, 4], np.int32))
        )
        ops.var_updates.accumulate_(loaded_x, sharded_y)
    return ir, remote_x, loaded_x


@pytest.mark.parametrize("executor", EXECUTORS)
def test_rts_variable_updated_in_place_gives_4_6_after_exit(executor):
    ir, remote_x, loaded_x = build_rts_variable()
    assert loaded_x.shape == (1,) and loaded_x.meta_shape == (2,) and remote_x.shape == (2,)
    s = session(ir, executor)
    with s:
        s.run()
        with pytest.raises(TypeError, match="is not of type Constant or Variable"):
            s.get_tensor_data(loaded_x)
    np.testing.assert_array_equal(s.get_tensor_data(remote_x), [4, 6])


def test_rts_variable_loads_in_weights_from_host_and_stores_in_weights_to_host():
    ir, remote_x, loaded_x = build_rts_variable()
    main = ir.main_graph
    (load,) = main._ops_in_context("weights_from_host")
    (store,) = main._ops_in_context("weights_to_host")
    assert load.kind == "remote_load" and load.outputs == (loaded_x,)
    assert loaded_x.name == remote_x.name + "_rts"
    assert store.kind == "remote_store" and store.inputs[0] is loaded_x
    assert main._op_context == "normal"


def test_rts_round_trip_is_exact_and_writes_are_sharded():
    ir = popxl.Ir(4)
    data = np.arange(10, dtype=np.float32).reshape(2, 5) / 7
    with ir.main_graph:
        w, shard = popxl.replica_sharded_variable(data)
        shards = host_store(shard)
    assert shard.shape == (3,)  # ceil(10 / 4), padded with 2 zeros
    s = session(ir)
    with s:
        np.testing.assert_array_equal(s.run()[shards].reshape(-1)[:10], data.reshape(-1))
        np.testing.assert_array_equal(s.run()[shards][3, 1:], [0, 0])
        np.testing.assert_array_equal(s.get_tensor_data(w), data)
        s.write_variable_data(w, -data)  # attached: uploaded and re-loaded at once
        np.testing.assert_array_equal(s.run()[shards].reshape(-1)[:10], -data.reshape(-1))
    np.testing.assert_array_equal(s.get_tensor_data(w), -data)
    s.write_variable_data(w, 2 * data)  # detached: uploaded at the next enter
    with s:
        np.testing.assert_array_equal(s.run()[shards].reshape(-1)[:10], 2 * data.reshape(-1))


# ---- §4.5: shard_over, groupings ----------------------------------------------------------


def test_shard_over_smaller_than_group_repeats_shards_per_block():
    # Docs example: w=[1,2], G=4, shard_over=2 -> replicas get [1],[2],[1],[2].
    ir = popxl.Ir(4)
    with ir.main_graph:
        w, shard = popxl.replica_sharded_variable(np.array([1, 2], np.int32), shard_over=2)
        out = host_store(shard)
    s = session(ir)
    with s:
        np.testing.assert_array_equal(s.run()[out], [[1], [2], [1], [2]])
        np.testing.assert_array_equal(s.get_tensor_data(w), [1, 2])


def build_shard_over_matmul(executor_check=None):
    # §11.22: R=8, a 16-element w in 4 shards of 4; replicas 0-3 and 4-7 each hold a copy.
    rng = np.random.default_rng(22)
    w_np = rng.standard_normal((4, 4)).astype(np.float32)
    m_np = rng.standard_normal((4, 2)).astype(np.float32)
    x_np = rng.standard_normal((3, 4)).astype(np.float32)
    ir = popxl.Ir(8)
    with ir.main_graph:
        w_v, w_shard = popxl.replica_sharded_variable(w_np, shard_over=4)
        assert w_shard.shape == (4,) and w_shard.meta_shape == (4, 4)
        shards = host_store(w_shard)
        full = ops.collectives.replicated_all_gather(
            w_shard, group=ir.replica_grouping(group_size=4)
        )
        y = (popxl.constant(x_np) @ full) @ popxl.constant(m_np)
        out = host_store(y)
    return ir, w_v, w_np, (x_np @ w_np) @ m_np, shards, out


@pytest.mark.parametrize("executor", EXECUTORS)
def test_shard_over_4_of_8_every_replica_computes_the_same_product(executor):
    ir, w_v, w_np, expected, shards, out = build_shard_over_matmul()
    s = session(ir, executor)
    with s:
        result = s.run()
        for r in range(8):
            np.testing.assert_array_equal(result[shards][r], w_np.reshape(4, 4)[r % 4])
            np.testing.assert_allclose(result[out][r], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(s.get_tensor_data(w_v), w_np)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_grouped_rts_variable_shards_each_group_value(executor):
    # R=4, groups {0,1} and {2,3}; each group's 3 elements sharded over its 2 members.
    ir = popxl.Ir(4)
    data = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    with ir.main_graph:
        rg = ir.replica_grouping(group_size=2)
        w, shard = popxl.replica_sharded_variable(data, replica_grouping=rg)
        out = host_store(shard)
        gathered = host_store(ops.collectives.replicated_all_gather(shard, group=rg))
    assert w.shape == (3,) and w.shape_on_host == (2, 3) and shard.shape == (2,)
    s = session(ir, executor)
    with s:
        result = s.run()
        np.testing.assert_array_equal(result[out], [[1, 2], [3, 0], [4, 5], [6, 0]])
        np.testing.assert_array_equal(
            result[gathered], [[1, 2, 3], [1, 2, 3], [4, 5, 6], [4, 5, 6]]
        )
        np.testing.assert_array_equal(s.get_tensor_data(w), data)
        s.write_variable_data(w, data[::-1].copy())
        np.testing.assert_array_equal(s.run()[out], [[4, 5], [6, 0], [1, 2], [3, 0]])
        np.testing.assert_array_equal(s.get_tensor_data(w), data[::-1])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_strided_grouping_rts_shards_follow_index_in_group(executor):
    # stride 2: groups {0,2} and {1,3}; the member with index i holds shard i.
    ir = popxl.Ir(4)
    data = np.array([[1, 2], [3, 4]], np.int32)
    with ir.main_graph:
        rg = ir.replica_grouping(stride=2, group_size=2)
        w, shard = popxl.replica_sharded_variable(data, replica_grouping=rg)
        out = host_store(shard)
    s = session(ir, executor)
    with s:
        np.testing.assert_array_equal(s.run()[out], [[1], [3], [2], [4]])
        np.testing.assert_array_equal(s.get_tensor_data(w), data)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_non_constant_grouping_remote_and_rts_variables(executor):
    # Assignment [0,0,1,1,0,0,1,1]: const_rg is (stride 1, group size 2).
    ir = popxl.Ir(8)
    data = np.arange(6, dtype=np.int32).reshape(2, 3) + 1
    with ir.main_graph:
        rg = ir.replica_grouping_from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
        buf = popxl.remote_buffer((3,), popxl.int32)
        v = popxl.remote_variable(data, buf, 0, replica_grouping=rg)
        loaded = host_store(ops.remote_load(buf, 0))
        w, shard = popxl.replica_sharded_variable(data, replica_grouping=rg)
        shards = host_store(shard)
    assert w.shape == (3,) and shard.shape == (2,)
    s = session(ir, executor)
    with s:
        out = s.run()
        np.testing.assert_array_equal(out[loaded], data[[0, 0, 1, 1, 0, 0, 1, 1]])
        g0, g1 = [[1, 2], [3, 0]], [[4, 5], [6, 0]]
        np.testing.assert_array_equal(out[shards], g0 + g1 + g0 + g1)
        np.testing.assert_array_equal(s.get_tensor_data(v), data)
        np.testing.assert_array_equal(s.get_tensor_data(w), data)
        s.write_variables_data({v: data[::-1].copy(), w: data[::-1].copy()})
        out = s.run()
        np.testing.assert_array_equal(out[loaded], data[::-1][[0, 0, 1, 1, 0, 0, 1, 1]])
        np.testing.assert_array_equal(out[shards], g1 + g0 + g1 + g0)
        np.testing.assert_array_equal(s.get_tensor_data(w), data[::-1])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_rts_all_replicas_copies_the_group_value_hiding_divergence(executor):
    ir = popxl.Ir(4)
    with ir.main_graph, popxl.in_sequence(True):
        buf = popxl.replica_sharded_buffer((4,), popxl.int32, shard_over=2)
        w = popxl.remote_replica_sharded_variable(
            np.array([1, 2, 3, 4], np.int32), buf, 0, retrieval_mode="all_replicas"
        )
        shard = ops.remote_load(buf, 0)
        # Only replicas 2 and 3 change their shards: the first k=2 members are unchanged.
        r = ops.host_load(popxl.h2d_stream((), popxl.int32, "replica"))
        bump = ops.cast(ops.greater(r, popxl.constant(1, popxl.int32)), popxl.int32)
        ops.remote_store(buf, 0, shard + bump * 100)
    s = session(ir, executor)
    with s:
        s.run({ir.get_all_h2d_streams().pop(): np.arange(4, dtype=np.int32)})
        np.testing.assert_array_equal(s.get_tensor_data(w), [[1, 2, 3, 4]] * 4)
        b = buffers(s)[buf.remote_buffer_id][:, 0]
    np.testing.assert_array_equal(b, [[1, 2], [3, 4], [101, 102], [103, 104]])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_two_rts_variables_in_one_buffer_at_different_offsets(executor):
    ir = popxl.Ir(4)
    a_np = np.arange(8, dtype=np.float32).reshape(2, 4)
    b_np = -np.arange(8, dtype=np.float32).reshape(2, 4)
    with ir.main_graph, popxl.in_sequence(True):
        buf = popxl.replica_sharded_buffer((2, 4), popxl.float32, entries=2)
        assert buf.tensor_shape == (2,) and buf.meta_shape == (2, 4)
        a = popxl.remote_replica_sharded_variable(a_np, buf, 0)
        b = popxl.remote_replica_sharded_variable(b_np, buf, 1)
        sa, sb = ops.remote_load(buf, 0), ops.remote_load(buf, 1)
        shards = host_store(ops.concat([sa, sb]))
        ops.remote_store(buf, 0, sa + sb)  # a <- a + b
        ops.remote_store(buf, 1, sb * 2)  # b <- 2b
    s = session(ir, executor)
    with s:
        out = s.run()[shards]
        np.testing.assert_array_equal(out[:, :2], a_np.reshape(4, 2))
        np.testing.assert_array_equal(out[:, 2:], b_np.reshape(4, 2))
        data = s.get_tensors_data([a, b])
    np.testing.assert_array_equal(data[a], a_np + b_np)
    np.testing.assert_array_equal(data[b], 2 * b_np)


# ---- §4.6 / §4.7 / §4.8: construction rules -----------------------------------------------


def test_replica_sharded_buffer_shapes_and_shard_over_errors():
    ir = popxl.Ir(8)
    with ir.main_graph:
        buf = popxl.replica_sharded_buffer((5, 3), popxl.float32)
        assert (buf.tensor_shape, buf.meta_shape, buf.entries) == ((2,), (5, 3), 1)
        rg = ir.replica_grouping(group_size=4)
        buf = popxl.replica_sharded_buffer((2, 10), popxl.float16, rg, shard_over=2, entries=3)
        assert (buf.tensor_shape, buf.meta_shape, buf.entries) == ((5,), (10,), 3)
        assert buf.tensor_dtype == popxl.float16
        with pytest.raises(ValueError, match="larger than the replica group size 8"):
            popxl.replica_sharded_buffer((16,), popxl.float32, shard_over=16)
        with pytest.raises(ValueError, match="larger than the replica group size 4"):
            popxl.replica_sharded_buffer((2, 16), popxl.float32, rg, shard_over=8)
        with pytest.raises(ValueError, match="does not divide the replica group size 4"):
            popxl.replica_sharded_buffer((2, 16), popxl.float32, rg, shard_over=3)
        with pytest.raises(ValueError, match="group dimension"):
            popxl.replica_sharded_buffer((16,), popxl.float32, rg)


def test_rts_variables_need_replication():
    ir = popxl.Ir(1)
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32)
        with pytest.raises(ValueError, match="needs replication"):
            popxl.remote_replica_sharded_variable(np.zeros(2, np.float32), buf, 0)
        with pytest.raises(ValueError, match="needs replication"):
            popxl.replica_sharded_variable(np.zeros(2, np.float32))
    assert len(ir._remote_buffers) == 1  # the failed replica_sharded_variable made no buffer


def test_remote_rts_variable_meta_shape_is_set_then_checked():
    ir = popxl.Ir(2)
    with ir.main_graph:
        buf = popxl.remote_buffer((3,), popxl.float32, 2)
        popxl.remote_replica_sharded_variable(np.zeros((2, 3), np.float32), buf, 0)
        assert buf.meta_shape == (2, 3)
        popxl.remote_replica_sharded_variable(np.ones((2, 3), np.float32), buf, 1)
        with pytest.raises(ValueError, match=r"Cannot use RemoteBuffer\[id=1\]"):
            popxl.remote_replica_sharded_variable(np.zeros((6,), np.float32), buf, 1)
        bad = popxl.remote_buffer((4,), popxl.float32)
        with pytest.raises(ValueError, match="needs one of"):
            popxl.remote_replica_sharded_variable(np.zeros((6,), np.float32), bad, 0)


# ---- offsets out of range: clear errors, buffers unchanged --------------------------------


def test_variable_offset_beyond_entries_fails_at_upload_naming_buffer():
    ir = popxl.Ir(2)
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32, 2)
        popxl.remote_variable(np.ones(2, np.float32), buf, 0)
        popxl.remote_variable(np.ones(2, np.float32), buf, 2)
    s = session(ir)
    with pytest.raises(ValueError, match=r"offset 2 of RemoteBuffer\[id=1.*entries=2\]"):
        s.__enter__()
    np.testing.assert_array_equal(buffers(s)[1], np.zeros((2, 2, 2)))


def test_variable_dtype_must_match_buffer():
    ir = popxl.Ir(2)
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32)
        popxl.remote_variable(np.ones(2, np.int32), buf, 0)
    with pytest.raises(ValueError, match="has dtype int32 but RemoteBuffer"):
        session(ir).__enter__()


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("op", ["load", "store"])
def test_runtime_offset_out_of_range_is_an_error_and_leaves_buffers_unchanged(executor, op):
    ir = popxl.Ir(2)
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.int32, 3)
        popxl.remote_variable(np.array([7, 8], np.int32), buf, 1)
        stream = popxl.h2d_stream((), popxl.int32, "offset")
        offset = ops.host_load(stream)
        if op == "load":
            host_store(ops.remote_load(buf, offset))
        else:
            ops.remote_store(buf, offset, popxl.constant(np.array([5, 5], np.int32)))
    s = session(ir, executor)
    with s:
        before = buffers(s)
        with pytest.raises(
            ValueError, match=r"offset 3 is out of range for RemoteBuffer\[id=1\].*3 entries"
        ):
            s.run({stream: np.array([0, 3], np.int32)})
        np.testing.assert_array_equal(buffers(s)[1], before[1])


# ---- §11.23 and seed 000: RTS training -----------------------------------------------------


def build_rts_autodiff():
    """R=4, a (4,4) remote RTS weight; dW from autodiff, reduce-scattered, accumulated."""
    R = 4
    rng = np.random.default_rng(23)
    w_np = rng.standard_normal((4, 4)).astype(np.float32)
    x_np = rng.standard_normal((R, 2, 4)).astype(np.float32)
    ir = popxl.Ir(R)
    with ir.main_graph, popxl.in_sequence(True):
        buf = popxl.remote_buffer((4,), popxl.float32, 1)
        w = popxl.remote_replica_sharded_variable(w_np, buf, 0)
        shard = ops.remote_load(buf, 0)
        full_w = ops.collectives.replicated_all_gather(shard)
        assert full_w.shape == (4, 4)
        x_stream = popxl.h2d_stream((2, 4), popxl.float32, "x")
        x = ops.host_load(x_stream)

        def forward(x, w):
            return x @ w

        fwd = ir.create_graph(forward, x, full_w)
        grad = autodiff(fwd)
        info = ops.call_with_info(fwd, x, full_w)
        seed = popxl.constant(np.ones((2, 4), np.float32))
        _, dw = ops.call(grad.graph, seed, inputs_dict=grad.inputs_dict(info))
        dw_shard = ops.collectives.replicated_reduce_scatter(
            dw, "add", configure_output_for_replicated_tensor_sharding=True
        )
        gathered_dw = host_store(ops.collectives.replicated_all_gather(dw_shard))
        ops.var_updates.accumulate_(shard, dw_shard)
        gathered_w = host_store(ops.collectives.replicated_all_gather(shard))
        ops.remote_store(buf, 0, shard)
    return ir, w, w_np, {x_stream: x_np}, gathered_dw, gathered_w


@pytest.mark.parametrize("executor", EXECUTORS)
def test_rts_autodiff_update_equals_initial_plus_gathered_grad(executor):
    ir, w, w_np, inputs, gathered_dw, gathered_w = build_rts_autodiff()
    x_np = next(iter(inputs.values()))
    expected_dw = sum(x_np[r].T @ np.ones((2, 4), np.float32) for r in range(4))
    s = session(ir, executor)
    with s:
        out = s.run(inputs)
        for r in range(4):  # float32 sums of 8 products: rtol 1e-5
            np.testing.assert_allclose(out[gathered_dw][r], expected_dw, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(out[gathered_w][r], w_np + out[gathered_dw][r], rtol=1e-6)
        np.testing.assert_array_equal(s.get_tensor_data(w), out[gathered_w][0])


LR = 0.05


def build_seed000_step(R: int):
    """Seed 000: W0 an on-chip RTS variable, W1 a remote RTS variable, SGD with hand grads.

    h = relu(x @ W0), y = h @ W1, loss_r = 0.5 * sum((y - t)^2) on each replica; the step
    minimises the sum over replicas, so each weight gets the reduce-scattered sum of grads.
    """
    rng = np.random.default_rng(0)
    w0_np = rng.standard_normal((6, 5)).astype(np.float32) * 0.5
    w1_np = rng.standard_normal((5, 3)).astype(np.float32) * 0.5
    ir = popxl.Ir(R)
    with ir.main_graph, popxl.in_sequence(True):
        w0, w0_shard = popxl.replica_sharded_variable(w0_np, name="W0")
        buf1 = popxl.replica_sharded_buffer(w1_np.shape, popxl.float32)
        w1 = popxl.remote_replica_sharded_variable(w1_np, buf1, 0, name="W1")
        w1_shard = ops.remote_load(buf1, 0)
        x_stream = popxl.h2d_stream((4, 6), popxl.float32, "x")
        t_stream = popxl.h2d_stream((4, 3), popxl.float32, "t")
        x, t = ops.host_load(x_stream), ops.host_load(t_stream)

        full0 = ops.collectives.replicated_all_gather(w0_shard)
        full1 = ops.collectives.replicated_all_gather(w1_shard)
        h = ops.relu(x @ full0)
        y = h @ full1
        dy = y - t
        loss = host_store(ops.reduce_sum(dy * dy) * 0.5)
        dw1 = h.T @ dy
        dh = (dy @ full1.T) * ops.cast(ops.greater(h, popxl.constant(0.0)), popxl.float32)
        dw0 = x.T @ dh

        g0 = ops.collectives.replicated_reduce_scatter(
            dw0, "add", configure_output_for_replicated_tensor_sharding=True
        )
        g1 = ops.collectives.replica_sharded_slice(ops.collectives.replicated_all_reduce(dw1))
        ops.var_updates.accumulate_(w0_shard, g0, -LR)
        ops.var_updates.accumulate_(w1_shard, g1, -LR)
        ops.remote_store(buf1, 0, w1_shard)
    return ir, (w0, w1), (w0_np, w1_np), (x_stream, t_stream), loss


def unsharded_step(w0, w1, xs, ts):
    grads0, grads1, losses = np.zeros_like(w0), np.zeros_like(w1), []
    for x, t in zip(xs, ts, strict=True):
        h = np.maximum(x @ w0, 0)
        dy = h @ w1 - t
        losses.append(0.5 * (dy * dy).sum())
        grads1 += h.T @ dy
        grads0 += x.T @ ((dy @ w1.T) * (h > 0))
    return w0 - LR * grads0, w1 - LR * grads1, np.array(losses)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_seed000_rts_training_matches_unsharded_training(executor):
    R = 4
    ir, (w0, w1), (w0_np, w1_np), (x_stream, t_stream), loss = build_seed000_step(R)
    assert w0.shape == (6, 5) and w1.shape == (5, 3)
    rng = np.random.default_rng(1)
    ref0, ref1 = w0_np.astype(np.float64), w1_np.astype(np.float64)
    s = session(ir, executor)
    with s:
        for _ in range(3):
            xs = rng.standard_normal((R, 4, 6)).astype(np.float32)
            ts = rng.standard_normal((R, 4, 3)).astype(np.float32)
            out = s.run({x_stream: xs, t_stream: ts})
            ref0, ref1, ref_loss = unsharded_step(ref0, ref1, xs, ts)
            np.testing.assert_allclose(out[loss], ref_loss, rtol=1e-4)  # float32 vs float64
        got = s.get_tensors_data([w0, w1])
    np.testing.assert_allclose(got[w0], ref0, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[w1], ref1, rtol=1e-4, atol=1e-5)
    if executor == "fast":
        report = s.memory_report()
        # Per run: 2 all_gathers, 1 reduce_scatter, 1 all_reduce, 1 local slice.
        assert report.op_counts["all_gather"] == 2 and report.op_counts["reduce_scatter"] == 1
        assert report.op_counts["all_reduce"] == 1 and report.op_counts["local_slice"] == 1
        assert dict(report.predicted_counters) == dict(report.measured_counters)


# ---- memory: RTS shards really occupy ceil(n / R) per replica ------------------------------


def test_rts_state_of_n_elements_occupies_ceil_n_over_8_per_replica():
    n = 1001
    ir = popxl.Ir(8)
    with ir.main_graph, popxl.in_sequence(True):
        state, shard = popxl.replica_sharded_variable(np.zeros(n, np.float32), name="adam_m")
        ops.var_updates.accumulate_(shard, popxl.constant(np.ones(shard.shape, np.float32)))
    per_replica = math.ceil(n / 8)
    assert shard.shape == (per_replica,)
    s = session(ir)
    with s:
        s.run()
        assert tuple(s._state.persistent[shard.id].shape) == (8, per_replica)
        (buffer,) = s._state.buffers.values()
        assert tuple(buffer.shape) == (8, 1, per_replica)
        assert state.id not in s._state.vars  # no full on-chip copy anywhere
        report = s.memory_report()
    assert report.rts_shard_bytes == per_replica * 4
    assert report.streaming_bytes == per_replica * 4
    assert report.variable_bytes == 0
    np.testing.assert_array_equal(s.get_tensor_data(state), np.ones(n, np.float32))


# ---- both executors agree ------------------------------------------------------------------


def test_fast_and_reference_executors_agree_on_a_mixed_remote_program():
    def build():
        ir = popxl.Ir(4)
        with ir.main_graph, popxl.in_sequence(True):
            rg = ir.replica_grouping(group_size=2)
            buf = popxl.remote_buffer((3,), popxl.float32, 2)
            v = popxl.remote_variable(
                np.arange(6, dtype=np.float32).reshape(2, 3), buf, 1, replica_grouping=rg
            )
            w, shard = popxl.replica_sharded_variable(
                np.linspace(0, 1, 10, dtype=np.float32), shard_over=2
            )
            off = ops.host_load(popxl.h2d_stream((), popxl.int32, "off"))
            loaded = ops.remote_load(buf, 1)
            full = ops.collectives.replicated_all_gather(
                shard, group=ir.replica_grouping(group_size=2)
            )
            y = ops.reduce_sum(full) + loaded
            ops.remote_store(buf, off, y)
            ops.var_updates.accumulate_(
                shard, ops.collectives.replica_sharded_slice(full, group=rg), 0.5
            )
            out = host_store(ops.remote_load(buf, 0))
        return ir, v, w, out

    results = []
    for executor in EXECUTORS:
        ir, v, w, out = build()
        s = session(ir, executor)
        with s:
            stream = ir.get_all_h2d_streams().pop()
            o = s.run({stream: np.array([0, 1, 0, 1], np.int32)})[out]
            o2 = s.run({stream: np.array([0, 1, 0, 1], np.int32)})[out]
            data = s.get_tensors_data([v, w])
            results.append((o, o2, data[v], data[w], buffers(s)))
    fast, ref = results
    for a, b in zip(fast[:4], ref[:4], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    for k in fast[4]:
        np.testing.assert_allclose(fast[4][k], ref[4][k], rtol=1e-6)


# ---- the example ----------------------------------------------------------------------------


def test_remote_buffer_example_prints_the_seed_values(capsys, monkeypatch):
    import runpy
    import sys
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "remote_buffer.py"
    monkeypatch.setattr(sys, "argv", [str(path)])  # the example parses its command line
    runpy.run_path(str(path), run_name="__main__")
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    values = {}
    section = None
    for line in lines:
        if line.endswith("values"):
            section = line.split()[0]
        elif section and ":" in line and line.split(":")[0] in ("w_0", "output0", "w_1", "output1"):
            name, array = line.split(":", 1)
            values[section, name] = set(array.strip(" []").split())
    assert values == {
        ("initial", "w_0"): {"1."},
        ("initial", "output0"): {"2."},
        ("initial", "w_1"): {"1."},
        ("initial", "output1"): {"2."},
        ("updated", "w_0"): {"2."},
        ("updated", "output0"): {"3."},
        ("updated", "w_1"): {"3."},
        ("updated", "output1"): {"4."},
    }


# ---- offsets are 64-bit values, range-checked (issue 12 item 7) ---------------------------


@pytest.mark.parametrize("op", ["load", "load_", "store"])
@pytest.mark.parametrize("offset", [2**32, 2**32 + 1, 2**40, 2])
def test_int_offset_beyond_entries_is_rejected_not_wrapped(op, offset):
    """remote_store(buf, 2**32, t) used to become an int32 constant 0 and overwrite slot 0."""
    ir = popxl.Ir(2)
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.int32, 2)
        t = popxl.constant(np.array([5, 5], np.int32))
        with pytest.raises(
            ValueError, match=rf"offset {offset} is out of range for RemoteBuffer\[id=1"
        ) as info:
            if op == "load":
                ops.remote_load(buf, offset)
            elif op == "load_":
                ops.remote_load_(buf, offset, t)
            else:
                ops.remote_store(buf, offset, t)
        assert "valid offsets are 0 to 1" in str(info.value)


def test_nan_offset_says_nan():
    ir = popxl.Ir(1)
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32, 2)
        with pytest.raises(ValueError, match="offset is NaN"):
            ops.remote_load(buf, float("nan"))
        with pytest.raises(ValueError, match="offset is NaN"):
            popxl.remote_variable(np.ones(2, np.float32), buf, float("nan"))
