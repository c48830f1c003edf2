"""The public-name contract with popxl-addons 3.4 (github.com/graphcore/popxl-addons, release
3.4, commit 7499fca): every public module and name imports from ``torch_popxl.addons`` under the
same path. The table names the upstream file each name comes from; top-level names are those
``popxl_addons/__init__.py`` re-exports with star imports (module, graph_cache, remote,
route_tensor, rts, ops, transforms, streams, utils).

Names not provided yet are listed in ``NOT_YET`` and checked as strict xfails, so providing one
fails the test until it moves into the contract proper.
"""

from __future__ import annotations

import importlib

import pytest

# (module path under popxl_addons, upstream file, public names), roughly in order of how often
# Graphcore's applications (GPT-J, GPT-3, BERT, T5, Llama, Bloom, tutorials) use them.
CONTRACT = [
    ("", "popxl_addons/__init__.py (star imports)", [
        "Module", "NamedTensors", "NamedVariableFactories", "VariableFactory", "add_variable_input",
        "add_replica_sharded_variable_input", "GraphWithNamedArgs", "BoundGraph", "GraphCache", "function",
        "OrderedDict", "load_remote_graph", "store_remote_graph", "named_buffers", "named_variable_buffers",
        "create_remote_buffer", "route_tensor_into_graph", "is_subgraph", "all_gather_replica_sharded_graph",
        "reduce_replica_sharded_graph", "reduce_replica_sharded_tensor", "gather_replica_sharded_tensor",
        "replica_sharded_spec", "cross_entropy", "cross_entropy_with_grad", "host_load", "host_store",
        "fp8_amax_scale", "autodiff", "autodiff_with_accumulation", "set_available_memory_proportion_by_ipu",
        "set_graph_available_memory_proportion_by_ipu", "batch_serialise", "batch_serialise_fwd_and_grad",
        "batch_serial_buffer", "RemoteHandle", "pipelined_execution", "recompute_graph", "InputStreams",
        "OutputStreams", "timer", "null_context", "suffix_graph_name", "GIT_COMMIT",
    ]),
    ("module", "popxl_addons/module.py", ["Module", "create_grad_graph_info"]),
    ("graph", "popxl_addons/graph.py", ["GraphWithNamedArgs", "BoundGraph"]),
    ("graph_cache", "popxl_addons/graph_cache.py", ["GraphCache", "function"]),
    ("variable_factory", "popxl_addons/variable_factory.py", [
        "VariableFactory", "NamedVariableFactories", "add_variable_input", "add_replica_sharded_variable_input",
    ]),
    ("named_tensors", "popxl_addons/named_tensors.py", ["NamedTensors", "NamedTensorData"]),
    ("dot_tree", "popxl_addons/dot_tree.py", ["DotTree"]),
    ("named_replica_grouping", "popxl_addons/named_replica_grouping.py", [
        "NamedReplicaGrouping", "fill_none_group", "get_instance_replica_grouping", "is_cross_instance",
        "get_ild_size_from_popdist", "get_ild_replica_grouping", "is_cross_ild",
    ]),
    ("layers", "popxl_addons/layers/__init__.py", ["Linear", "Embedding", "LayerNorm", "GroupNorm", "Conv2D"]),
    ("layers.layer_norm_distributed", "popxl_addons/layers/layer_norm_distributed.py", ["LayerNormDistributed"]),
    ("layers.linear_gq", "popxl_addons/layers/linear_gq.py", ["LinearGQ"]),
    ("optimizers.adam", "popxl_addons/optimizers/adam.py", ["AdamOptimizerStep"]),
    ("ops", "popxl_addons/ops/__init__.py", [
        "cross_entropy", "cross_entropy_with_grad", "host_load", "host_store", "fp8_amax_scale",
    ]),
    ("ops.replicated_all_reduce_TP", "popxl_addons/ops/replicated_all_reduce_TP/replicated_all_reduce_TP.py", [
        "replicated_all_reduce_identical_inputs", "replicated_all_reduce_identical_grad_inputs",
        "replicated_all_reduce",
    ]),
    ("ops.replicated_strided_collectives", "popxl_addons/ops/replicated_strided_collectives/*.py", [
        "replicated_all_gather_strided", "replicated_all_reduce_strided",
        "replicated_all_reduce_strided_identical_inputs", "replicated_all_reduce_strided_identical_grad_inputs",
        "replicated_all_reduce_strided_graph", "replicated_reduce_scatter_strided",
    ]),
    ("ops.cross_entropy_sharded_loss", "popxl_addons/ops/cross_entropy_sharded_loss/cross_entropy_sharded_loss.py",
     ["cross_entropy_sharded_loss"]),
    ("ops.rotary_pos_embed", "popxl_addons/ops/rotary_pos_embed/rotary_pos_embed.py",
     ["rotary_pos_embed", "trig_tables", "trig_table_constants"]),
    ("ops.layer_norm_distributed", "popxl_addons/ops/layer_norm_distributed/layer_norm_distributed.py",
     ["layer_norm_distributed"]),
    ("ops.grad_reduce_square_add", "popxl_addons/ops/grad_reduce_square_add/grad_reduce_square_add.py",
     ["grad_reduce_square_add"]),
    ("ops.group_quantize_decompress", "popxl_addons/ops/group_quantize_decompress/group_quantize_decompress.py", [
        "group_quantize_decompress", "group_quantize_decompress_numpy", "group_quantize_compress_numpy",
    ]),
    ("ops.cross_entropy_sharded_wr_loss",
     "popxl_addons/ops/cross_entropy_sharded_wr_loss/cross_entropy_sharded_wr_loss.py",
     ["cross_entropy_sharded_wr_loss"]),
    ("ops.static_sparse_ops", "popxl_addons/ops/static_sparse_ops/dense_sparse_matmul.py",
     ["dense_const_sparse_matmul", "random_sparse"]),
    ("ops.linear_layout", "popxl_addons/ops/linear_layout/linear_layout.py", ["linear_layout"]),
    ("remote", "popxl_addons/remote.py", [
        "NamedRemoteBuffers", "load_remote", "store_remote", "load_remote_graph", "store_remote_graph",
        "named_buffers", "named_variable_buffers", "create_remote_buffer",
    ]),
    ("rts", "popxl_addons/rts.py", [
        "replica_sharded_spec", "reduce_replica_sharded_graph", "all_gather_replica_sharded_graph",
        "reduce_replica_sharded_tensor", "gather_replica_sharded_tensor",
    ]),
    ("route_tensor", "popxl_addons/route_tensor.py", ["route_tensor_into_graph", "is_subgraph"]),
    ("seed_variable", "popxl_addons/seed_variable.py", ["seed_variable"]),
    ("streams", "popxl_addons/streams.py", ["InputStreams", "OutputStreams"]),
    ("task_session", "popxl_addons/task_session.py", ["TaskSession", "write_variables_pb"]),
    ("testing_utils", "popxl_addons/testing_utils.py", ["run_module", "TensorInput"]),
    ("utils", "popxl_addons/utils.py", ["timer", "null_context", "suffix_graph_name"]),
    ("transforms", "popxl_addons/transforms/__init__.py", [
        "autodiff", "autodiff_with_accumulation", "set_available_memory_proportion_by_ipu",
        "set_graph_available_memory_proportion_by_ipu", "batch_serialise", "batch_serialise_fwd_and_grad",
        "batch_serial_buffer", "pipelined_execution", "recompute_graph",
    ]),
    ("transforms.autodiff", "popxl_addons/transforms/autodiff.py", ["autodiff", "autodiff_with_accumulation"]),
    ("array_munging", "popxl_addons/array_munging.py", [
        "shard", "unshard_arrays", "unshard", "repeat", "repeat_axis", "split2D", "shard2D", "unshard2D",
        "repeat_shard", "tensor_parallel_input", "tensor_parallel_output", "pad_axis", "squeeze_safe",
        "handle_negative_axis",
    ]),
]  # fmt: skip

