"""``run_module``: build, initialise and run one addons module on host data (for tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import dtypes as _dtypes
from ..ir.ir import Ir
from ..ir.tensor import variable
from ..runtime.session import Session
from .module import Module
from .ops.streams import host_store

__all__ = ["TensorInput", "run_module"]


@dataclass(frozen=True)
class TensorInput:
    """Host data for a tensor argument of ``run_module`` (becomes a variable of ``dtype``)."""

    data: Any
    dtype: Any = None


def run_module(module: Module, *args: Any, weights: Any = None, **kwargs: Any) -> list[np.ndarray]:
    """Run ``module(*args, **kwargs)`` once; ``TensorInput`` arguments become variables.

    ``weights`` is an optional callable ``variables -> {variable: array}`` (for example
    ``lambda v: Linear.torch_mapping(v, torch_layer)``) written before the run. Returns the
    outputs as numpy arrays.
    """
    ir = Ir()
    with ir.main_graph:

        def as_tensor(a: Any) -> Any:
            if isinstance(a, TensorInput):
                dt = _dtypes.dtype.as_dtype(a.dtype) if a.dtype is not None else None
                return variable(a.data, dt)
            return a

        targs = [as_tensor(a) for a in args]
        tkwargs = {k: as_tensor(v) for k, v in kwargs.items()}
        facts, graph = module.create_graph(*targs, **tkwargs)
        variables = facts.init()
        tensor_args = [
            a for a in (*targs, *tkwargs.values()) if not isinstance(a, int | float | str)
        ]
        outputs = graph.bind(variables).call(*tensor_args)
        streams = [host_store(t) for t in outputs]
    with Session(ir, "ipu_model") as session:
        if weights is not None:
            session.write_variables_data(weights(variables))
        result = session.run()
    return [result[s] for s in streams]
