"""The ``torch_popxl`` operators, all in one namespace: the module the C++ library names
(``set_python_module`` in csrc/registration.cpp) so that torch can find their fake rules, and
the historical import path of the per-replica ops and the traffic counters. Each op's rules
live in its stanza (``all_reduce.py``, ``all_gather.py``, ``reduce_scatter.py``,
``take_own.py``, ``remote.py``, ``fused.py``); this module only imports and re-exports them.

Two layers of ops live in the ``torch_popxl`` namespace:

* **Stacked ops** (C++, ``csrc/``): ``all_reduce_stacked``, ``all_gather_stacked``,
  ``reduce_scatter_stacked``, ``take_own_stacked``, ``remote_load_stacked`` and
  ``remote_store_stacked_``. Dim 0 of every tensor is the replica dim, of size R, so one call
  simulates all replicas at once.
* **Per-replica ops** (``torch.library.custom_op``, one per stanza): ``replicated_all_reduce``,
  ``replicated_all_gather``, ``replicated_take_own``, ``replicated_reduce_scatter``,
  ``remote_load`` and ``remote_store_``. They describe ONE replica's view, which is what a
  captured PopXL program records. Running the per-replica program under
  ``torch.func.vmap`` over a leading replica dim turns each call into the stacked op: the vmap
  batch size *is* the replica count R (torch-techniques.md §3.1).

Outside vmap a per-replica op sees a single replica, so it only accepts ``group_size == 1``.
Limits that follow from how vmap dispatches custom ops:

* The replica dim is the vmap level that batches the op's inputs. Inside vmap an op whose
  inputs are all unbatched never reaches its vmap rule (torch runs the plain kernel), so it
  behaves as a single replica; batch such a value over replicas first.
* Under nested vmaps the innermost level that batches the inputs is taken as the replica dim.
* Gradients work with ``torch.autograd`` over a vmapped program. ``torch.func.grad`` combined
  with these ops (``vmap(grad(f))`` or ``grad(vmap(f))``) is rejected by torch ("must override
  the setup_context staticmethod"), a limitation of custom-op autograd under functorch.

Note [collective gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Gradients follow PopXL's autodiff rules (popxl.md §5), not the derivative of the stacked
function. PopXL treats each replica's incoming gradient as that replica's local contribution
and leaves any cross-replica sum to collectives the program calls explicitly (for example the
reduce-scatter of weight gradients in RTS training). So:

* all_gather       -> grad is ``take_own``: each replica keeps its own row, no summing;
* take_own         -> grad is ``all_gather`` (PopXL's grad of a 'local' reduce-scatter);
* reduce_scatter   -> grad is ``all_gather`` of the gradient shard for op 'local'; PopXL has
                      no gradient for any other op, so backward raises;
* all_reduce       -> PopXL has no gradient, so backward raises.

The same rules are registered on the stacked ops, because ``torch.autograd`` over a vmapped
program records the stacked calls made by the vmap rules, not the per-replica ops.
"""

from __future__ import annotations

from . import all_gather, all_reduce, fused, reduce_scatter, remote, take_own
from ._common import VALID_OPS, check_grouping, ops
from .backends import (
    Collectives,
    SimulatorCollectives,
    add_host_bytes,
    collectives,
    reset_traffic_counters,
    traffic_counters,
    traffic_scope,
    use_collectives,
)

__all__ = [
    "VALID_OPS",
    "Collectives",
    "SimulatorCollectives",
    "add_host_bytes",
    "check_grouping",
    "collectives",
    "mm_all_reduce",
    "mm_replica_sum",
    "remote_load",
    "remote_store_",
    "replica_sum",
    "replicated_all_gather",
    "replicated_all_reduce",
    "replicated_reduce_scatter",
    "replicated_take_own",
    "reset_traffic_counters",
    "traffic_counters",
    "traffic_scope",
    "use_collectives",
]

_ops = ops

# The per-replica custom ops under their op names.
replicated_all_reduce = all_reduce.per_replica
replicated_all_gather = all_gather.per_replica
replicated_reduce_scatter = reduce_scatter.per_replica
replicated_take_own = take_own.per_replica
remote_load = remote.load_per_replica
remote_store_ = remote.store_per_replica
mm_all_reduce = fused.mm_all_reduce
replica_sum = fused.replica_sum
mm_replica_sum = fused.mm_replica_sum