# Not provided yet: (module path, name), checked as strict xfails; a name
# of None means the whole module.
NOT_YET: set[tuple[str, str | None]] = set()


def _cases():
    for path, _source, names in CONTRACT:
        if not names or (path, None) in NOT_YET:
            yield pytest.param(
                path, None, marks=_mark(path, None), id=f"{path or 'addons'}:<module>"
            )
        for name in names:
            yield pytest.param(path, name, marks=_mark(path, name), id=f"{path or 'addons'}:{name}")


def _mark(path, name):
    if (path, name) in NOT_YET or (path, None) in NOT_YET:
        return pytest.mark.xfail(strict=True, reason="not provided yet (see NOT_YET)")
    return ()


@pytest.mark.parametrize("path, name", list(_cases()))
def test_upstream_public_name_imports_from_the_same_path(path, name):
    module = importlib.import_module("torch_popxl.addons" + (f".{path}" if path else ""))
    if name is not None:
        assert hasattr(module, name), f"torch_popxl.addons{'.' + path if path else ''} lacks {name}"


def test_not_yet_lists_only_names_of_the_contract():
    known = {(p, n) for p, _, names in CONTRACT for n in names} | {
        (p, None) for p, _, _ in CONTRACT
    }
    assert NOT_YET <= known


def test_git_commit_is_a_short_hash_or_none():
    import torch_popxl.addons as addons

    assert addons.GIT_COMMIT is None or (
        len(addons.GIT_COMMIT) >= 7 and int(addons.GIT_COMMIT, 16) >= 0
    )
