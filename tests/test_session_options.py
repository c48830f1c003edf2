"""``ir._pb_ir.getSessionOptions()``: the PopART session options Graphcore's PopXL applications
and tutorials set (Note [session options] in torch_popxl/ir/session_options.py).

Upstream, ``popxl.Ir.__init__`` (graphcore/popart python/popxl/popxl/ir.py) creates the
internal Ir and sets PopXL's defaults on its options; programs then reach through ``_pb_ir``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.ir.inplace import InplaceAmbiguityError

# (field, a value) as graphcore/examples sets them:
#   nlp/bert/popxl/pretraining.py (pretraining_phased): numIOTiles, enableStochasticRounding,
#     partialsTypeMatMuls, engineOptions["target.syncReplicasIndependently"]
#   nlp/gpt_j/popxl/inference.py, nlp/t5/popxl/inference.py: partialsTypeMatMuls, engineOptions
#   multimodal ruDALL-E popxl inference: convolutionOptions["partialsType"],
#     engineOptions["opt.internalExchangeOptimisationTarget"]
#   tutorials/tutorials/popxl/6_phased_execution/mnist.py: numIOTiles = 32
# and popxl's own tests (graphcore/popart tests/popxl): enableEngineCaching, cachePath,
# dotChecks, enableInplaceAmbiguityChecking, constantWeights, useHostCopyOps,
# enableExplicitMainLoops, aliasZeroCopy, explicitRecomputation.
APP_FIELDS = [
    ("numIOTiles", 32),
    ("enableStochasticRounding", True),
    ("partialsTypeMatMuls", "half"),
    ("enableEngineCaching", True),
    ("cachePath", "/tmp/popxl_cache"),
    ("dotChecks", set()),
    ("enableInplaceAmbiguityChecking", True),
    ("constantWeights", False),
    ("useHostCopyOps", True),
    ("enableExplicitMainLoops", True),
    ("aliasZeroCopy", True),
    ("explicitRecomputation", True),
    ("enableFloatingPointChecks", False),
    ("enableOutlining", False),
    ("outlineThreshold", 10.0),
    ("timeLimitScheduler", 0.0),
    ("swapLimitScheduler", 0),
    ("instrumentWithHardwareCycleCounter", True),
    ("throwIfLog2ScaleTensorNotInRange", False),  # upstream's float8 tests
]


@pytest.mark.parametrize("field, value", APP_FIELDS, ids=[f for f, _ in APP_FIELDS])
def test_every_option_the_applications_set_is_accepted_and_stored(field, value):
    ir = popxl.Ir()
    opts = ir._pb_ir.getSessionOptions()
    setattr(opts, field, value)
    # The same object on every call: what a program set is what the session sees.
    assert ir._pb_ir.getSessionOptions() is opts
    assert getattr(ir._pb_ir.getSessionOptions(), field) == value


def test_map_options_are_live_dicts_as_upstreams_bound_maps():
    ir = popxl.Ir()
    opts = ir._pb_ir.getSessionOptions()
    opts.engineOptions["target.syncReplicasIndependently"] = "true"
    opts.engineOptions["opt.maxComputeSetsPerLoweredCopy"] = "6"
    opts.convolutionOptions["partialsType"] = "half"
    assert ir._pb_ir.getSessionOptions().engineOptions == {
        "target.syncReplicasIndependently": "true",
        "opt.maxComputeSetsPerLoweredCopy": "6",
    }
    assert ir._pb_ir.getSessionOptions().convolutionOptions == {"partialsType": "half"}
    # Each Ir has its own options.
    assert popxl.Ir()._pb_ir.getSessionOptions().engineOptions == {}


def test_nested_settings_objects_accept_upstreams_fields():
    opts = popxl.Ir()._pb_ir.getSessionOptions()
    opts.replicatedCollectivesSettings.prepareScheduleForMergingCollectives = True
    opts.replicatedCollectivesSettings.mergeAllReduceCollectives = True
    opts.replicatedCollectivesSettings.mergeReduceScatterCollectives = True
    opts.executionPhaseSettings.phases = 4
    opts.executionPhaseSettings.stages = 1
    opts.accumulateOuterFragmentSettings.schedule = 2
    assert opts.replicatedCollectivesSettings.mergeAllReduceCollectives is True
    assert opts.executionPhaseSettings.phases == 4
    with pytest.raises(AttributeError, match="mergeAllReduce"):
        opts.replicatedCollectivesSettings.mergeAllReduce = True


def test_popxl_defaults_as_popxl_ir_sets_them():
    # popxl.Ir.__init__: manual virtual graphs, host copy ops, alias zero copy, explicit main
    # loops, explicit recomputation and in-place ambiguity checking; PopART's other defaults.
    opts = popxl.Ir()._pb_ir.getSessionOptions()
    assert opts.useHostCopyOps and opts.aliasZeroCopy and opts.enableExplicitMainLoops
    assert opts.explicitRecomputation and opts.enableInplaceAmbiguityChecking
    assert opts.numIOTiles == 0 and opts.enableStochasticRounding is False
    assert opts.partialsTypeMatMuls == "" and opts.engineOptions == {}


def test_popart_cache_dir_enables_engine_caching(monkeypatch):
    # graphcore/popart tests/popxl/test_cache_env.py: POPART_CACHE_DIR sets both options.
    monkeypatch.setenv("POPART_CACHE_DIR", "PATH_TO_CACHE")
    opts = popxl.Ir()._pb_ir.getSessionOptions()
    assert opts.enableEngineCaching
    assert opts.cachePath == "PATH_TO_CACHE"


def test_popxl_cache_dir_enables_engine_caching_and_wins(monkeypatch):
    # upstream's tests and Graphcore's applications set POPXL_CACHE_DIR; popxl.Ir applies it
    # over PopART's POPART_CACHE_DIR
    monkeypatch.setenv("POPXL_CACHE_DIR", "POPXL_PATH")
    opts = popxl.Ir()._pb_ir.getSessionOptions()
    assert opts.enableEngineCaching and opts.cachePath == "POPXL_PATH"
    monkeypatch.setenv("POPART_CACHE_DIR", "POPART_PATH")
    assert popxl.Ir()._pb_ir.getSessionOptions().cachePath == "POPXL_PATH"
    monkeypatch.delenv("POPXL_CACHE_DIR")
    assert popxl.Ir()._pb_ir.getSessionOptions().cachePath == "POPART_PATH"


def test_unknown_option_raises_attribute_error_naming_it():
    # A pybind11 object has a fixed set of attributes: a misspelt option is an AttributeError.
    opts = popxl.Ir()._pb_ir.getSessionOptions()
    with pytest.raises(AttributeError, match="'numIoTiles'"):
        opts.numIoTiles = 32
    with pytest.raises(AttributeError, match="'enableStochasticRoundings'"):
        _ = opts.enableStochasticRoundings
    assert opts.numIOTiles == 0  # nothing changed


@pytest.mark.parametrize(
    "field, value",
    [("numIOTiles", "32"), ("numIOTiles", 2.5), ("enableStochasticRounding", 1), ("partialsTypeMatMuls", 16)],
)  # fmt: skip
def test_wrongly_typed_option_raises_type_error_naming_the_value(field, value):
    opts = popxl.Ir()._pb_ir.getSessionOptions()
    before = getattr(opts, field)
    with pytest.raises(TypeError, match=rf"{field} must be .*{type(value).__name__} {value!r}"):
        setattr(opts, field, value)
    assert getattr(opts, field) == before


def test_replication_options_read_and_set_the_irs_replication():
    ir = popxl.Ir(replication=2)
    opts = ir._pb_ir.getSessionOptions()
    assert opts.replicatedGraphCount == 2 and opts.enableReplicatedGraphs
    assert opts.getGlobalReplicationFactor() == opts.globalReplicationFactor == 2
    assert opts.globalReplicaOffset == 0 and not opts.enableDistributedReplicatedGraphs
    opts.replicatedGraphCount = 4
    assert ir.replication_factor == 4
    opts.enableReplicatedGraphs = False
    assert ir.replication_factor == 1
    assert popxl.Ir()._pb_ir.getSessionOptions().enableReplicatedGraphs is False
    with ir.main_graph:
        ops.host_store(
            popxl.d2h_stream((1,), popxl.float32), popxl.variable(np.ones(1, np.float32))
        )
    popxl.Session(ir, "ipu_model")
    assert ir._pb_ir.isPrepared()
    with pytest.raises(RuntimeError, match="replication_factor"):
        opts.replicatedGraphCount = 2


def _ambiguous_program(ir: popxl.Ir):
    # graphcore/popart tests/popxl/inplacing_ambiguity_test.py (the diamond): relu and relu_ of
    # one variable, unordered, then their in-place sum.
    with ir.main_graph:
        a = popxl.variable(np.array([0.5, -0.25, 2.0], np.float32), name="a")
        b = ops.relu(a)
        c = ops.relu_(a)
        d = ops.add_(b, c)
        s = popxl.d2h_stream(d.shape, d.dtype, "d")
        ops.host_store(s, d)
    return s


def test_inplace_ambiguity_checking_can_be_turned_off_as_upstream():
    ir = popxl.Ir()
    _ambiguous_program(ir)
    with pytest.raises(InplaceAmbiguityError):
        popxl.Session(ir, "ipu_model")

    ir = popxl.Ir()
    ir._pb_ir.getSessionOptions().enableInplaceAmbiguityChecking = False
    s = _ambiguous_program(ir)
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run()[s]
    # The simulator runs ops in creation order: relu(a) + relu_(a).
    np.testing.assert_allclose(out, 2 * np.maximum([0.5, -0.25, 2.0], 0))


def test_pb_ir_names_what_it_lacks():
    with pytest.raises(AttributeError, match="setPatterns.*getSessionOptions.*getMainGraph"):
        popxl.Ir()._pb_ir.setPatterns(None)


def test_stream_ids_are_main_graph_tensors_as_upstream():
    # graphcore/popart tests/popxl/ir_test.py test_get_all_d2h_streams / _h2d_streams: only the
    # streams with a host_store / host_load are returned, and each stream's tensor_id is a tensor
    # of the internal main graph.
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.float32(1))
        d, e, f = (popxl.d2h_stream(v.shape, v.dtype) for _ in range(3))
        h = popxl.h2d_stream(v.shape, v.dtype)
        a = ops.host_load(h)
        ops.host_store(d, v)
        ops.host_store(e, v + a)
    main = ir._pb_ir.getMainGraph()
    assert {s.tensor_id for s in ir.get_all_d2h_streams()} == {d.tensor_id, e.tensor_id}
    assert {s.tensor_id for s in ir.get_all_h2d_streams()} == {h.tensor_id}
    assert all(s.tensor_id in main for s in (d, e, f, h)) and v.id in main
    assert "no_such_tensor" not in main and "no_such_tensor" not in popxl.Ir()._pb_ir.getMainGraph()


def test_log_ir_logs_every_graph_at_info_as_upstream_does(caplog):
    # Upstream's tests call ir._pb_ir.logIr() while building; it logs the IR at INFO only.
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(2, np.float32), name="x")
        g = ir.create_graph(lambda t: t + 1.0, x)
        popxl.ops.call(g, x)
    with caplog.at_level(logging.WARNING, logger="torch_popxl.ir"):
        ir._pb_ir.logIr()
    assert caplog.records == []
    with caplog.at_level(logging.INFO, logger="torch_popxl.ir"):
        ir._pb_ir.logIr()
    texts = [r.getMessage() for r in caplog.records]
    assert texts == [ir.main_graph.text(), g.text()]
    assert "x" in texts[0] and g.id in texts[1]
