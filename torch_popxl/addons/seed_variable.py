"""``seed_variable``: a random-seed variable per replica group, kept in a remote buffer."""

from __future__ import annotations

from .. import dtypes as _dtypes
from .. import ops
from ..errors import given
from ..ir.context import _execution_context, gcg, gmg
from ..ir.remote_buffer import remote_buffer
from ..ir.replica_grouping import ReplicaGrouping
from ..ir.tensor import Tensor, Variable
from ..random_seed import create_seeds
from ..remote import remote_variable

__all__ = ["seed_variable"]


def seed_variable(
    seed: int, replica_grouping: ReplicaGrouping | None = None
) -> tuple[Variable, Tensor]:
    """``(variable, tensor)`` for a ``uint32[2]`` random seed, one value per group of
    ``replica_grouping`` (default: groups of one replica, so every replica draws differently).

    The variable lives in a remote buffer and is the handle for ``Session`` reads and writes
    (``get_tensor_data``, checkpoints); the tensor is its on-chip value in the main graph, to
    pass to random ops (``ops.split_random_seed``, ``ops.dropout``...). The tensor is loaded
    from the buffer after every ``weights_from_host`` and stored back before every
    ``weights_to_host``, so a seed advanced in place on device survives a save and restore.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed_variable: seed must be an int; got {given(seed)}.")
    ir = gcg().ir
    replica_grouping = replica_grouping or ir.replica_grouping(group_size=1)
    values = create_seeds(seed, replicas=replica_grouping.num_groups)
    buffer = remote_buffer((2,), _dtypes.uint32)
    seed_var = remote_variable(
        values, buffer, replica_grouping=replica_grouping, name="random_seed"
    )
    with gmg():
        with _execution_context("WeightsFromHostFragment"):
            seed_t = ops.remote_load(buffer, 0, "random_seed_h2d")
        with _execution_context("WeightsToHostFragment"):
            ops.remote_store(buffer, 0, seed_t)
    return seed_var, seed_t
