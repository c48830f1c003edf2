"""``popxl.ops.collectives``: replica collectives (spec §5).

Each op records one per-replica ``torch_popxl`` custom op; the executor runs all replicas at
once under ``vmap`` and the op's vmap rule calls the C++ kernel on the stacked replica layout.
The wrappers live in their op stanzas (``torch_popxl/opdefs/``); this module re-exports them.
"""

from __future__ import annotations

from ..opdefs._api import CollectiveOperator
from ..opdefs.all_gather import replicated_all_gather
from ..opdefs.all_reduce import replicated_all_reduce, replicated_all_reduce_
from ..opdefs.reduce_scatter import replica_sharded_slice, replicated_reduce_scatter
from ..opdefs.take_own import replicated_slice

__all__ = [
    "replicated_all_reduce",
    "replicated_all_reduce_",
    "replicated_all_gather",
    "replicated_reduce_scatter",
    "replica_sharded_slice",
    "replicated_slice",
    "CollectiveOperator",
]
