"""addons.array_munging against hand-written layouts and numpy identities (popxl-addons 3.4
array_munging.py)."""

from __future__ import annotations

import numpy as np
import pytest

from torch_popxl.addons import array_munging as am


def test_shard_splits_an_axis_onto_a_new_leading_axis():
    data = np.arange(8).reshape(4, 2)
    np.testing.assert_array_equal(am.shard(data, 2, 0), [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    np.testing.assert_array_equal(
        am.shard(data, 2, 1), [[[0], [2], [4], [6]], [[1], [3], [5], [7]]]
    )
    np.testing.assert_array_equal(am.shard(data, 2, -1), am.shard(data, 2, 1))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_unshard_inverts_shard(axis):
    data = np.random.default_rng(0).normal(size=(4, 6, 8))
    np.testing.assert_array_equal(am.unshard(am.shard(data, 2, axis), axis), data)


def test_shard_rejects_a_split_that_does_not_divide_the_axis():
    with pytest.raises(ValueError, match="length 3"):
        am.shard(np.zeros((3, 2)), 2, 0)
    with pytest.raises(IndexError, match="out of range"):
        am.shard(np.zeros((4, 2)), 2, 2)


def test_repeat_and_repeat_axis():
    data = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(am.repeat(data, 2, 0), [data, data])
    np.testing.assert_array_equal(am.repeat(data, 2, 1), [[[0, 1, 2]] * 2, [[3, 4, 5]] * 2])
    np.testing.assert_array_equal(am.repeat_axis(data, 2, 0), np.concatenate([data, data], 0))
    np.testing.assert_array_equal(
        am.repeat_axis(data, 2, 1), [[0, 1, 2, 0, 1, 2], [3, 4, 5, 3, 4, 5]]
    )


def test_shard2D_orders_the_first_axis_outermost_and_unshard2D_inverts_it():
    data = np.arange(8).reshape(4, 2)
    np.testing.assert_array_equal(
        am.shard2D(data, 2, 2, 0, 1), [[[0], [2]], [[1], [3]], [[4], [6]], [[5], [7]]]
    )
    np.testing.assert_array_equal(
        am.shard2D(data, 2, 2, 1, 0), [[[0], [2]], [[4], [6]], [[1], [3]], [[5], [7]]]
    )
    big = np.random.default_rng(1).normal(size=(10, 3, 4))
    s = am.shard2D(big, 2, 4, 0, 2)
    assert s.shape == (8, 5, 3, 1)
    np.testing.assert_array_equal(am.unshard2D(s, 2, 4, 0, 2), big)
    with pytest.raises(ValueError, match="expected n_1 \\* n_2 = 6"):
        am.unshard2D(s, 2, 3, 0, 2)


def test_repeat_shard_contiguous_and_strided_layouts():
    data = np.arange(4)
    np.testing.assert_array_equal(am.repeat_shard(data, 2, 2, 0), [[0, 1], [2, 3], [0, 1], [2, 3]])
    np.testing.assert_array_equal(
        am.repeat_shard(data, 2, 2, 0, sharded_tensor="strided"), [[0, 1], [0, 1], [2, 3], [2, 3]]
    )
    with pytest.raises(ValueError, match="'contiguous' or 'strided'"):
        am.repeat_shard(data, 2, 2, 0, sharded_tensor="blocked")


def test_tensor_parallel_input_gives_each_tp_group_one_sample():
    a = np.arange(4)
    np.testing.assert_array_equal(am.tensor_parallel_input(a, 1, 2), [[0, 1], [2, 3]])
    np.testing.assert_array_equal(
        am.tensor_parallel_input(a, 2, 2), [[0, 0], [1, 1], [2, 2], [3, 3]]
    )
    np.testing.assert_array_equal(am.tensor_parallel_input(a, 2, 4), [[0, 0, 1, 1], [2, 2, 3, 3]])
    # one transfer: the host-transfer axis is left out
    np.testing.assert_array_equal(am.tensor_parallel_input(np.arange(2), 2, 4), [0, 0, 1, 1])
    shifted = am.tensor_parallel_input(a, 2, 4, repeat_fn=lambda x, i: x + 10 * i)
    np.testing.assert_array_equal(shifted, [[0, 10, 1, 11], [2, 12, 3, 13]])
    assert a.tolist() == [0, 1, 2, 3]  # input untouched
    with pytest.raises(ValueError, match="tp=3 must divide"):
        am.tensor_parallel_input(a, 3, 4)


def test_tensor_parallel_output_inverts_tensor_parallel_input():
    samples = np.random.default_rng(2).normal(size=(6, 5))  # 6 samples of shape (5,)
    host = am.tensor_parallel_input(samples, 2, 4)  # (3 transfers, 4 replicas, 5)
    assert host.shape == (3, 4, 5)
    np.testing.assert_array_equal(am.tensor_parallel_output(host, 3, 2, 4, (5,)), samples)
    full = am.tensor_parallel_output(host, 3, 2, 4, (5,), tp_identical=False)
    assert full.shape == (6, 2, 5)
    np.testing.assert_array_equal(am.tensor_parallel_output(host, 3, 2, 4, (5,), true_num_host_transfers=2),
                                  samples[:4])  # fmt: skip


def test_pad_axis_and_squeeze_safe():
    data = np.arange(6).reshape(3, 2)
    np.testing.assert_array_equal(
        am.pad_axis(data, 5, 1), [[0, 1, 0, 0, 0], [2, 3, 0, 0, 0], [4, 5, 0, 0, 0]]
    )
    np.testing.assert_array_equal(am.pad_axis(data, 4, 0, value=-1)[3], [-1, -1])
    with pytest.raises(ValueError, match="already has length 3"):
        am.pad_axis(data, 2, 0)
    x = np.zeros((1, 3, 1))
    assert am.squeeze_safe(x, [0, 1]).shape == (3, 1)
    assert am.squeeze_safe(x, -1).shape == (1, 3)
    assert am.squeeze_safe(x).shape == (3,)
    assert am.handle_negative_axis(x, -1) == 2
    np.testing.assert_array_equal(
        am.unshard_arrays([np.ones((1, 2)), np.zeros((1, 3))], 0), [1, 1, 0, 0, 0]
    )
