"""Graph transforms of popxl-addons: autodiff with and without gradient accumulation,
recomputation, batch serialisation, pipelining, ``repeat_graph`` and the available-memory-proportion
settings (recorded only)."""

from . import batch_serialisation, pipelining, recomputation, repeat_graph  # noqa: F401
from .autodiff import autodiff, autodiff_with_accumulation
from .available_memory_proportion import (
    set_available_memory_proportion_by_ipu,
    set_graph_available_memory_proportion_by_ipu,
)
from .batch_serialisation import (
    BatchSerialResult,
    RemoteHandle,
    batch_serial_buffer,
    batch_serialise,
    batch_serialise_fwd_and_grad,
)
from .pipelining import pipelined_execution
from .recomputation import recompute_graph

__all__ = [
    "autodiff", "autodiff_with_accumulation", "recompute_graph", "batch_serialise",
    "batch_serialise_fwd_and_grad", "batch_serial_buffer", "BatchSerialResult", "RemoteHandle",
    "set_available_memory_proportion_by_ipu", "set_graph_available_memory_proportion_by_ipu",
    "pipelined_execution",
]  # fmt: skip
