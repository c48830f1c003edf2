"""``popart``: the part of PopART's Python module that Graphcore's PopXL applications use.

Their ``utils.write_variables_pb`` writes weights with
``session._pb_session.writeWeights(popart.PyWeightsIO({tensor.id: array}))``;
``import popart`` ports as ``import torch_popxl.popart as popart``. ``popart_exception``,
PopART's exception class, is ``PopXLError``. Nothing else of PopART is here: programs reach
PopART's options through ``ir._pb_ir.getSessionOptions()``.
"""

from __future__ import annotations

from .errors import PopXLError

__all__ = ["PyWeightsIO", "popart_exception"]


class PyWeightsIO(dict):
    """``{variable id: numpy array}``, as ``Session._pb_session.writeWeights`` takes it."""


# PopART's one exception class; PopXLError is what torch_popxl raises where PopART would.
popart_exception = PopXLError
