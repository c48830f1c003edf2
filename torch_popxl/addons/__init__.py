"""``torch_popxl.addons``: popxl-addons on the torch_popxl simulator.

``import torch_popxl.addons as addons`` provides what popxl-addons programs use: modules whose
variables are named graph inputs (``addons.Module``), variable factories, named tensor trees,
autodiff with gradient accumulation, remote-buffer load/store graphs and replicated tensor
sharding helpers. Submodules keep popxl-addons' paths (``.module``, ``.graph``, ``.rts``, ...).
"""

from . import dot_tree, graph, graph_cache, layers, named_tensors, ops, optimizers, rts, transforms  # noqa: F401
from .dot_tree import DotTree
from .graph import BoundGraph, GraphWithNamedArgs
from .graph_cache import GraphCache, argument_hash, function, get_function_hash
from .module import Module
from .named_replica_grouping import NamedReplicaGrouping
from .named_tensors import NamedTensorData, NamedTensors, print_named_tensors
from .ops import cross_entropy, cross_entropy_with_grad, host_load, host_store
from .remote import (
    NamedRemoteBuffers,
    create_remote_buffer,
    load_remote_graph,
    named_buffers,
    named_variable_buffers,
    store_remote_graph,
)
from .streams import InputStreams, OutputStreams
from .transforms import (
    RemoteHandle,
    autodiff,
    autodiff_with_accumulation,
    batch_serial_buffer,
    batch_serialise,
    batch_serialise_fwd_and_grad,
    recompute_graph,
)
from .utils import OrderedDict, WeightsDict, timer
from .variable_factory import (
    NamedVariableFactories,
    VariableFactory,
    add_replica_sharded_variable_input,
    add_variable_input,
)

__all__ = [
    "Module", "GraphWithNamedArgs", "BoundGraph", "GraphCache", "function", "get_function_hash",
    "argument_hash", "DotTree", "NamedTensors", "NamedTensorData", "NamedVariableFactories",
    "NamedReplicaGrouping", "NamedRemoteBuffers", "VariableFactory", "add_variable_input",
    "add_replica_sharded_variable_input", "print_named_tensors",
    "autodiff", "autodiff_with_accumulation",
    "recompute_graph", "batch_serialise", "batch_serialise_fwd_and_grad", "batch_serial_buffer",
    "RemoteHandle",
    "cross_entropy", "cross_entropy_with_grad", "host_load", "host_store",
    "InputStreams", "OutputStreams",
    "load_remote_graph", "store_remote_graph", "named_buffers", "named_variable_buffers",
    "create_remote_buffer",
    "OrderedDict", "WeightsDict", "timer",
    "dot_tree", "graph", "graph_cache", "layers", "named_tensors", "ops", "optimizers", "rts",
    "transforms",
]  # fmt: skip
