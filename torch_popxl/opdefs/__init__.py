"""Op definitions: one stanza module per PopXL-specific op (or tight family) holding all the
project knows about it — its per-replica custom op with fake, vmap and autograd rules, the
fake and autograd rules of its stacked C++ kernel, its per-replica reference semantics, its
traffic formula, the facts the fast compiler needs, its explicit-batching and torch.distributed
rules, and its public wrapper — registered by name in one ``OpDef`` (``registry.py``).

Stanzas: ``all_reduce``, ``all_reduce_tp`` (popxl-addons' differentiable TP all-reduce), ``all_gather``, ``reduce_scatter`` (with ``'local'``, PopXL's
``replica_sharded_slice``), ``take_own`` (``replicated_slice``), ``remote`` (remote loads and
stores), ``host`` (host streams), ``print_tensor`` (host prints), ``ipu_copy`` (copies between IPUs), ``log2_scale`` (the run-time range check of a float8 op's scale: Note [log2 scale range check]), ``fused`` (ops the fast compiler makes by fusion), ``scalar_tensor`` (optimizer updates whose
scalar is a tensor), ``sgd`` (the one-pass SGD update) and
``compute`` (FLOP counts of captured matmuls), ``ctc`` (CTC loss with static shapes: Note [CTC
loss in a captured graph]), ``attention`` (the CPU flash-attention ops a
captured program records, on other devices: Note [portable attention]), ``aten_batching``
(vmap rules for the aten ops torch has none for: Note [aten batching rules]). Shared infrastructure: ``registry``,
``backends`` (traffic counters, the collective backend), ``_common`` (argument checks and
layout helpers, Note [collective gradients]), ``_api`` (wrapper checks) and ``reference``
(helpers of the reference semantics).

Sits above capture and below the public API (docs/architecture.md). Importing it loads the
C++ extension.
"""

from . import (
    all_gather,
    all_reduce,
    all_reduce_tp,
    aten_batching,
    attention,
    backends,
    compute,
    ctc,
    fused,
    host,
    ipu_copy,
    log2_scale,
    print_tensor,
    reduce_scatter,
    reference,
    registry,
    remote,
    scalar_tensor,
    sgd,
    take_own,
)
from .registry import Effect, MissingRuleError, OpDef, Traffic, lookup, registered

__all__ = [
    "Effect",
    "MissingRuleError",
    "OpDef",
    "Traffic",
    "all_gather",
    "all_reduce",
    "all_reduce_tp",
    "aten_batching",
    "attention",
    "backends",
    "compute",
    "ctc",
    "fused",
    "host",
    "ipu_copy",
    "log2_scale",
    "lookup",
    "print_tensor",
    "reduce_scatter",
    "reference",
    "registered",
    "registry",
    "remote",
    "scalar_tensor",
    "sgd",
    "take_own",
]
