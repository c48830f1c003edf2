"""``OpDef``: what the project knows about one op, and the table that finds it for an IR op.

An op definition names its rules. Code that needs a rule asks the definition for it
(``opdef.rule("traffic")``); a definition without that rule raises ``MissingRuleError`` naming
the op and the rule, instead of a ``KeyError`` deep inside a walker. The rules, by name:

* ``traffic(op, num_replicas) -> Traffic``: what one execution moves (Note [traffic formulas]);
* ``reference(values, *args)``: the per-replica semantics, one list entry per replica;
* ``wrapper``: the public function (``popxl.ops...``) that records the op;
* ``explicit(op, batched, num_replicas) -> fn | None``: the op on stacked ``[R, ...]`` tensors
  without vmap (Note [explicit batching] in runtime/explicit.py): ``fn`` is called with the
  op's arguments, each tensor stacked or replica-invariant as ``batched`` says; None when the
  op has no such form for these inputs;
* ``explicit_alias(op, batched, num_replicas) -> fn | None`` (optional): the same stacked
  form, but its result may share memory with its input; the compiler calls it only where no
  later write can be seen through the sharing (Note [aliasing collectives] and Note [RTS
  updates in place] in runtime/lower.py);

* ``ipu_transfer(op) -> bool`` (optional): the op moves a value between the IPUs of one
  replica (``ipu_copy``): pipelining puts it in the region's copy unit;

and, for runtime ops (remote and host transfers, print: Note [op definitions] in ir/opdef.py):

* ``run(rt, op, ins) -> outs``: how the reference executor runs the op, with ``ins``/``outs``
  lists of per-replica tensors and ``rt`` the executor's services (``host_load(stream)``,
  ``host_store(stream, values)``, ``buffer(op)``: the per-replica rows of the op's remote
  buffer, ``print(attrs, values)``);
* ``replay(op, ins, replay) -> outs`` (optional): the op under autodiff's replay, on fake
  tensors that carry gradients (print: an identity, printing the gradient on request);
* ``passthrough(op) -> bool`` (optional): the op hands its input on unchanged (print), so
  the fast compiler gives its output the input's value;
* ``lower_analyse(op, f, a)`` and ``lower_emit(op, f, e)``: how the fast compiler analyses
  the op's batching and emits its code, through the small interfaces ``a``/``e`` of
  opdefs/lowering.py (Note [lowering rules]); ``lower_globals() -> {name: object}``
  (optional): the names its emitted code calls; ``lower_stacked(op) -> bool`` (optional):
  its emission handles stacked values and folded loops itself (the host transfers);

and, for collectives (``Effect.COLLECTIVE``):

* ``distributed(backend, stacked, *args) -> (value, out_dim)``: the vmap result when a group
  crosses processes, using the transport services of ``backends.InstanceTransport``;
* ``output_batched(op, num_replicas, input_batched) -> bool``: whether the result differs
  between replicas (validates the grouping first);
* ``passthrough(op) -> bool``: whether the op returns its input unchanged;
* ``no_gradient(op) -> bool``: whether PopXL's autodiff yields no gradient through the op;
* ``sum_read(op, num_replicas) -> fn | None``: how to finish the op on an accumulator that
  already holds the sum over replicas (Note [replica-sum accumulators] in runtime/lower.py),
  as ``fn(sum, batch, stacked_layout=False)`` (``stacked_layout``: explicit batching's
  ``[R, ...]`` values rather than vmap's);
* ``matmul_fusion(op, num_replicas) -> str | None``: the ``mm_all_reduce`` reduction when the
  op applied to a matmul can be fused (Note [fold replicas into the matmul]).

The ``OpDef`` record itself lives in ir/opdef.py (Note [op definitions]): a runtime op (remote
and host transfers, print) carries its definition as its ``kind``; a captured ``torch_popxl``
custom op is looked up by its ``OpOverload``.

Note [traffic formulas]
~~~~~~~~~~~~~~~~~~~~~~~
Collectives are costed with the bandwidth-optimal ring algorithm. Bytes are summed over the R
replicas that run the op; with n = bytes of one replica's input and G = group size:

* all_reduce      R * 2 * (G - 1) * n / G
* all_gather      R * (G - 1) * n
* reduce_scatter  R * (G - 1) * ceil(elements / G) * itemsize (the zero-padded chunk)
* local slices    0 (``take_own``, the ``'local'`` reduce-scatter: PopXL's grad of all_gather)
* ipu_copy        R * n (each replica copies its value to another IPU over the IPU-Links)

A group of size 1 moves nothing but still counts as one call. Each formula is written once, in
its op's stanza (``all_reduce_bytes`` in all_reduce.py, ...): the report, the cost model, the
executor and the torch.distributed rules call it; the C++ counters (csrc/collective_common.h)
implement the same formulas and the tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Op, OpKind
from ..ir.opdef import Effect, MissingRuleError, OpDef, definition_of, register, registered

__all__ = [
    "Effect",
    "MissingRuleError",
    "OpDef",
    "Traffic",
    "TRAFFIC_KINDS",
    "lookup",
    "register",
    "registered",
]

# What a run moves, by kind; every byte figure of the report, the cost model, the runtime
# counters and the torch.distributed backend is one of these.
TRAFFIC_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "local_slice",
    "remote_load",
    "remote_store",
    "host_to_device",
    "device_to_host",
    "ipu_copy",
)


@dataclass(frozen=True, slots=True)
class Traffic:
    """What one execution of an op moves: ``total_bytes`` summed over ``num_replicas``, in
    ``steps`` sync-and-exchange rounds of its ring algorithm (0 for transfers and local
    slices)."""

    kind: str
    total_bytes: int
    group_size: int = 1
    steps: int = 0

    def __post_init__(self) -> None:
        assert self.kind in TRAFFIC_KINDS, self.kind


def lookup(op: Op) -> OpDef | None:
    """The definition of an IR op: a runtime op's own, a captured custom op's by its
    ``OpOverload``; None for plain captured torch ops and for calls and repeats."""
    kind = op.kind
    if isinstance(kind, OpDef):
        return kind
    return definition_of(op.attrs.target) if kind == OpKind.TORCH else None
