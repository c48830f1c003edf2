"""``OpDef``: what the project knows about one op, and the table that finds it for an IR op.

An op definition names its rules (``traffic``, ``reference``, ...). Code that needs a rule asks
the definition for it; a definition without that rule raises ``MissingRuleError`` naming the op
and the rule, instead of a ``KeyError`` deep inside a walker.

IR ops are looked up by their target: the ``OpOverload`` of a captured ``torch_popxl`` custom
op, or the kind string of a runtime op (``host_load``, ``remote_store``, ...).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..ir.graph import Op, OpKind

__all__ = ["Effect", "MissingRuleError", "OpDef", "Traffic", "TRAFFIC_KINDS", "lookup", "register"]

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
    """What one execution of an op moves: ``total_bytes`` summed over ``num_replicas``."""

    kind: str
    total_bytes: int
    group_size: int = 1

    def __post_init__(self) -> None:
        assert self.kind in TRAFFIC_KINDS, self.kind


@dataclass(frozen=True)
class OpDef:
    """One op's definition: its name, effects and rules (see the module docstring)."""

    name: str
    effects: Effect = Effect.NONE
    rules: Mapping[str, Callable[..., Any]] = field(default_factory=dict)

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
