"""``torch_popxl.addons``: popxl-addons on the torch_popxl simulator.

``import torch_popxl.addons as addons`` provides what popxl-addons programs use: modules whose
variables are named graph inputs (``addons.Module``), variable factories, named tensor trees,
autodiff with gradient accumulation, remote-buffer load/store graphs and replicated tensor
sharding helpers. Submodules keep popxl-addons' paths (``.module``, ``.graph``, ``.rts``, ...).
"""

import subprocess

from . import (  # noqa: F401
    array_munging,
    dot_tree,
    graph,
    graph_cache,
    layers,
    named_replica_grouping,
    named_tensors,
    ops,
    optimizers,
    patterns,
    route_tensor,
    rts,
    task_session,
    transforms,
)
from .dot_tree import DotTree
from .graph import BoundGraph, GraphWithNamedArgs
from .graph_cache import (
    GraphCache,
    argument_hash,
    bound_arguments,
    function,
    get_function_hash,
    named_tensors_function,
    tensor_hash,
)
from .module import Module, create_grad_graph_info
from .named_replica_grouping import NamedReplicaGrouping
from .named_tensors import NamedTensorData, NamedTensors, print_named_tensors
from .ops import cross_entropy, cross_entropy_with_grad, fp8_amax_scale, host_load, host_store
from .remote import (
    NamedRemoteBuffers,
    create_remote_buffer,
    load_remote_graph,
    named_buffers,
    named_variable_buffers,
    store_remote_graph,
)
from .route_tensor import is_subgraph, route_tensor_into_graph
from .rts import (
    all_gather_replica_sharded_graph,
    gather_replica_sharded_tensor,
    reduce_replica_sharded_graph,
    reduce_replica_sharded_tensor,
    replica_sharded_spec,
)

# As upstream (``from .seed_variable import *``): the package attribute is the function, which
# shadows the submodule of the same name (``torch_popxl.addons.seed_variable`` still imports).
from .seed_variable import seed_variable
from .streams import InputStreams, OutputStreams
from .task_session import TaskSession, write_variables_pb
from .transforms import (
    RemoteHandle,
    autodiff,
    autodiff_with_accumulation,
    batch_serial_buffer,
    batch_serialise,
    batch_serialise_fwd_and_grad,
    disable_fc_pass,
    enable_fc_pass,
    pipelined_execution,
    recompute_graph,
    set_available_memory_proportion_by_ipu,
    set_graph_available_memory_proportion_by_ipu,
)
from .utils import (
    WANDB_IMPORTED,
    OrderedDict,
    WeightsDict,
    duplicate_items,
    null_context,
    overrides,
    suffix_graph_name,
    timer,
)
from .variable_factory import (
    NamedVariableFactories,
    VariableFactory,
    add_replica_sharded_variable_input,
    add_variable_input,
)


def _git_commit() -> str | None:
    # As upstream: the short commit of the git repository around the working directory (the
    # application's checkout), or None outside one.
    try:
        out = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


GIT_COMMIT = _git_commit()

__all__ = [
    "GIT_COMMIT", "is_subgraph", "route_tensor_into_graph", "seed_variable", "null_context", "suffix_graph_name",
    "set_available_memory_proportion_by_ipu", "set_graph_available_memory_proportion_by_ipu",
    "replica_sharded_spec", "reduce_replica_sharded_graph", "all_gather_replica_sharded_graph",
    "reduce_replica_sharded_tensor", "gather_replica_sharded_tensor",
    "array_munging", "named_replica_grouping", "route_tensor", "task_session",
    "Module", "create_grad_graph_info", "GraphWithNamedArgs", "BoundGraph", "GraphCache", "function",
    "get_function_hash",
    "argument_hash", "bound_arguments", "tensor_hash", "named_tensors_function", "DotTree", "NamedTensors", "NamedTensorData", "NamedVariableFactories",
    "NamedReplicaGrouping", "NamedRemoteBuffers", "VariableFactory", "add_variable_input",
    "add_replica_sharded_variable_input", "print_named_tensors",
    "autodiff", "autodiff_with_accumulation",
    "recompute_graph", "batch_serialise", "batch_serialise_fwd_and_grad", "batch_serial_buffer",
    "RemoteHandle", "pipelined_execution", "disable_fc_pass", "enable_fc_pass",
    "cross_entropy", "cross_entropy_with_grad", "fp8_amax_scale", "host_load", "host_store",
    "InputStreams", "OutputStreams",
    "load_remote_graph", "store_remote_graph", "named_buffers", "named_variable_buffers",
    "create_remote_buffer",
    "OrderedDict", "WeightsDict", "timer", "overrides", "duplicate_items", "WANDB_IMPORTED",
    "TaskSession", "write_variables_pb",
    "dot_tree", "graph", "graph_cache", "layers", "named_tensors", "ops", "optimizers", "rts",
    "transforms", "patterns",
]  # fmt: skip
