"""``popart``: the part of PopART's Python module that PopXL programs and tests use.

Graphcore's applications write weights with ``utils.write_variables_pb``, which calls
``session._pb_session.writeWeights(popart.PyWeightsIO({tensor.id: array}))``; upstream's tests
name communication groups (``popart.CommGroupType``, ``popart.CommGroup``: the classes
``popxl.ops.collectives`` exports, as upstream's are the same objects) and data types
(``popart.DataType.FLOAT8_143``), set log levels (``popart.getLogger().setLevel("DEBUG")``)
and catch ``popart.popart_exception``, the error PopART raises
for a program it refuses (here ``PopXLError``, which the same checks raise), and
``popart.poplar_application_runtime_error``, raised by a check that runs with the program. ``import popart``
ports as ``import torch_popxl.popart as popart``. Programs reach PopART's options through
``ir._pb_ir.getSessionOptions()``.
"""

from __future__ import annotations

import enum
import logging

from .errors import ApplicationRuntimeError, PopXLError
from .ops.collectives import CommGroup, CommGroupType

__all__ = ["PyWeightsIO", "CommGroup", "CommGroupType", "DataType", "popart_exception",
           "poplar_application_runtime_error", "getLogger"]  # fmt: skip

popart_exception = PopXLError
# A check compiled into the program failed while it ran (a float8 op's log2 scale out of
# range: Note [log2 scale range check] in opdefs/log2_scale.py).
poplar_application_runtime_error = ApplicationRuntimeError


class PyWeightsIO(dict):
    """``{variable id: numpy array}``, as ``Session._pb_session.writeWeights`` takes it."""


class DataType(enum.Enum):
    """PopART's ``DataType`` names (``popxl.dtype`` is what programs compute with)."""

    UINT8 = enum.auto()
    INT8 = enum.auto()
    UINT16 = enum.auto()
    INT16 = enum.auto()
    INT32 = enum.auto()
    INT64 = enum.auto()
    UINT32 = enum.auto()
    UINT64 = enum.auto()
    BOOL = enum.auto()
    FLOAT = enum.auto()
    FLOAT16 = enum.auto()
    BFLOAT16 = enum.auto()
    FLOAT8_143 = enum.auto()
    FLOAT8_152 = enum.auto()
    DOUBLE = enum.auto()
    COMPLEX64 = enum.auto()
    COMPLEX128 = enum.auto()
    STRING = enum.auto()
    UNDEFINED = enum.auto()


def getLogger(name: str = "all") -> logging.Logger:  # noqa: N802 (PopART's name)
    """The package's logger, as PopART's ``getLogger`` (its ``setLevel("DEBUG")`` etc. work);
    the named PopART log modules are one logger here."""
    return logging.getLogger("torch_popxl")
