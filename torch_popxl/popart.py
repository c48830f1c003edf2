"""``popart``: the part of PopART's Python module that Graphcore's PopXL applications use.

Their ``utils.write_variables_pb`` writes weights with
``session._pb_session.writeWeights(popart.PyWeightsIO({tensor.id: array}))``;
``import popart`` ports as ``import torch_popxl.popart as popart``. Nothing else of PopART is
here: programs reach PopART's options through ``ir._pb_ir.getSessionOptions()``.
"""

from __future__ import annotations

__all__ = ["PyWeightsIO"]


class PyWeightsIO(dict):
    """``{variable id: numpy array}``, as ``Session._pb_session.writeWeights`` takes it."""
