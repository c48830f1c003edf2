"""torch_popxl: Graphcore PopXL semantics on torch tensors.

``import torch_popxl as popxl`` runs PopXL programs on the simulator: an ``Ir`` of graphs,
variables and host streams, run by a ``Session``, with replication, replica groupings,
replicated tensor sharding and remote buffers.
"""

from . import dtypes, fp8_utils, ops, tensor_methods, transforms, utils
from .compile import InferenceProgram, Trainer, compile
from .context import (
    gcg,
    get_current_context,
    get_current_graph,
    get_main_graph,
    gir,
    gmg,
    in_sequence,
    io_tiles,
    ipu,
    name_scope,
)
from .dtypes import (
    bfloat16,
    bool,
    complex64,
    complex128,
    double,
    dtype,
    float,
    float8_143,
    float8_152,
    float16,
    float32,
    float64,
    half,
    int8,
    int16,
    int32,
    int64,
    uint8,
    uint16,
    uint32,
    uint64,
)
from .errors import PopXLError
from .graph import Graph
from .ir import Ir
from .module import Module
from .random_seed import create_seeds
from .remote import (
    remote_replica_sharded_variable,
    remote_variable,
    replica_sharded_buffer,
    replica_sharded_variable,
)
from .remote_buffer import RemoteBuffer, remote_buffer
from .replica_grouping import ReplicaGrouping
from .runtime.session import Session
from .streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream
from .tensor import (
    Constant,
    Tensor,
    TensorByRef,
    TensorSpec,
    Variable,
    constant,
    graph_input,
    graph_output,
    variable,
)
from .tensorlocation import (
    ExecutionContext,
    ReplicatedTensorSharding,
    TensorLocation,
    TensorStorage,
    TileSet,
)

tensor_methods.install()

__version__ = "0.1.0"

__all__ = [
    "Ir", "Graph", "Session", "Module", "Tensor", "Variable", "Constant", "TensorSpec",
    "TensorByRef", "ReplicaGrouping", "RemoteBuffer", "HostToDeviceStream",
    "DeviceToHostStream", "PopXLError",
    "variable", "constant", "graph_input", "graph_output", "h2d_stream", "d2h_stream",
    "remote_buffer", "remote_variable", "remote_replica_sharded_variable",
    "replica_sharded_buffer", "replica_sharded_variable",
    "gcg", "gmg", "gir", "get_current_context", "get_main_graph", "in_sequence", "io_tiles",
    "ipu", "name_scope", "get_current_graph", "create_seeds", "TensorStorage", "TensorLocation",
    "ReplicatedTensorSharding", "TileSet", "ExecutionContext", "utils", "fp8_utils",
    "ops", "transforms", "dtypes", "dtype", "compile", "Trainer", "InferenceProgram",
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float8_143", "float8_152", "bfloat16", "float16", "float32", "float64", "complex64", "complex128",
    "half", "float", "double",
]  # fmt: skip
