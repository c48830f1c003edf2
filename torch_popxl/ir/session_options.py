"""``Ir._pb_ir``: the handle PopXL programs reach through to set PopART session options.

Graphcore's applications and tutorials configure a program with
``opts = ir._pb_ir.getSessionOptions()`` and then ``opts.numIOTiles = 32``,
``opts.enableStochasticRounding = True``, ``opts.engineOptions["..."] = "..."`` and so on. Here
``getSessionOptions()`` returns a ``SessionOptions`` with upstream's field names and defaults.

Note [session options]
~~~~~~~~~~~~~~~~~~~~~~
Upstream's object is a pybind11 binding of a C++ struct: a fixed set of fields, each with a
C++ type; assigning a name the struct lacks raises ``AttributeError`` and a value of the wrong
type ``TypeError``. ``SessionOptions`` keeps both rules (``_FIELDS`` is the set) so a typo in a
program fails here as it would on an IPU. Map fields (``engineOptions``, ...) are live dicts:
``opts.engineOptions[k] = v`` sticks, as with upstream's bound maps.

What the fields mean here:

* honoured: ``replicatedGraphCount`` / ``enableReplicatedGraphs`` read and set the Ir's
  (instance) replication factor; ``globalReplicationFactor`` / ``globalReplicaOffset`` /
  ``enableDistributedReplicatedGraphs`` read the Ir's replica layout (``popxl.Ir(replication=)``
  sets it, as PopDist does upstream); ``enableInplaceAmbiguityChecking = False`` turns off the
  check a Session runs (``ir/inplace.py``); ``throwIfLog2ScaleTensorNotInRange = False`` turns
  off the run-time check of float8 ops' scales (Note [log2 scale range check]); ``enableEngineCaching`` / ``cachePath`` start from
  ``$POPXL_CACHE_DIR`` (else ``$POPART_CACHE_DIR``) as upstream.
* ``numIOTiles`` feeds the cost model and so the memory report's modeled times: compute runs on
  the tiles left over (Note [IO tiles] in ``runtime/cost_model.py``); ``popxl.io_tiles()``
  works with any value, as here every transfer is simulated alike.
* recorded (stored, readable, no effect on the numbers): ``enableStochasticRounding`` (float16 results here are round-to-nearest, so a program that
  relies on stochastic rounding to make progress in float16 may differ from an IPU),
  ``partialsTypeMatMuls`` and ``convolutionOptions["partialsType"]`` (torch picks the
  accumulation type).
* accepted and inert: the rest (Poplar engine, scheduler, outlining, profiling and
  compilation settings; there is no Poplar engine to configure).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ir import Ir

__all__ = [
    "AccumulateOuterFragmentSettings",
    "BatchSerializationSettings",
    "ExecutionPhaseSettings",
    "ReplicatedCollectivesSettings",
    "SessionOptions",
]


class _Struct:
    """A fixed set of typed fields (Note [session options])."""

    _FIELDS: dict[str, Any] = {}
    _NAME = "_Struct"

    def __init__(self) -> None:
        for name, default in self._FIELDS.items():
            object.__setattr__(self, name, _fresh(default))

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._FIELDS and not isinstance(getattr(type(self), name, None), property):
            raise AttributeError(
                f"'{self._NAME}' object has no attribute {name!r} (upstream's PopART has no such "
                f"session option; check the spelling: options are camelCase, e.g. numIOTiles)."
            )
        if name in self._FIELDS:
            value = _checked(self._NAME, name, self._FIELDS[name], value)
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._FIELDS)
        return f"{self._NAME}({fields})"


def _fresh(default: Any) -> Any:
    if isinstance(default, dict | set | list):
        return type(default)(default)
    if isinstance(default, type) and issubclass(default, _Struct):
        return default()
    return default


def _checked(owner: str, name: str, default: Any, value: Any) -> Any:
    """``value`` if it has the field's C++ type (pybind11's conversions), else TypeError."""
    if isinstance(default, type) and issubclass(default, _Struct):
        ok = isinstance(value, default)
        expected = default.__name__
    elif isinstance(default, bool):
        ok, expected = isinstance(value, bool), "a bool"
    elif isinstance(default, int):
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an int"
        # A C++ enum field (virtualGraphMode, ...): upstream takes popart's enum member; there
        # is no popart here, so its name or int value (or any enum member) is accepted.
        if name in _ENUM_FIELDS:
            ok, expected = True, "an enum member"
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        expected = "a number"
    elif isinstance(default, str):
        ok, expected = isinstance(value, str), "a str"
    elif isinstance(default, dict):
        ok, expected = isinstance(value, dict), "a dict"
    elif isinstance(default, set | list):
        ok, expected = isinstance(value, set | list | tuple), "a set or list"
        value = type(default)(value) if ok else value
    else:
        ok, expected = True, ""
    if not ok:
        raise TypeError(
            f"{owner}.{name} must be {expected} (its C++ type upstream), got "
            f"{type(value).__name__} {value!r}."
        )
    return value


class ReplicatedCollectivesSettings(_Struct):
    """``opts.replicatedCollectivesSettings``: merging of collectives (inert here: the
    simulator's collectives are exact whether merged or not)."""

    _NAME = "ReplicatedCollectivesSettings"
    _FIELDS = {
        "prepareScheduleForMergingCollectives": False,
        "mergeAllReduceCollectives": False,
        "mergeReduceScatterCollectives": False,
        "mergeAllGatherCollectives": False,
    }


class ExecutionPhaseSettings(_Struct):
    """``opts.executionPhaseSettings`` (PopART's phased execution; inert for PopXL programs,
    which build their phases explicitly)."""

    _NAME = "ExecutionPhaseSettings"
    _FIELDS = {
        "phases": 0,
        "stages": 2,
        "weightIOSchedule": 0,
        "activationIOSchedule": 0,
        "optimizerStateIOSchedule": 0,
        "accumulatorIOSchedule": 0,
        "schedule": 0,
    }


class AccumulateOuterFragmentSettings(_Struct):
    """``opts.accumulateOuterFragmentSettings`` (inert)."""

    _NAME = "AccumulateOuterFragmentSettings"
    _FIELDS = {"schedule": 0, "excludedVirtualGraphs": []}


class BatchSerializationSettings(_Struct):
    """``opts.batchSerializationSettings`` (PopART's own batch serialisation; inert)."""

    _NAME = "BatchSerializationSettings"
    _FIELDS = {
        "factor": 0,
        "concatOnVirtualGraphChange": True,
        "concatOnExecutionPhaseChange": True,
        "concatOnPipelineStageChange": True,
        "transformContext": 0,
        "method": 0,
        "batchSchedule": 0,
    }


# Fields whose C++ type is an enum (accepted as popart's member, its name or its value).
_ENUM_FIELDS = frozenset(
    {
        "virtualGraphMode", "syntheticDataMode", "mergeVarUpdate", "autoRecomputation",
        "accumulationAndReplicationReductionType", "meanAccumulationAndReplicationReductionStrategy",
        "weightIOSchedule", "activationIOSchedule", "optimizerStateIOSchedule", "accumulatorIOSchedule",
        "schedule", "transformContext", "method", "batchSchedule",
    }
)  # fmt: skip


class SessionOptions(_Struct):
    """PopART's ``SessionOptions`` as ``ir._pb_ir.getSessionOptions()`` returns it: upstream's
    field names, types and PopXL's defaults. Which fields take effect: Note [session options]
    (``torch_popxl/ir/session_options.py``)."""

    _NAME = "SessionOptions"
    _ir: Ir
    # The fields the package itself reads (the rest are set from _FIELDS in __init__).
    numIOTiles: int
    enableStochasticRounding: bool
    enableInplaceAmbiguityChecking: bool
    throwIfLog2ScaleTensorNotInRange: bool
    enableEngineCaching: bool
    cachePath: str
    engineOptions: dict[str, str]
    # PopART's defaults, with the ones popxl.Ir sets at construction (manual virtual graphs,
    # host copy ops, alias zero copy, explicit main loops and recomputation, ambiguity checks).
    _FIELDS = {
        # recorded
        "numIOTiles": 0,
        "enableStochasticRounding": False,
        "partialsTypeMatMuls": "",
        "convolutionOptions": {},
        # honoured (see the properties below for the replication fields)
        "enableInplaceAmbiguityChecking": True,
        "enableEngineCaching": False,
        "cachePath": "session_cache",
        # inert
        "engineOptions": {},
        "reportOptions": {},
        "matmulOptions": {},
        "lstmOptions": {},
        "gclOptions": {},
        "tensorLocationSettingsOverride": {},
        "virtualGraphMode": 1,  # Manual
        "useHostCopyOps": True,
        "aliasZeroCopy": True,
        "enableExplicitMainLoops": True,
        "explicitRecomputation": True,
        "constantWeights": True,
        "enableOutlining": True,
        "enableOutliningCopyCostPruning": True,
        "outlineThreshold": 1.0,
        "outlineSequenceBreakCost": 10000.0,
        "enableFloatingPointChecks": False,
        "enableFullyConnectedPass": True,
        "enableGroupedMatmuls": False,
        # Read by Session (Note [log2 scale range check] in opdefs/log2_scale.py).
        "throwIfLog2ScaleTensorNotInRange": True,
        "enableStableNorm": False,
        "enableNonStableSoftmax": False,
        "enableMergeExchange": True,
        "enablePrefetchDatastreams": True,
        "defaultPrefetchBufferingDepth": 1,
        "enableLoadAndOffloadRNGState": False,
        "enableGradientAccumulation": False,
        "accumulationFactor": 1,
        "enablePipelining": False,
        "autoRecomputation": 0,
        "mergeVarUpdate": 0,
        "mergeVarUpdateMemThreshold": 1000000,
        "rearrangeAnchorsOnHost": True,
        "rearrangeStreamsOnHost": False,
        "decomposeGradSum": False,
        "syntheticDataMode": 0,
        "instrumentWithHardwareCycleCounter": False,
        "hardwareInstrumentations": set(),
        "compileEngine": True,
        "logDir": "",
        "dotChecks": set(),
        "dotOpNames": False,
        "firstDotOp": 0,
        "finalDotOp": 10000,
        "separateCallOpPdfs": True,
        "exportPoplarComputationGraph": False,
        "exportPoplarVertexGraph": False,
        "customCodelets": [],
        "customCodeletCompileFlags": "",
        "kahnTieBreaker": "greedy",
        "timeLimitScheduler": 1000000000.0,
        "swapLimitScheduler": 1000000000,
        "transitiveClosureOptimizationThreshold": 100000,
        "serializedPoprithmsShiftGraphsDir": "",
        "groupHostSync": False,
        "accumulationAndReplicationReductionType": 0,
        "meanAccumulationAndReplicationReductionStrategy": 0,
        "globalNumIpus": 1,
        "ipuSystemType": "ipu2",
        "delayVarUpdates": True,
        "scheduleNonWeightUpdateGradientConsumersEarly": False,
        "replicatedCollectivesSettings": ReplicatedCollectivesSettings,
        "executionPhaseSettings": ExecutionPhaseSettings,
        "accumulateOuterFragmentSettings": AccumulateOuterFragmentSettings,
        "batchSerializationSettings": BatchSerializationSettings,
    }

    def __init__(self, ir: Ir) -> None:
        object.__setattr__(self, "_ir", ir)
        super().__init__()
        # PopART's SessionOptions read POPART_CACHE_DIR; popxl.Ir then applies POPXL_CACHE_DIR
        # (the variable Graphcore's PopXL applications document), which so wins.
        cache_dir = os.environ.get("POPXL_CACHE_DIR") or os.environ.get("POPART_CACHE_DIR")
        if cache_dir:
            self.enableEngineCaching = True
            self.cachePath = cache_dir

    # ---- replication: views of the Ir's layout -----------------------------------------------

    @property
    def replicatedGraphCount(self) -> int:
        """The replicas on this instance (``ir.instance_replication_factor``)."""
        return self._ir.instance_replication_factor

    @replicatedGraphCount.setter
    def replicatedGraphCount(self, value: int) -> None:
        if self._ir._num_instances != 1:
            raise ValueError(
                f"replicatedGraphCount: {self._ir!r} spans {self._ir._num_instances} instances "
                "(torchrun / popdist); set the global count with ir.replication_factor instead."
            )
        self._ir.replication_factor = value

    @property
    def enableReplicatedGraphs(self) -> bool:
        return self._ir.instance_replication_factor > 1

    @enableReplicatedGraphs.setter
    def enableReplicatedGraphs(self, value: bool) -> None:
        _checked(self._NAME, "enableReplicatedGraphs", False, value)
        if not value:
            self.replicatedGraphCount = 1
        # Enabling alone changes nothing upstream either: replicatedGraphCount sets the count.

    @property
    def enableDistributedReplicatedGraphs(self) -> bool:
        return self._ir._num_instances > 1

    @property
    def globalReplicationFactor(self) -> int:
        return self._ir.replication_factor

    @property
    def globalReplicaOffset(self) -> int:
        return self._ir._instance_index * self._ir.instance_replication_factor

    def getGlobalReplicationFactor(self) -> int:
        """The number of replicas over all instances (``ir.replication_factor``)."""
        return self._ir.replication_factor


class PbMainGraph:
    """``ir._pb_ir.getMainGraph()``: answers ``tensor_id in graph`` as upstream's pybind graph
    does, where host streams are tensors of the main graph (upstream's
    tests/popxl/ir_test.py checks ``d2h.tensor_id in ir._pb_ir.getMainGraph()``)."""

    def __init__(self, ir: Ir) -> None:
        self._ir = ir

    def __contains__(self, tensor_id: object) -> bool:
        ir = self._ir
        streams = (*ir._h2d_streams, *ir._d2h_streams)
        return tensor_id in ir.main_graph._tensors or any(s.tensor_id == tensor_id for s in streams)


class PbIr:
    """What ``Ir._pb_ir`` offers of upstream's pybind ``_ir.Ir``: the session options, the id,
    the main graph's tensor ids and whether a Session has been built from the Ir."""

    def __init__(self, ir: Ir) -> None:
        self._ir = ir
        self._options = SessionOptions(ir)

    def getSessionOptions(self) -> SessionOptions:
        """The Ir's ``SessionOptions`` (the same object each call; edits stick)."""
        return self._options

    def getId(self) -> int:
        return self._ir.id

    def isPrepared(self) -> bool:
        return self._ir._sessions > 0

    def getMainGraph(self) -> PbMainGraph:
        return PbMainGraph(self._ir)

    def logIr(self) -> None:
        """Log every graph's text at INFO (logger ``torch_popxl.ir``), as upstream logs its IR
        at POPART_LOG_LEVEL=INFO: silent unless that level is enabled."""
        log = logging.getLogger("torch_popxl.ir")
        for graph in self._ir.graphs:
            log.info("%s", graph.text())

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"Ir._pb_ir has no {name!r}: torch_popxl provides only getSessionOptions(), getId(), "
            "getMainGraph(), isPrepared() and logIr() of upstream's internal Ir; use the public "
            "popxl.Ir API for the rest."
        )
