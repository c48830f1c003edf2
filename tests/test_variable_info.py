"""Typed variable metadata: placement, grouping, remote slot and RTS layout in one frozen record."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import torch_popxl as popxl
from torch_popxl.ir.tensor import Placement, RtsLayout


def test_placement_follows_how_the_variable_was_made():
    ir = popxl.Ir(4)
    with ir.main_graph:
        on_chip = popxl.variable(np.ones(10, np.float32))
        buf = popxl.remote_buffer((10,), popxl.float32, 2)
        remote = popxl.remote_variable(np.ones(10, np.float32), buf, 1)
        sharded = popxl.remote_replica_sharded_variable(
            np.ones(10, np.float32), popxl.replica_sharded_buffer((10,), popxl.float32), 0
        )
    assert on_chip.info.placement is Placement.ON_CHIP and on_chip.info.remote is None
    assert remote.info.placement is Placement.REMOTE and remote.info.remote == (buf, 1)
    assert sharded.info.placement is Placement.REMOTE_SHARDED
    assert sharded.info.shard == RtsLayout(shard_over=4, num_elements=10)
    assert sharded.info.shard.shard_elements == 3  # ceil(10 / 4)
    assert on_chip.replica_grouping == ir.replica_grouping()
    assert on_chip.retrieval_mode == "one_per_group"


def test_variable_info_is_frozen_and_hints_replace_it():
    ir = popxl.Ir(2)
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32))
    before = v.info
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.replica_sum = True  # type: ignore[misc]
    v._set_hints(replica_sum=True)
    assert v.info.replica_sum and not before.replica_sum
    assert v.info.replica_grouping is before.replica_grouping
