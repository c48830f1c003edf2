"""The global graph-context stack and the context managers that shape op creation.

There is one stack for the process (as in PopXL). ``with graph:`` pushes a graph;
``gcg()`` / ``gmg()`` / ``gir()`` read the top.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .graph import Graph
    from .ir import Ir

__all__ = [
    "gcg",
    "gmg",
    "gir",
    "get_current_graph",
    "get_main_graph",
    "in_sequence",
    "name_scope",
    "ipu",
    "io_tiles",
    "get_current_context",
    "_execution_context",
]

_graph_stack: list[Graph] = []
_name_scopes: list[str] = []
_ipu_stack: list[int] = []
_tile_set_stack: list[str] = []
_in_sequence_stack: list[Any] = []
# Note [in_sequence constraints]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Upstream (popxl/context.py, `_add_in_sequence_topocons`) adds a topological constraint to each
# op created while an `in_sequence` mode is set, keyed by (graph, execution context):
#  * an op created under True runs after every op of the previous unit of its key;
#  * the ops created under False form one unit, after the unit before them, unordered inside;
#  * leaving the outermost `in_sequence`, or entering `in_sequence('pass')` (which upstream
#    stores as "no scope"), forgets every key, so the next ordered op starts afresh;
#  * ops created under 'pass' get no constraint.
# The mode is global, so a subgraph built inside `in_sequence(True)` (by `ir.create_graph`) is
# sequenced too, under its own key: its ops neither join nor break the caller's sequence, and
# the caller's `call` op is the caller's next unit.
# The resulting order is recorded on each op as `Op.sequence = (chain, unit)`: op a runs before
# op b when both have the same chain and a's unit is smaller. The simulator runs ops in creation
# order anyway; the in-place ambiguity check (ir/inplace.py) reads these constraints.
_sequence_state: dict[tuple[int, str], list[Any]] = {}  # key -> [chain, unit, in a False unit]
_chains = itertools.count()


def _push_graph(graph: Graph) -> None:
    if _graph_stack and _graph_stack[-1].ir is not graph.ir:
        raise RuntimeError(
            f"Cannot enter {graph.id!r} of {graph.ir!r} inside a graph of "
            f"{_graph_stack[-1].ir!r}: graph contexts of two different Irs cannot be nested."
        )
    _graph_stack.append(graph)


def _pop_graph() -> None:
    _graph_stack.pop()


def gcg() -> Graph:
    """The current graph (top of the context stack)."""
    if not _graph_stack:
        raise RuntimeError(
            "No graph context is active. Create ops inside `with ir.main_graph:` "
            "or `with some_graph:`."
        )
    return _graph_stack[-1]


def gmg() -> Graph:
    """The main graph of the current Ir."""
    return gcg().ir.main_graph


def gir() -> Ir:
    """The Ir of the current graph."""
    return gcg().ir


get_current_graph = gcg
get_main_graph = gmg


def current_name_scope() -> str:
    return "".join(s + "/" for s in _name_scopes)


def current_ipu() -> int | None:
    return _ipu_stack[-1] if _ipu_stack else None


def current_tile_set() -> str:
    return _tile_set_stack[-1] if _tile_set_stack else "compute"


def in_sequence_active() -> bool:
    return bool(_in_sequence_stack) and _in_sequence_stack[-1] is True


def in_sequence_mode() -> bool | str | None:
    """The innermost ``in_sequence`` mode, or None outside every ``in_sequence``."""
    return _in_sequence_stack[-1] if _in_sequence_stack else None


@contextlib.contextmanager
def in_sequence(mode: bool | str = True) -> Iterator[None]:
    """Run the ops created inside in creation order (``True``), as one unordered unit of an
    enclosing sequence (``False``), or add no constraint (``'pass'``).

    The simulator always executes ops in creation order, which is exactly the
    ``in_sequence(True)`` schedule; the constraints are recorded for the in-place ambiguity
    check (Note [in_sequence constraints]).
    """
    if mode is None:
        raise TypeError(
            "`None` cannot be passed to `in_sequence`. Try `False` instead. (The modes are True, "
            "False and 'pass'.)"
        )
    if not isinstance(mode, bool) and mode != "pass":
        raise ValueError(
            f"`in_sequence` mode not understood: {mode!r}. Must be one of `True`, `False`, "
            "`'pass'`."
        )
    _in_sequence_stack.append(mode)
    if mode == "pass":  # upstream stores 'pass' as "no scope", which forgets every key
        _sequence_state.clear()
    try:
        yield
    finally:
        _in_sequence_stack.pop()
        if not _in_sequence_stack or _in_sequence_stack[-1] == "pass":
            _sequence_state.clear()


def _next_sequence(graph: Graph, context: str) -> tuple[int, int] | None:
    """The ``(chain, unit)`` of an op created now in ``graph`` (Note [in_sequence
    constraints]); None outside ``in_sequence`` and under ``in_sequence('pass')``."""
    if not _in_sequence_stack or not isinstance(_in_sequence_stack[-1], bool):
        return None
    ordered = _in_sequence_stack[-1]
    key = (id(graph), context)
    state = _sequence_state.get(key)
    if state is None:
        state = _sequence_state[key] = [next(_chains), 0, not ordered]
    elif ordered or not state[2]:
        state[1] += 1
        state[2] = not ordered
    return (state[0], state[1])


@contextlib.contextmanager
def name_scope(name: str) -> Iterator[None]:
    """Prefix the names of tensors created inside with ``name + "/"``."""
    _name_scopes.append(name)
    try:
        yield
    finally:
        _name_scopes.pop()


@contextlib.contextmanager
def ipu(ipu: int) -> Iterator[None]:
    """Place ops on a virtual IPU. Recorded on tensors; the simulator has one device."""
    if not isinstance(ipu, int) or ipu < 0:
        raise ValueError(f"ipu(n) expects a non-negative int; got {ipu!r}.")
    _ipu_stack.append(ipu)
    try:
        yield
    finally:
        _ipu_stack.pop()


@contextlib.contextmanager
def io_tiles() -> Iterator[None]:
    """Place ops on IO tiles. Recorded on tensors (``tile_set == 'io'``)."""
    _tile_set_stack.append("io")
    try:
        yield
    finally:
        _tile_set_stack.pop()


class Context:
    """Upstream's ``popxl.context.Context``, read-only: where the next op is created. A live
    view (each property reads the context stacks when asked), as upstream's one context object
    is; Graphcore's applications ask it for ``.graph`` (``get_current_context().graph.ir``)."""

    @property
    def graph(self) -> Graph:
        return gcg()

    @property
    def main_graph(self) -> Graph:
        return gmg()

    @property
    def ipu_id(self) -> int:
        ipu = current_ipu()
        return 0 if ipu is None else ipu  # upstream's default virtual graph is 0

    @property
    def io_tile_set(self) -> bool:
        return current_tile_set() == "io"

    @property
    def name_scopes(self) -> list[str]:
        return list(_name_scopes)

    @property
    def in_sequence(self) -> Any:
        """The innermost ``in_sequence`` mode: True, False, or None (none, or 'pass')."""
        mode = _in_sequence_stack[-1] if _in_sequence_stack else None
        return None if mode == "pass" else mode

    def __repr__(self) -> str:
        return f"Context(name_scopes={self.name_scopes}, ipu_id={self.ipu_id})"


_CONTEXT = Context()


def get_current_context() -> Context:
    """The context the next op is created in (upstream's ``Context``)."""
    return _CONTEXT


# Upstream's ExecutionContext members (popxl.ExecutionContext or their names) -> the program
# fragment an op is recorded into.
_FRAGMENTS = {
    "Normal": "normal",
    "WeightsFromHostFragment": "weights_from_host",
    "WeightsToHostFragment": "weights_to_host",
}


@contextlib.contextmanager
def _execution_context(execution_context) -> Iterator[Any]:
    """Record the ops created inside into the program fragment ``execution_context`` names:
    ``WeightsFromHostFragment`` ops run after every ``weights_from_host``, ``WeightsToHostFragment``
    ops before every ``weights_to_host``, ``Normal`` ops on every ``run``."""
    name = getattr(execution_context, "name", execution_context)
    if name not in _FRAGMENTS:
        raise ValueError(
            f"Execution context {execution_context!r} is not supported by the simulator; use one "
            f"of {sorted(_FRAGMENTS)} (popxl.ExecutionContext members)."
        )
    graph = gcg()
    previous = graph._op_context
    graph._op_context = _FRAGMENTS[name]
    try:
        yield execution_context
    finally:
        graph._op_context = previous
