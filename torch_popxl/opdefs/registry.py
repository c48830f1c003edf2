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

IR ops are looked up by their target: the ``OpOverload`` of a captured ``torch_popxl`` custom
op, or the kind of a runtime op (``OpKind.HOST_LOAD``, ``OpKind.REMOTE_STORE``, ...).

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

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..ir.graph import Op, OpKind

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


class Effect(enum.Flag):
    NONE = 0
    COLLECTIVE = enum.auto()  # talks to other replicas
    REMOTE = enum.auto()  # reads or writes streaming memory
    HOST_IO = enum.auto()  # reads or writes host streams
    INPLACE = enum.auto()  # writes one of its inputs


class MissingRuleError(NotImplementedError):
    """An op definition was asked for a rule it does not have."""


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


@dataclass(frozen=True)
class OpDef:
    """One op's definition: its name, effects and rules (see the module docstring)."""

    name: str
    effects: Effect = Effect.NONE
    rules: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    popart_type: str = ""  # the upstream op type, as popxl-addons' graph listings print it

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", MappingProxyType(dict(self.rules)))

    def rule(self, rule: str) -> Callable[..., Any]:
        try:
            return self.rules[rule]
        except KeyError:
            raise MissingRuleError(
                f"op {self.name!r} has no {rule!r} rule registered (it has: "
                f"{', '.join(sorted(self.rules)) or 'none'}); add it to the op's stanza in "
                "torch_popxl/opdefs/."
            ) from None

    def has(self, rule: str) -> bool:
        return rule in self.rules

    def traffic(self, op: Op, num_replicas: int) -> Traffic:
        return self.rule("traffic")(op, num_replicas)


_TABLE: dict[Any, OpDef] = {}


def register(opdef: OpDef, *keys: Any) -> OpDef:
    """Make ``opdef`` the definition of IR ops whose target or kind is one of ``keys``."""
    for key in keys:
        assert key not in _TABLE, f"{key} already has an op definition"
        _TABLE[key] = opdef
    return opdef


def lookup(op: Op) -> OpDef | None:
    """The definition of an IR op, or None for plain captured torch ops."""
    key = op.attrs.target if op.kind == OpKind.TORCH else op.kind
    return _TABLE.get(key)


def registered() -> list[OpDef]:
    """Every registered op definition, once each, in registration order."""
    seen: dict[int, OpDef] = {}
    for opdef in _TABLE.values():
        seen.setdefault(id(opdef), opdef)
    return list(seen.values())
