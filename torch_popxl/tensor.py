"""``popxl.tensor``, upstream's module path for tensor handles and their factories; defined in ``ir/tensor.py``."""

from .ir.tensor import (
    Constant,
    HostTensor,
    Tensor,
    TensorByRef,
    TensorSpec,
    Variable,
    constant,
    graph_input,
    graph_output,
    variable,
)

__all__ = [
    "Constant",
    "HostTensor",
    "Tensor",
    "TensorByRef",
    "TensorSpec",
    "Variable",
    "constant",
    "graph_input",
    "graph_output",
    "variable",
]
