"""``DotTree``: an ordered tree addressed by dotted keys (spec addons §2).

Internal nodes are trees of the same class, leaves are anything else. Every node keeps its
children in one insertion-ordered dict, ``_map``. A key segment is a non-negative integer
(stored as its decimal string) or a Python identifier, so ``t[1] == t["1"] == getattr(t, "1")``.

Note [shared sub-trees]
    ``insert`` stores a sub-tree *object*, not a copy. ``addons.Module`` relies on it: a child
    module's factory tree is inserted into its parent's tree once, in ``__init__``, and
    whatever the child registers later shows up in the parent as ``child.<name>``. Operations
    that must not break that link (nested ``insert``, ``_clear``) mutate nodes in place.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from ..errors import given
from .utils import OrderedDict

__all__ = ["DotTree"]

L = TypeVar("L")
T = TypeVar("T", bound="DotTree")

_NEGATIVE = re.compile(r"-[0-9]+")


# ---- keys ---------------------------------------------------------------------------------


def _segment(key: Any) -> str:
    """Validate one key segment and return its stored (string) form."""
    if isinstance(key, bool):
        raise TypeError(f"DotTree keys must be str or int; got the bool {key!r}.")
    if isinstance(key, int) or type(key).__name__.startswith(("int", "uint")):
        key = int(key)
        if key < 0:
            raise ValueError(
                f"Invalid DotTree key {key}: integer keys must be non-negative (negative "
                "integers only index existing numeric keys in get/[])."
            )
        return str(key)
    if isinstance(key, str):
        if key.isascii() and key.isdecimal():
            return str(int(key))
        if key.isidentifier():
            return key
        raise ValueError(
            f"Invalid DotTree key segment {key!r}: each segment must be a non-negative integer "
            "or a Python identifier (letters, digits, '_'; not starting with a digit)."
        )
    raise TypeError(f"DotTree keys must be str or int; got {given(key)}.")


def _split(key: Any) -> list[str]:
    if isinstance(key, str):
        return [_segment(s) for s in key.split(".")]
    return [_segment(key)]


def _lookup_segments(key: Any) -> list[str | int]:
    """Like ``_split`` but keeps negative integers (``get`` indexes numeric keys from the end)."""
    if isinstance(key, int) and not isinstance(key, bool) and key < 0:
        return [key]
    if isinstance(key, str):
        return [int(s) if _NEGATIVE.fullmatch(s) else _segment(s) for s in key.split(".")]
    return [_segment(key)]


# ---- the tree -----------------------------------------------------------------------------


class DotTree(Generic[L]):
    """An ordered tree of leaves addressed by dotted keys (``"fc1.weight"``)."""

    def __init__(self, **kwargs: Any):
        self._map: dict[str, Any] = {}
        for k, v in kwargs.items():
            self.insert(k, v)

    @classmethod
    def _empty(cls: type[T]) -> T:
        tree = cls.__new__(cls)
        tree._map = {}
        return tree

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls: type[T], d: Mapping[Any, Any]) -> T:
        """Build a tree from a flat ``{"a.b.c": leaf}`` dict (int keys allowed)."""
        tree = cls._empty()
        for key, value in d.items():
            segs = _split(key)
            node: DotTree[Any] = tree
            for i, s in enumerate(segs[:-1]):
                child = node._map.get(s)
                if child is None:
                    child = cls._empty()
                    node._map[s] = child
                elif not isinstance(child, DotTree):
                    where = ".".join(segs[: i + 1])
                    raise ValueError(
                        f"from_dict: {key!r} needs {where!r} to be a sub-tree, but it is a leaf."
                    )
                node = child
            if segs[-1] in node._map:
                raise ValueError(f"from_dict: duplicate key {key!r}.")
            node._map[segs[-1]] = value
        return tree

    @classmethod
    def pack(cls: type[T], keys: Iterable[Any], values: Iterable[L]) -> T:
        """``from_dict(dict(zip(keys, values)))``; the inverse of ``unpack``."""
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            raise ValueError(
                f"{cls.__name__}.pack: got {len(keys)} keys but {len(values)} values; they are "
                "paired one to one."
            )
        return cls.from_dict(dict(zip(keys, values, strict=True)))

    # ---- insertion and removal ------------------------------------------------------------

    def insert(self, key: Any, value: Any, overwrite: bool = False) -> None:
        """Insert ``value`` at ``key`` (dotted keys create intermediate nodes).

        Without ``overwrite`` any existing segment raises ``ValueError``. With it, sub-trees
        are merged and leaves replaced. Nested inserts are tried on a copy first, so a failure
        leaves the tree unchanged (and sub-tree objects keep their identity on success).
        """
        segs = _split(key)
        if len(segs) > 1:
            self.copy()._insert(segs, value, overwrite)  # dry run: raises before any change
        self._insert(segs, value, overwrite)

    def _insert(self, segs: list[str], value: Any, overwrite: bool) -> None:
        head = segs[0]
        if len(segs) == 1:
            self._insert_leaf(head, value, overwrite)
            return
        child = self._map.get(head)
        if child is None:
            child = type(self)._empty()
            child._insert(segs[1:], value, overwrite)
            self._map[head] = child
            return
        if not overwrite:
            raise ValueError(f"'{head}' already exists")
        if not isinstance(child, DotTree):
            raise ValueError(
                f"'{head}' already exists as a leaf; cannot insert {'.'.join(segs)!r} below it."
            )
        child._insert(segs[1:], value, overwrite)

    def _insert_leaf(self, key: str, value: Any, overwrite: bool) -> None:
        if key in self._map:
            if not overwrite:
                raise ValueError(f"'{key}' already exists")
            existing = self._map[key]
            if isinstance(existing, DotTree) and isinstance(value, DotTree):
                existing.update(value, overwrite=True)
                return
        self._map[key] = value

    def update(self, other: DotTree | Mapping[Any, Any], overwrite: bool = False) -> None:
        """Insert every top-level entry of (a copy of) ``other``."""
        if isinstance(other, DotTree):
            items = other.copy()._map.items()
        else:
            items = type(self).from_dict(other)._map.items()
        for k, v in list(items):
            self.insert(k, v, overwrite)

    def pop(self, key: Any) -> Any:
        """Remove and return the leaf or sub-tree at ``key`` (dotted keys allowed)."""
        segs = _lookup_segments(key)
        node = self._node_at(segs[:-1], key) if len(segs) > 1 else self
        last = node._resolve(segs[-1], key)
        return node._map.pop(last)

    def _clear(self) -> None:
        """Remove every leaf, keeping (now empty) sub-tree nodes and their identity."""
        for k in list(self._map):
            v = self._map[k]
            if isinstance(v, DotTree):
                v._clear()
            else:
                del self._map[k]

    # ---- lookup ---------------------------------------------------------------------------

    def _resolve(self, seg: str | int, key: Any) -> str:
        if isinstance(seg, int):  # negative: count from (max numeric key + 1)
            numeric = [int(k) for k in self._map if k.isdecimal()]
            idx = (max(numeric) + 1 + seg) if numeric else -1
            if idx < 0 or str(idx) not in self._map:
                raise KeyError(key)
            return str(idx)
        if seg not in self._map:
            raise KeyError(key)
        return seg

    def _node_at(self, segs: list[str | int], key: Any) -> DotTree:
        node: Any = self
        for s in segs:
            if not isinstance(node, DotTree):
                raise KeyError(key)
            node = node._map[node._resolve(s, key)]
        if not isinstance(node, DotTree):
            raise KeyError(key)
        return node

    def get(self, key: Any) -> Any:
        """The leaf or sub-tree at ``key``; ``KeyError`` if absent."""
        segs = _lookup_segments(key)
        node = self._node_at(segs[:-1], key) if len(segs) > 1 else self
        return node._map[node._resolve(segs[-1], key)]

    def __getitem__(self, key: Any) -> Any:
        return self.get(key)

    def __contains__(self, key: Any) -> bool:
        try:
            self.get(key)
        except (KeyError, ValueError, TypeError):
            return False
        return True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self.get(name)
        except (KeyError, ValueError):
            keys = list(self.__dict__.get("_map", {}))
            raise AttributeError(
                f"{type(self).__name__} has no key or attribute {name!r}. Keys: {keys}"
            ) from None

    # ---- views ----------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._map.keys())

    def values(self) -> list[Any]:
        return list(self._map.values())

    def items(self) -> list[tuple[str, Any]]:
        return list(self._map.items())

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._map))

    def __len__(self) -> int:
        return len(self._map)

    def len(self) -> int:
        """The number of top-level keys (upstream's method; ``len_flat`` counts the leaves)."""
        return len(self._map)

    def __bool__(self) -> bool:  # a tree is an object, even when empty
        return True

    def _flat(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for k, v in self._map.items():
            if isinstance(v, DotTree):
                yield from v._flat(f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    def to_dict(self) -> OrderedDict:
        """Flat ``{"a.b.c": leaf}``, depth first in insertion order."""
        return OrderedDict(self._flat())

    def keys_flat(self) -> list[str]:
        return [k for k, _ in self._flat()]

    def values_flat(self) -> list[L]:
        return [v for _, v in self._flat()]

    def len_flat(self) -> int:
        return sum(1 for _ in self._flat())

    def unpack(self) -> tuple[tuple[str, ...], tuple[L, ...]] | tuple[list, list]:
        """``(keys, values)`` of the flattened tree, sorted by key string."""
        items = sorted(self._flat(), key=lambda kv: kv[0])
        if not items:
            return [], []
        keys, values = zip(*items, strict=True)
        return tuple(keys), tuple(values)

    # ---- transformation -------------------------------------------------------------------

    def copy(self: T) -> T:
        """New tree structure (sub-trees copied recursively) holding the same leaf objects."""
        new = type(self)._empty()
        for k, v in self._map.items():
            new._map[k] = v.copy() if isinstance(v, DotTree) else v
        return new

    def map(self: T, fn: Callable[[Any], Any]) -> T:
        """A tree of the same class with ``fn`` applied to every leaf."""
        new = type(self)._empty()
        for k, v in self._map.items():
            new._map[k] = v.map(fn) if isinstance(v, DotTree) else fn(v)
        return new

    def filter_keys(self: T, keys: Iterable[Any]) -> T:
        """A new tree holding only ``keys`` (dotted keys and sub-tree prefixes allowed)."""
        new = type(self)._empty()
        for key in keys:
            value = self.get(key)
            new.insert(key, value.copy() if isinstance(value, DotTree) else value)
        return new

    def to_mapping(self, other: DotTree) -> dict[Any, Any]:
        """``{self leaf: other leaf}`` for every flat key present in both trees."""
        theirs = other.to_dict()
        return {v: theirs[k] for k, v in self._flat() if k in theirs}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()!r})"
