"""``popxl.ReplicaGrouping``: a partition of the R replicas of an Ir into equal-size groups.

A grouping is *constant* when it is described by a stride S and a group size G (C++
``ReplicaGrouping``): group g holds replicas ``(g // S) * S * G + g % S + i * S`` for
``i < G``. Only constant groupings can drive collectives. Any other partition into equal-size
groups (from ``ir.replica_grouping_from_assignments``) is *non-constant*: it can still describe
how a variable is initialised and read, through its constant refinement ``const_rg``.

Groupings are immutable. Every grouping stores its full ``assignment`` and member table, so
the runtime's lookups are table reads; the constant formulas are kept as the definition and
are tested against the tables.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ir import Ir

__all__ = ["ReplicaGrouping"]


class ReplicaGrouping:
    """A partition of an Ir's replicas into groups; create with ``ir.replica_grouping``."""

    __slots__ = (
        "ir",
        "_num_replicas",
        "_stride",
        "_group_size",
        "_assignment",
        "_members_table",
        "_index_table",
        "_refinement_cache",
    )
    # The slots' types; every instance fills them in ``_build`` (never ``__init__``).
    ir: Ir
    _num_replicas: int
    _stride: int | None  # None for a non-constant grouping
    _group_size: int
    _assignment: tuple[int, ...]
    _members_table: tuple[tuple[int, ...], ...]
    _index_table: tuple[int, ...]
    _refinement_cache: tuple[ReplicaGrouping, tuple[int, ...], tuple[int, ...]] | None

    # `__eq__` compares assignments, which PopXL does without defining `__hash__`.
    __hash__ = None  # type: ignore[assignment]

    def __init__(self) -> None:
        raise RuntimeError(
            "popxl.ReplicaGrouping cannot be constructed directly. Use "
            "ir.replica_grouping(stride, group_size) or "
            "ir.replica_grouping_from_assignments(assignment)."
        )

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"ReplicaGrouping is immutable (tried to set {key!r}).")

    # ------------------------------------------------------------------------------------
    # Construction (what `Ir.replica_grouping*` call)
    # ------------------------------------------------------------------------------------

    @classmethod
    def _from_params(
        cls, ir: Any, stride: int = 1, group_size: int | None = None
    ) -> ReplicaGrouping:
        """Implements ``ir.replica_grouping(stride=1, group_size=None)``.

        ``group_size`` defaults to ``R // stride``. A group size of 1 forces the stride to 1.

        Raises:
            ValueError: if ``stride`` or ``group_size`` is out of range, or the groups do not
                tile the replicas (``R % (stride * group_size) != 0``).
        """
        num_replicas = _num_replicas_of(ir)
        stride = _as_int("stride", stride)
        if not 0 < stride <= num_replicas:
            raise ValueError(
                f"stride={stride} is out of range for replication factor {num_replicas}: it "
                f"must satisfy 0 < stride <= {num_replicas}."
            )
        if num_replicas % stride != 0:
            raise ValueError(
                f"stride={stride} does not divide the replication factor {num_replicas}. Use "
                f"a stride that divides {num_replicas}."
            )
        group_size = num_replicas // stride if group_size is None else group_size
        group_size = _as_int("group_size", group_size)
        if not 0 < group_size <= num_replicas:
            raise ValueError(
                f"group_size={group_size} is out of range for replication factor "
                f"{num_replicas}: it must satisfy 0 < group_size <= {num_replicas}."
            )
        if group_size == 1:
            # Every replica is alone, whatever the stride; PopXL normalises to (1, 1).
            stride = 1
        # PopXL only fails here when the grouping is first used by a collective or variable
        # (its assignment contains None entries). Failing now points at the real mistake.
        if num_replicas % (stride * group_size) != 0:
            raise ValueError(
                f"Replica grouping with stride={stride} and group_size={group_size} does not "
                f"tile the {num_replicas} replicas: stride * group_size = "
                f"{stride * group_size} must divide the replication factor {num_replicas}. "
                f"For example stride={stride} allows group_size in "
                f"{_divisors(num_replicas // stride)}."
            )
        assignment = [
            (r % stride) + stride * (r // (stride * group_size)) for r in range(num_replicas)
        ]
        return cls._build(ir, num_replicas, stride, group_size, assignment)

    @classmethod
    def _from_assignments(cls, ir: Any, assignment: Iterable[int]) -> ReplicaGrouping:
        """Implements ``ir.replica_grouping_from_assignments(assignment)``.

        ``assignment[r]`` is the group of replica r. If every group is an arithmetic progression
        with one common step s, the constant grouping ``(stride=s, group_size=G)`` is returned.

        Quirk: PopXL crashes ("min() arg is an empty sequence") when every group has size 1.
        Here that case returns the trivial constant grouping (stride 1, group size 1) instead.

        Raises:
            TypeError: if ``assignment`` is not a sequence of ints.
            ValueError: checked in this order: the groups differ in size; the group ids are not
                exactly ``0..k-1``; the ids do not first appear in increasing order;
                ``len(assignment)`` differs from the replication factor.
        """
        num_replicas = _num_replicas_of(ir)
        assignment = _as_int_list(assignment)
        members = _members_by_group_id(assignment)

        sizes = {len(m) for m in members.values()}
        if len(sizes) > 1:
            by_size = {g: len(m) for g, m in sorted(members.items())}
            raise ValueError(
                f"All groups in a replica grouping must have the same size, but assignment "
                f"{assignment} gives group sizes {by_size} (group: size)."
            )
        if sorted(members) != list(range(len(members))):
            raise ValueError(
                f"Group ids in a replica grouping must be exactly 0..k-1, but assignment "
                f"{assignment} uses ids {sorted(members)}. Renumber the groups from 0 "
                f"without gaps."
            )
        first_appearance = list(members)  # dicts keep insertion order
        if first_appearance != sorted(first_appearance):
            raise ValueError(
                f"Group ids in a replica grouping must first appear in increasing order, but "
                f"assignment {assignment} introduces them in the order {first_appearance}. "
                f"Renumber the groups by their first replica."
            )
        if len(assignment) != num_replicas:
            raise ValueError(
                f"The assignment has {len(assignment)} entries, but the replication factor is "
                f"{num_replicas}: give one group id per replica."
            )

        group_size = sizes.pop()
        steps = {b - a for m in members.values() for a, b in itertools.pairwise(m)}
        if group_size == 1:
            return cls._from_params(ir, 1, 1)
        if len(steps) == 1:
            (step,) = steps
            const = cls._from_params(ir, step, group_size)
            # A partition into progressions of one common step is unique, so it is `const`.
            assert const._assignment == tuple(assignment), (assignment, const)
            return const
        return cls._build(ir, num_replicas, None, group_size, assignment)

    @classmethod
    def _build(
        cls,
        ir: Any,
        num_replicas: int,
        stride: int | None,
        group_size: int,
        assignment: list[int],
    ) -> ReplicaGrouping:
        """Make an instance from a validated assignment; ``stride`` is None if non-constant."""
        members = tuple(tuple(m) for m in _members_by_group_id(assignment).values())
        index = [0] * num_replicas
        for group in members:
            for i, r in enumerate(group):
                index[r] = i
        self = object.__new__(cls)
        for slot, value in (
            ("ir", ir),
            ("_num_replicas", num_replicas),
            ("_stride", stride),
            ("_group_size", group_size),
            ("_assignment", tuple(assignment)),
            ("_members_table", members),
            ("_index_table", tuple(index)),
            ("_refinement_cache", None),
        ):
            object.__setattr__(self, slot, value)
        return self

    # ------------------------------------------------------------------------------------
    # Public properties
    # ------------------------------------------------------------------------------------

    @property
    def stride(self) -> int:
        """The replica-index step between consecutive members of a group.

        Raises:
            NotImplementedError: if the grouping is not constant.
        """
        if self._stride is None:
            raise NotImplementedError(
                f"{self!r} is not a constant-stride grouping, so it has no stride. Use "
                f"`assignment`, or `const_rg` for its constant refinement."
            )
        return self._stride

    @property
    def num_replicas(self) -> int:
        """The (global) replication factor the grouping divides."""
        return self._num_replicas

    @property
    def group_size(self) -> int:
        """The number of replicas in each group."""
        return self._group_size

    @property
    def num_groups(self) -> int:
        """The number of groups, ``R // group_size``."""
        return self._num_replicas // self._group_size

    @property
    def assignment(self) -> list[int]:
        """``assignment[r]`` is the group of replica r (a new list of length R)."""
        return list(self._assignment)

    @property
    def is_const(self) -> bool:
        """True if the grouping is described by a stride and a group size."""
        return self._stride is not None

    @property
    def const_rg(self) -> ReplicaGrouping:
        """``self`` if constant, else the constant grouping that refines it (Note [const_rg])."""
        if self.is_const:
            return self
        return self._refinement()[0]

    @property
    def to_device_map(self) -> list[int] | None:
        """For a non-constant grouping, ``[j] ->`` the user group owning const group j."""
        return None if self.is_const else list(self._refinement()[1])

    @property
    def to_host_map(self) -> list[int] | None:
        """For a non-constant grouping, ``[u] ->`` the first const group of user group u."""
        return None if self.is_const else list(self._refinement()[2])

    def transpose(self) -> ReplicaGrouping:
        """The grouping whose group k holds the k-th member of every group of ``self``."""
        if self.is_const and self._stride == 1:
            return ReplicaGrouping._from_params(self.ir, self._group_size, self.num_groups)
        if self._stride is not None and self._stride * self._group_size == self._num_replicas:
            return ReplicaGrouping._from_params(self.ir, 1, self.num_groups)
        transposed = [0] * self._num_replicas
        for group in self._members_table:
            for k, r in enumerate(group):
                transposed[r] = k
        return ReplicaGrouping._from_assignments(self.ir, transposed)

    def __repr__(self) -> str:
        if self.is_const:
            return (
                f"ReplicaGrouping(num_replicas={self._num_replicas}, stride={self._stride}, "
                f"group_size={self._group_size}, num_groups={self.num_groups})"
            )
        return f"ReplicaGrouping(assignment={list(self._assignment)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReplicaGrouping):
            raise TypeError(
                f"A ReplicaGrouping can only be compared with another ReplicaGrouping, not "
                f"with {type(other).__name__} ({other!r})."
            )
        return self.ir is other.ir and self._assignment == other._assignment

    # ------------------------------------------------------------------------------------
    # Runtime helpers
    # ------------------------------------------------------------------------------------

    def _group_of(self, r: int) -> int:
        """The group of replica ``r``."""
        return self._assignment[self._check_replica(r)]

    def _index_in_group(self, r: int) -> int:
        """The position of replica ``r`` among its group's members (ascending order)."""
        return self._index_table[self._check_replica(r)]

    def _members(self, g: int) -> list[int]:
        """The replicas of group ``g``, ascending."""
        return list(self._members_table[self._check_group(g)])

    def _replica(self, g: int, i: int) -> int:
        """The ``i``-th replica (ascending) of group ``g``."""
        members = self._members_table[self._check_group(g)]
        if not 0 <= i < len(members):
            raise IndexError(f"Index {i} is out of range for a group of {len(members)} replicas.")
        return members[i]

    def _require_const(self, usage: str) -> None:
        """Raise the error PopXL gives when a non-constant grouping reaches C++ (collectives)."""
        if not self.is_const:
            raise NotImplementedError(
                f"{usage} needs a constant-stride replica grouping, but got {self!r}. Use a "
                f"grouping from ir.replica_grouping(stride, group_size)."
            )

    def _check_replica(self, r: int) -> int:
        if not 0 <= r < self._num_replicas:
            raise IndexError(f"Replica {r} is out of range for {self._num_replicas} replicas.")
        return r

    def _check_group(self, g: int) -> int:
        if not 0 <= g < self.num_groups:
            raise IndexError(f"Group {g} is out of range for {self.num_groups} groups.")
        return g

    # Note [const_rg]
    # A non-constant grouping is stored on device as its constant refinement: the coarsest
    # grouping found by (1) taking the smallest step d between consecutive members of any
    # group, (2) cutting every group wherever the step exceeds d, (3) using the gcd G' of the
    # run lengths as group size, giving `replica_grouping(d if G' > 1 else 1, G')`. This is
    # PopXL's algorithm; every const group then lies inside one user group, which the maps
    # below rely on.
    def _refinement(self) -> tuple[ReplicaGrouping, tuple[int, ...], tuple[int, ...]]:
        """``(const_rg, to_device_map, to_host_map)`` for a non-constant grouping (cached)."""
        cache = self._refinement_cache
        if cache is None:
            cache = self._compute_refinement()
            object.__setattr__(self, "_refinement_cache", cache)
        return cache

    def _compute_refinement(self) -> tuple[ReplicaGrouping, tuple[int, ...], tuple[int, ...]]:
        steps = [b - a for m in self._members_table for a, b in itertools.pairwise(m)]
        min_step = min(steps)
        run_lengths = []
        for group in self._members_table:
            run = 1
            for a, b in itertools.pairwise(group):
                if b - a > min_step:
                    run_lengths.append(run)
                    run = 0
                run += 1
            run_lengths.append(run)
        new_group_size = math.gcd(*run_lengths)
        const = ReplicaGrouping._from_params(
            self.ir, min_step if new_group_size > 1 else 1, new_group_size
        )
        to_device = tuple(self._assignment[m[0]] for m in const._members_table)
        assert all(
            self._assignment[r] == to_device[j]
            for j, m in enumerate(const._members_table)
            for r in m
        ), f"const_rg {const!r} does not refine {self!r}"
        to_host = tuple(to_device.index(u) for u in range(self.num_groups))
        return const, to_device, to_host


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------


def _num_replicas_of(ir: Any) -> int:
    num_replicas = getattr(ir, "replication_factor", None)
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise TypeError(
            f"Expected an Ir with an int replication_factor >= 1, but got {ir!r} with "
            f"replication_factor={num_replicas!r}."
        )
    return num_replicas


def _as_int(arg_name: str, value: Any) -> int:
    # bool is an int subclass, but `stride=True` is surely a mistake.
    if isinstance(value, bool):
        raise TypeError(f"{arg_name} must be an int, but got the bool {value!r}.")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{arg_name} must be an int, but got {value!r} of type {type(value).__name__}."
        ) from None


def _as_int_list(assignment: Iterable[int]) -> list[int]:
    if isinstance(assignment, (str, bytes)) or not isinstance(assignment, Iterable):
        raise TypeError(
            f"assignment must be a sequence of group ids (ints), one per replica, but got "
            f"{assignment!r} of type {type(assignment).__name__}."
        )
    return [_as_int("Each assignment entry", g) for g in assignment]


def _members_by_group_id(assignment: list[int]) -> dict[int, list[int]]:
    """Group id -> ascending replicas, with ids in order of first appearance."""
    members: dict[int, list[int]] = {}
    for r, g in enumerate(assignment):
        members.setdefault(g, []).append(r)
    return members


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
