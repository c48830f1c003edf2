"""RTS remote buffers sized for a shard over a divisor of the group size, with a replica
grouping whose group size divides the replication factor (spec/popxl.md sections 2, 4.5-4.7),
checked replica by replica against hand-computed shards, on both executors."""

import numpy as np
import pytest

import torch_popxl as popxl
from torch_popxl import ops

EXECUTORS = ("fast", "reference")

# R = 8, grouping stride 2, group size 4 (divides 8): assignment [0,1,0,1,0,1,0,1], index in
# group (r % 8) // 2 = [0,0,1,1,2,2,3,3]. Sharding over k = 2 (divides 4): replica r holds shard
# (index in group) % 2 of its group's value; 3 elements per group pad to 4, shards of 2.
R, STRIDE, GROUP_SIZE, SHARD_OVER = 8, 2, 4, 2
DATA = np.array([[1, 2, 3], [10, 20, 30]], np.int32)  # one row per group
SHARDS = {  # replica -> hand-computed shard
    0: [1, 2], 1: [10, 20], 2: [3, 0], 3: [30, 0],
    4: [1, 2], 5: [10, 20], 6: [3, 0], 7: [30, 0],
}  # fmt: skip


def _buffer(ir, rg, kind):
    if kind == "replica_sharded_buffer":
        return popxl.replica_sharded_buffer(DATA.shape, popxl.int32, rg, shard_over=SHARD_OVER)
    # A buffer made by hand with the shard shape: the shard count is the divisor it fits.
    return popxl.remote_buffer((2,), popxl.int32)


def _build(kind, retrieval_mode="one_per_group"):
    ir = popxl.Ir(R)
    with ir.main_graph, popxl.in_sequence(True):
        rg = ir.replica_grouping(stride=STRIDE, group_size=GROUP_SIZE)
        assert rg.assignment == [0, 1, 0, 1, 0, 1, 0, 1] and rg.num_groups == 2
        buf = _buffer(ir, rg, kind)
        w = popxl.remote_replica_sharded_variable(
            DATA, buf, 0, replica_grouping=rg, retrieval_mode=retrieval_mode
        )
        shard = ops.remote_load(buf, 0)
        loaded = popxl.d2h_stream(shard.shape, shard.dtype, "shard")
        ops.host_store(loaded, shard)
        # Replicas 0-3 (the first k=2 members of each group) add 100 + r; replicas 4-7 add 1000.
        r = ops.host_load(popxl.h2d_stream((), popxl.int32, "replica"))
        first = ops.cast(ops.greater(popxl.constant(4, popxl.int32), r), popxl.int32)
        bump = first * (r + 100) + (1 - first) * 1000
        ops.remote_store(buf, 0, shard + bump)
    return ir, buf, w, loaded


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("kind", ["replica_sharded_buffer", "remote_buffer"])
def test_rts_shard_over_a_divisor_of_a_strided_group_gives_each_replica_its_shard(kind, executor):
    ir, buf, w, loaded = _build(kind)
    assert buf.tensor_shape == (2,) and buf.meta_shape == (3,)
    assert w.shape == (3,)  # the per-group (unsharded) shape
    with popxl.Session(ir, "ipu_model", executor=executor) as s:
        replica = next(iter(ir.get_all_h2d_streams()))
        out = s.run({replica: np.arange(R, dtype=np.int32)})[loaded]
        np.testing.assert_array_equal(out, [SHARDS[r] for r in range(R)])
        # Read back from the first k members of each group (replicas 0, 2 and 1, 3); padding
        # dropped; the changes on replicas 4-7 are not visible.
        want = np.array([[1 + 100, 2 + 100, 3 + 102], [10 + 101, 20 + 101, 30 + 103]])
        np.testing.assert_array_equal(s.get_tensor_data(w), want)
        # The next run starts from the stored shards: replica r sees its own slot.
        out = s.run({replica: np.arange(R, dtype=np.int32)})[loaded]
    # The whole slot was stored, padding included.
    bumped = {r: np.array(SHARDS[r]) + (r + 100 if r < 4 else 1000) for r in range(R)}
    np.testing.assert_array_equal(out, [bumped[r] for r in range(R)])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_rts_shard_over_a_divisor_all_replicas_copies_each_group_value(executor):
    ir, _, w, _ = _build("replica_sharded_buffer", retrieval_mode="all_replicas")
    with popxl.Session(ir, "ipu_model", executor=executor) as s:
        np.testing.assert_array_equal(s.get_tensor_data(w), DATA[[0, 1, 0, 1, 0, 1, 0, 1]])


def test_a_hand_made_buffer_that_fits_no_divisor_is_rejected():
    ir = popxl.Ir(R)
    with ir.main_graph:
        rg = ir.replica_grouping(stride=STRIDE, group_size=GROUP_SIZE)
        buf = popxl.remote_buffer((3,), popxl.int32)  # 3 = ceil(3 / 1): k = 1 fits
        popxl.remote_replica_sharded_variable(DATA, buf, 0, replica_grouping=rg)
        bad = popxl.remote_buffer((5,), popxl.int32)
        with pytest.raises(ValueError, match=r"needs one of \[1, 2, 3\] elements per shard"):
            popxl.remote_replica_sharded_variable(DATA, bad, 0, replica_grouping=rg)
