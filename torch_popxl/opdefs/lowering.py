"""What a runtime op's definition may ask of the fast compiler (runtime/lower.py), and nothing
more: the two small interfaces its ``lower_analyse`` and ``lower_emit`` rules are handed.

Note [lowering rules]
~~~~~~~~~~~~~~~~~~~~~
The fast compiler lowers a runtime op (remote and host transfers, print) by asking its
definition, never by testing which op it has: ``lower_analyse(op, f, a)`` says how the op's
values are batched over replicas (Note [replica-invariant values] in runtime/lower.py) and
``lower_emit(op, f, e)`` writes its line of generated code. ``f`` is the op's flat op (only
its value names ``f.ins`` and ``f.outs`` are read, and it is handed back to the compiler as
is); ``a`` and ``e`` are the compiler's state behind the interfaces below. Whole-program
rewrites (remote slot views, replica-invariant remote buffers, folded loops) stay in the
compiler: a rule only reads their decisions (``e.is_view(f)``, ``a.uniform(buffer_id)``).
A change to what one runtime op does when compiled is then an edit of its definition.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["LowerAnalysis", "LowerEmission"]


class LowerAnalysis(Protocol):
    """One analysis pass of the fast compiler, as a ``lower_analyse`` rule sees it. The rule
    returns what the calls below return: None (accepted) or the narrowed assumptions the
    analysis restarts with (an opaque value to hand back)."""

    rows: bool  # loaded values have one row per replica (Note [one replica, stacked])

    def b(self, name: str) -> bool:
        """Whether value ``name`` differs between replicas."""
        ...

    def set(self, name: str, batched: bool) -> None:
        """Define value ``name``, batched or replica-invariant."""
        ...

    def write(self, target: str, batched: bool) -> Any:
        """Value ``target`` is written in place with a batched or replica-invariant value."""
        ...

    def uniform(self, buffer_id: int) -> bool:
        """Whether the remote buffer is assumed replica-invariant (Note [replica-invariant
        remote buffers] in runtime/lower.py)."""
        ...

    def not_uniform(self, buffer_id: int) -> Any:
        """The assumptions without that buffer among the replica-invariant ones."""
        ...

    def whole_values(self, names: list[str]) -> Any:
        """The op reads these values' per-replica contents as a whole (a host store): a
        replica-sum variable among them loses its sum form (Note [replica-sum
        accumulators])."""
        ...

    def constant_offset(self, f: Any) -> int | None:
        """The op's remote offset when it is a constant (the same slot on every replica)."""
        ...


class LowerEmission(Protocol):
    """The fast compiler's code generator, as a ``lower_emit`` rule sees it."""

    explicit: bool  # Note [explicit batching]: stacked ``[R, ...]`` values, no vmap
    fold: int  # Note [fold the accumulation loop]: iterations folded into the leading dim
    rows: int  # rows of a stacked value: fold * R

    def line(self, code: str) -> None:
        """Append one line of generated code (the compiler indents it)."""
        ...

    def global_name(self, value: Any) -> str:
        """The generated code's name for a Python object (kept alive by the program)."""
        ...

    def b(self, name: str) -> bool:
        """Whether value ``name`` differs between replicas."""
        ...

    def written(self, name: str) -> bool:
        """Whether the storage of value ``name`` is updated in place somewhere."""
        ...

    def uniform(self, buffer_id: int) -> bool:
        """Whether the remote buffer's slots hold one value for all replicas (row 0)."""
        ...

    def is_view(self, f: Any) -> bool:
        """Whether the remote load runs as a view of its slot (Note [remote slot views])."""
        ...

    def stored_slot_view(self, f: Any) -> int | None:
        """The slot, when the remote store ``f`` writes back the very value a remote load of
        this explicitly batched fragment made as a view of that slot of that buffer (Note
        [remote slot views]); None otherwise."""
        ...

    def slot_view(self, buffer_id: int, slot: int | None) -> str:
        """The code of a view of one slot of a remote buffer (recorded for the counters)."""
        ...

    def stacked_call(self, f: Any) -> bool:
        """Emit the op through its ``explicit`` rule when the fragment is explicitly batched;
        False (nothing emitted) otherwise."""
        ...

    def constant_offset(self, f: Any) -> int | None:
        """The op's remote offset when it is a constant (the same slot on every replica)."""
        ...
