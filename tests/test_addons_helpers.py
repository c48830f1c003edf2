"""Small popxl-addons helpers: replica-grouping restriction, graph nesting, utils, memory
proportions."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl.addons import named_replica_grouping as nrg
from torch_popxl.addons import utils
from torch_popxl.addons.layers import Linear


def test_fill_none_group_and_build_groups():
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        g = ir.replica_grouping(2, 2)
        assert nrg.fill_none_group(None, g) is g
        other = ir.replica_grouping(1, 4)
        assert nrg.fill_none_group(other, g) is other
        groups = nrg.NamedReplicaGrouping.build_groups(["a.w", "b"])
        assert sorted(groups.to_dict()) == ["a.w", "b"]
        assert groups.a.w == ir.replica_grouping()  # default: all replicas


def test_ild_grouping_is_restricted_to_the_link_domain(monkeypatch):
    ir = popxl.Ir(replication=8)
    with ir.main_graph:
        monkeypatch.setenv("POPLAR_TARGET_OPTIONS", '{"ipuLinkDomainSize": 4}')
        assert nrg.get_ild_size_from_popdist() == 4
        wide = ir.replica_grouping(2, 4)  # replicas {0,2,4,6}: spans 8 > 4
        assert nrg.is_cross_ild(wide)
        narrow = nrg.get_ild_replica_grouping(wide)
        assert (narrow.stride, narrow.group_size) == (2, 2)
        assert nrg.get_ild_replica_grouping(ir.replica_grouping(1, 2)) == ir.replica_grouping(1, 2)
        monkeypatch.setenv("POPLAR_TARGET_OPTIONS", '{"ipuLinkDomainSize": 2}')
        with pytest.raises(ValueError, match="stride 4 must be at most the IPU-Link domain size 2"):
            nrg.get_ild_replica_grouping(ir.replica_grouping(4, 2))
        monkeypatch.delenv("POPLAR_TARGET_OPTIONS")
        assert nrg.get_ild_size_from_popdist() == 8  # min(replicas, 64)
        # one process holds every replica here: nothing crosses an instance
        assert not nrg.is_cross_instance(ir.replica_grouping())
        assert nrg.get_instance_replica_grouping() == ir.replica_grouping()


def test_is_subgraph_follows_calls():
    ir = popxl.Ir()
    with ir.main_graph:
        facts, fwd = Linear(2).create_graph(popxl.TensorSpec((1, 3), popxl.float32))
        fwd.bind(facts.init()).call(popxl.variable(np.ones((1, 3), np.float32)))
        lonely = ir.create_empty_graph("lonely")
    assert addons.is_subgraph(ir.main_graph, fwd.graph)
    assert addons.is_subgraph(ir.main_graph, fwd)  # GraphWithNamedArgs accepted
    assert not addons.is_subgraph(fwd.graph, ir.main_graph)
    assert not addons.is_subgraph(ir.main_graph, lonely)


def test_utils_and_memory_proportions_are_recorded_without_effect():
    assert addons.suffix_graph_name("Linear_subgraph(3)", "grad") == "Linear_grad"
    with addons.null_context():
        pass
    ir = popxl.Ir()
    addons.set_available_memory_proportion_by_ipu(ir, [0.3, 0.5])
    assert ir.available_memory_proportions == (0.3, 0.5)
    addons.set_graph_available_memory_proportion_by_ipu(ir.main_graph, [0.2])
    assert ir.main_graph.available_memory_proportions == (0.2,)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        addons.set_available_memory_proportion_by_ipu(ir, [1.5])


def test_linear_layout_is_a_copy_with_an_identity_gradient():
    from torch_popxl.addons.ops.linear_layout import linear_layout

    class M(addons.Module):
        def build(self, x):
            return linear_layout(x, bs=4) * 2.0

    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(data)
        facts, fwd = M().create_graph(x)
        bwd = addons.autodiff(fwd)
        info = fwd.bind(facts.init()).call_with_info(x)
        (dx,) = bwd.call(
            popxl.constant(np.ones((2, 3), np.float32)), args=bwd.grad_graph_info.inputs_dict(info)
        )
        outs = [addons.host_store(t) for t in (info.outputs[0], dx)]
        with pytest.raises(ValueError, match="positive int"):
            linear_layout(x, bs=0)
    with popxl.Session(ir, "ipu_model") as session:
        y, g = (session.run()[o] for o in outs)
    np.testing.assert_array_equal(y, 2 * data)
    np.testing.assert_array_equal(g, np.full((2, 3), 2.0, np.float32))


def test_dot_tree_len_counts_top_level_keys_and_len_flat_the_leaves():
    tree = addons.DotTree.from_dict({"a.x": 1, "a.y": 2, "b": 3})
    assert tree.len() == len(tree) == 2 and tree.len_flat() == 3


def test_utils_timer_logs_minutes_and_overrides_and_duplicate_items(caplog):
    with caplog.at_level(logging.INFO), utils.timer("Build"):
        pass
    assert "Starting Build" in caplog.text and "Build duration: 0.00 mins" in caplog.text

    class Base:
        def f(self):
            pass

    class Same(Base):
        pass

    class Own(Base):
        def f(self):
            pass

    assert not utils.overrides(Same, Base, "f") and utils.overrides(Own, Base, "f")
    assert utils.duplicate_items([1, 2, 1, 3, 2, 1]) == [1, 2]
    ir = popxl.Ir()
    with ir.main_graph:
        a, b = popxl.variable(1.0), popxl.variable(1.0)  # equal values, distinct tensors
        assert utils.duplicate_items([a, b, a]) == [a]
