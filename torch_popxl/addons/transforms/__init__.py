"""Graph transforms of popxl-addons: autodiff with and without gradient accumulation,
recomputation, batch serialisation, pipelining, ``repeat_graph``, the available-memory-proportion
settings (recorded only), the 2.x phased-execution helpers (``transforms.phased``) and
``use_fc_pass``."""

from . import (  # noqa: F401
    batch_serialisation,
    phased,
    pipelining,
    recomputation,
    repeat_graph,
    use_fc_pass,
)
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
from .use_fc_pass import disable_fc_pass, enable_fc_pass

__all__ = [
    "autodiff", "autodiff_with_accumulation", "recompute_graph", "batch_serialise",
    "batch_serialise_fwd_and_grad", "batch_serial_buffer", "BatchSerialResult", "RemoteHandle",
    "set_available_memory_proportion_by_ipu", "set_graph_available_memory_proportion_by_ipu",
    "pipelined_execution", "disable_fc_pass", "enable_fc_pass",
]  # fmt: skip
