"""The IR: symbolic tensors, graphs, the ``Ir``, contexts, streams and remote buffers.

Data only: building a graph records ops but runs nothing. This package is the bottom layer of
torch_popxl (docs/architecture.md) and imports nothing above it. ``torch_popxl.ir`` is also
upstream's ``popxl.ir`` module path, so ``from torch_popxl.ir import Ir`` works.
"""

from .graph import Graph, Op, Slot
from .ir import Ir
from .remote_buffer import RemoteBuffer
from .replica_grouping import ReplicaGrouping
from .streams import DeviceToHostStream, HostToDeviceStream
from .tensor import Constant, Tensor, TensorByRef, TensorSpec, Variable

__all__ = [
    "Constant",
    "DeviceToHostStream",
    "Graph",
    "HostToDeviceStream",
    "Ir",
    "Op",
    "RemoteBuffer",
    "ReplicaGrouping",
    "Slot",
    "Tensor",
    "TensorByRef",
    "TensorSpec",
    "Variable",
]
