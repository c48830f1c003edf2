"""``OpDef``: the record that is an op's identity, and ``Effects``, what an op does besides
computing its outputs.

Note [op definitions]
~~~~~~~~~~~~~~~~~~~~~
An IR op (``Op``) is one of

* a call or repeat (``OpKind.CALL`` / ``OpKind.REPEAT``): the walkers enter the callee;
* a captured torch op (``OpKind.TORCH``): its identity is the ``OpOverload`` in its
  ``TorchCall``; torch's schema says what it writes and aliases, and the project's own custom
  ops (the collectives, ...) have a definition found by that overload (``definition_of``);
* a runtime op (remote loads and stores, host loads and stores, print): ``op.kind`` *is* its
  definition, an ``OpDef`` made and registered by its stanza in ``opdefs/``.

``OpKind`` keeps ``TORCH`` because a captured op's identity is already a first-class object
(torch's ``OpOverload``, with schema, batching rules and decompositions): wrapping each of the
~2,000 aten overloads into an ``OpDef`` would duplicate torch's table. ``CALL`` and ``REPEAT``
stay kinds because they are control structure, not ops with semantics of their own.

The definition is a frozen record: its name (``op.kind == "remote_load"`` compares the name),
the effect flags, the typed attribute record its ops carry, the inputs it writes and the
outputs that alias inputs, and its rules by name (``opdef.rule("reference")``; the rules are
listed in opdefs/registry.py). Code outside ``opdefs/`` never tests which runtime op it has: a
walker asks ``walk.effects(op)``, a consumer asks the definition for a rule.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .graph import Op

__all__ = [
    "Effect",
    "Effects",
    "MissingRuleError",
    "OpDef",
    "definition_of",
    "register",
    "registered",
    "runtime_definition",
]


class Effect(enum.Flag):
    NONE = 0
    COLLECTIVE = enum.auto()  # talks to other replicas
    REMOTE = enum.auto()  # reads or writes streaming memory
    HOST_IO = enum.auto()  # reads or writes host streams
    INPLACE = enum.auto()  # writes one of its inputs
    BUFFER_READ = enum.auto()  # reads a remote buffer
    BUFFER_WRITE = enum.auto()  # writes a remote buffer


@dataclass(frozen=True, slots=True)
class Effects:
    """What one op does besides computing its outputs (Note [one effects query] in
    ir/walk.py).

    ``writes``: the input indices the op updates in place; ``aliases``: {output index: input
    index} for outputs that are aliases of an input (an update of either is seen by the
    other); ``undeclared``: the subset of ``writes`` torch makes without its schema saying so
    (batch norm's running statistics: they carry no gradient); ``flags``: collective,
    streaming memory, host IO; ``views``: {output index: input index} for outputs that are new
    tensors in the program's semantics but that torch's kernel returns as views of an input,
    so they share its storage at run time unless the executors copy them (Note [views of new
    tensors] in ir/views.py)."""

    writes: frozenset[int] = frozenset()
    aliases: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    undeclared: frozenset[int] = frozenset()
    flags: Effect = Effect.NONE
    views: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def shared(self) -> Mapping[int, int]:
        """{output: input} for every output that shares an input's storage when the op runs:
        its aliases and its views (what the fast compiler's analyses of storage need)."""
        if not self.views:
            return self.aliases
        return MappingProxyType({**self.aliases, **self.views})

    @property
    def is_collective(self) -> bool:
        return Effect.COLLECTIVE in self.flags

    @property
    def reads_buffer(self) -> bool:
        return Effect.BUFFER_READ in self.flags

    @property
    def writes_buffer(self) -> bool:
        return Effect.BUFFER_WRITE in self.flags

    @property
    def host_io(self) -> bool:
        return Effect.HOST_IO in self.flags


class MissingRuleError(NotImplementedError):
    """An op definition was asked for a rule it does not have."""


@dataclass(frozen=True, eq=False)
class OpDef:
    """One op's definition (Note [op definitions]): its name, effect flags and rules; for a
    runtime op also the attribute record its ops carry (``attrs``), the inputs it writes, its
    {output: input} aliases and its views (new tensors that run as an input's storage, Note
    [views of new tensors] in ir/views.py)."""

    name: str
    effects: Effect = Effect.NONE
    rules: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    popart_type: str = ""  # the upstream op type, as popxl-addons' graph listings print it
    attrs: type | None = None
    writes: frozenset[int] = frozenset()
    aliases: Mapping[int, int] = field(default_factory=dict)
    views: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", MappingProxyType(dict(self.rules)))
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))
        object.__setattr__(self, "views", MappingProxyType(dict(self.views)))
        object.__setattr__(self, "writes", frozenset(self.writes))
        object.__setattr__(
            self,
            "_effects",
            Effects(self.writes, self.aliases, frozenset(), self.effects, self.views),
        )

    # A definition compares equal to its name, as ``OpKind`` members do to their values, so
    # ``op.kind == "remote_load"`` holds for both encodings.
    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return other == self.name
        return self is other

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

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

    def effects_of(self, op: Op) -> Effects:
        """The ``Effects`` of one of this definition's ops (the same for all of them)."""
        return self._effects  # type: ignore[attr-defined]

    def traffic(self, op: Op, num_replicas: int):
        return self.rule("traffic")(op, num_replicas)


_DEFS: list[OpDef] = []
_BY_TARGET: dict[Any, OpDef] = {}
_BY_NAME: dict[str, OpDef] = {}


def register(opdef: OpDef, *targets: Any) -> OpDef:
    """Register ``opdef``; ``targets`` are the ``OpOverload``s of captured ops it defines (none
    for a runtime op, whose ops carry the definition itself)."""
    assert all(d is not opdef for d in _DEFS), f"{opdef.name} registered twice"
    for target in targets:
        assert target not in _BY_TARGET, f"{target} already has an op definition"
        _BY_TARGET[target] = opdef
    if opdef.attrs is not None:
        assert opdef.name not in _BY_NAME, f"{opdef.name} already names an op definition"
        _BY_NAME[opdef.name] = opdef
    _DEFS.append(opdef)
    return opdef


def definition_of(target: Any) -> OpDef | None:
    """The definition registered for a captured op's ``OpOverload``, or None."""
    return _BY_TARGET.get(target)


def runtime_definition(name: str) -> OpDef | None:
    """The registered runtime op definition called ``name``, or None."""
    return _BY_NAME.get(name)


def registered() -> list[OpDef]:
    """Every registered op definition, once each, in registration order."""
    return list(_DEFS)
