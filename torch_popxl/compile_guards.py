"""Guarded specialisation: a compiled step for model code that reads tensor values in Python.

``GuardedReads`` answers the reads of one forward capture on the real micro-batches and keeps
a ``Guard`` per read; ``Guards.failed`` checks them on a later step's micro-batches (Note
[guarded specialisation]).
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .dtypes import dtype as popxl_dtype
from .dtypes import numpy_to_torch
from .errors import DataDependentError
from .ir.graph import Graph, Op
from .ir.tensor import Constant, Tensor
from .runtime.executor import evaluate_ops

__all__ = ["Guard", "GuardedReads", "Guards", "ValuesDiffer", "first_holding", "micro_batches"]

# Note [guarded specialisation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Model code reads tensor values in Python: asserts on its inputs (XLM's `assert
# lengths.max().item() <= slen`), torch's own argument checks (`F.gaussian_nll_loss` raises
# if `torch.any(var < 0)`), branches (Longformer's `is_global_attn = ...any().item()`, I-BERT's
# `if self.x_min.min() > -1.1e-5`). A program has no Python in it, so popxl.compile does what
# torch.compile does with guards: it specialises. While the forward of a new signature is
# captured, each such read (Note [values read on real data] in capture.py) is evaluated on the
# batch's real micro-batches with the current parameters and buffers (the reference executor's
# rules on the forward ops recorded so far, the micro-batches of every replica side by side),
# the Python code goes on with the value, and the program keeps a guard: the read, where the
# forward stood when it was made, and the value. Every later step evaluates the guards on its
# own micro-batches, on the host, before anything runs:
# * the same value on every micro-batch: the program runs;
# * another value, the same on every micro-batch: the step uses the program built for that
#   value, or builds it (as torch.compile recompiles). The build runs the Python code with the
#   new value, so an assert that no longer holds raises eager's AssertionError, before
#   anything changed;
# * values that differ between micro-batches (or replicas): eager torch reads the value once,
#   on the global batch, which no program that runs every micro-batch alike can follow. The
#   model and the loss then run eagerly on the global batch (on copies of the parameters and
#   buffers): what eager raises (the failed assert) is raised, else a DataDependentError names
#   the read and two of its values. Nothing changed.
# A program without guards pays nothing (no check; the fast path as before). One with guards
# never takes the fast path and evaluates, per step, the forward up to its last read (a few ops
# for an assert on the inputs, the whole forward for a check in the loss). Random ops before
# a read draw on the host's own generator (torch's is left as it was): the values they give
# are not the program's draws. With several processes (torchrun) reads stay refused: the
# processes could choose different programs.


@dataclass(frozen=True)
class Guard:
    """One read of a tensor value in a captured forward, and the value it was built with."""

    func: Any  # the data-dependent aten op (``_local_scalar_dense``, ``is_nonzero``, ``equal``)
    args: tuple  # (args, kwargs) with the forward graph's handles for tensors
    end: int  # how many forward ops were recorded when it was read
    value: Any
    where: str  # the line of Python that read it
    random: bool = False  # computed from random numbers the forward draws

    def describe(self) -> str:
        name = getattr(self.func, "_opname", None) or str(self.func)
        return f"`{self.where}` (aten.{name})"


class ValuesDiffer(DataDependentError):
    """A read's value differs between the micro-batches of one step (Note [guarded
    specialisation])."""

    def __init__(self, guard: Guard, values: list, replicas: int):
        self.guard = guard
        i = next(k for k, v in enumerate(values) if not _same(v, values[0]))
        super().__init__(
            f"popxl.compile: {guard.describe()} reads a tensor's value in Python, and the "
            f"compiled step checks it on every micro-batch (Note [guarded specialisation]). In "
            f"this batch it is {values[0]!r} on {_micro(0, replicas)} and {values[i]!r} on "
            f"{_micro(i, replicas)}: eager torch reads it once, on the global batch, which a "
            "program that runs every micro-batch alike cannot follow. Nothing was changed. "
            + (_RANDOM if guard.random else _WAY_OUT)
        )


_WAY_OUT = (
    "Give batches on which the value is the same in every micro-batch, or compute it on the "
    "host and pass it in as a Python value in the dict of inputs (a keyword option selects a "
    "program per value)."
)
_RANDOM = (
    "The value is computed from random numbers the forward draws (a LayerDrop-style "
    "decision): a program repeats the decision it was built with, where eager draws anew. "
    "Draw it on the host and pass it in as a Python value in the dict of inputs (a keyword "
    "option selects a program per value), or turn it off (layerdrop=0)."
)


def _micro(i: int, replicas: int) -> str:
    """The micro-batch ``i`` of the rows' order, as the step runs it."""
    return f"micro-batch {i // replicas} of replica {i % replicas}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


_CPU = torch.device("cpu")


def _bind(inputs, values: list[list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    return {t.id: v for t, v in zip(inputs, values, strict=True)}


def _read(guard_func, args, env: dict, n: int) -> list:
    """``guard_func`` on each of the ``n`` micro-batches' values of its tensors in ``env``
    (the data-dependent ops take their tensors as arguments themselves)."""
    a, kw = args

    def values(x) -> list:
        if not isinstance(x, Tensor):
            return [x] * n
        if x.id not in env and isinstance(x, Constant):  # (first used by the read)
            env[x.id] = [x._data] * n
        return env[x.id]

    per_arg = [values(x) for x in a]
    per_kwarg = {k: values(x) for k, x in kw.items()}
    return [guard_func(*[v[k] for v in per_arg], **{name: v[k] for name, v in per_kwarg.items()})
            for k in range(n)]  # fmt: skip


class GuardedReads:
    """The reader of one forward capture (``capture.values_read_by``): answers each read with
    its value on the ``n`` real micro-batches ``values()`` gives (per tensor of ``inputs``, one
    value per micro-batch; the tensors the ops of ``graph`` from the ``start``-th on read) and
    keeps its guard; raises ``ValuesDiffer`` where the micro-batches disagree. ``values`` is
    called at the first read only: a forward that reads nothing costs no copies."""

    def __init__(self, graph: Graph, inputs: tuple[Tensor, ...],
                 values: Callable[[], list[list[torch.Tensor]]], replicas: int, start: int = 0,
                 *, n: int):  # fmt: skip
        self.graph = graph
        self.inputs = inputs
        self.start = start
        self.n = n
        self.replicas = replicas
        self._values = values
        self._env: dict[str, list[torch.Tensor]] | None = None
        self.done = start  # the ops evaluated so far
        self.guards: list[Guard] = []
        self.random: set[str] = set()  # the tensors computed from random draws

    @property
    def env(self) -> dict[str, list[torch.Tensor]]:
        if self._env is None:
            self._env = _bind(self.inputs, self._values())
        return self._env

    def kept(self, sources: tuple) -> Guards | None:
        """The guards of the reads so far, or None where there were none; ``sources`` says
        where each input's values come from (for the builder)."""
        if not self.guards:
            return None
        # the ops as recorded: autodiff may later insert ops into the graph (clones of values
        # it saves before they are written in place)
        ops = tuple(self.graph._ops[: self.guards[-1].end])
        return Guards(ops, self.inputs, self.start, sources, tuple(self.guards))

    def __call__(self, func, args, kwargs) -> Any:
        end = len(self.graph._ops)
        ops = self.graph._ops[self.done : end]
        with torch.random.fork_rng(devices=[]):
            evaluate_ops(ops, self.env, self.n, _CPU)
        self.done = end
        for op in ops:
            target = getattr(op.attrs, "target", None)
            seeded = torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())
            if seeded or any(t.id in self.random for t in op.inputs):
                self.random.update(t.id for t in op.outputs)
        values = _read(func, (args, kwargs), self.env, self.n)
        drawn = any(isinstance(x, Tensor) and x.id in self.random
                    for x in pytree.tree_leaves((args, kwargs)))  # fmt: skip
        guard = Guard(func, (args, kwargs), end, values[0], _user_line(), drawn)
        if any(not _same(v, values[0]) for v in values):
            raise ValuesDiffer(guard, values, self.replicas)
        self.guards.append(guard)
        return values[0]


@dataclass(frozen=True)
class Guards:
    """A program's guards and what its forward graph's inputs are (Note [guarded
    specialisation])."""

    ops: tuple[Op, ...]  # the graph's ops up to the last read, as captured
    inputs: tuple[Tensor, ...]  # what the ops from ``start`` on read first
    start: int
    sources: tuple  # per input, where its values come from (the builder's business)
    guards: tuple[Guard, ...]

    def failed(self, values: list[list[torch.Tensor]], replicas: int) -> Guard | None:
        """The first guard whose value on these micro-batches is not the one the program was
        built with (the same on all of them), or None; ``ValuesDiffer`` where they differ."""
        n = len(values[0]) if values else 1
        env, done = _bind(self.inputs, values), self.start
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for guard in self.guards:
                evaluate_ops(self.ops[done : guard.end], env, n, _CPU)
                done = guard.end
                got = _read(guard.func, guard.args, env, n)
                if any(not _same(v, got[0]) for v in got):
                    raise ValuesDiffer(guard, got, replicas)
                if not _same(got[0], guard.value):
                    return guard
        return None


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)


def micro_batches(array: Any, dtype: popxl_dtype, parts: int) -> list[torch.Tensor]:
    """A host batch array as ``parts`` equal micro-batches in row order (one copy, which a
    forward may write)."""
    whole = numpy_to_torch(array, dtype)
    return list(whole.split(whole.shape[0] // parts))


def first_holding(candidates: list[Any], guards_of: Callable[[Any], Guards],
                  values: list[list[torch.Tensor]], replicas: int) -> Any | None:  # fmt: skip
    """The first of ``candidates`` (programs built for one signature) whose guards hold on
    ``values``, or None where none does."""
    for cand in candidates:
        if guards_of(cand).failed(values, replicas) is None:
            return cand
    return None


def _user_line() -> str:
    """The innermost line of Python outside torch_popxl and torch's dispatch machinery (a
    model's assert, ``torch.nn.functional``'s own check)."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if path.startswith(_OWN_DIR + os.sep):
            continue
        if path.startswith(_TORCH_DIR + os.sep):
            inner = os.path.relpath(path, _TORCH_DIR)
            if inner.startswith(("_", "utils", "overrides", "autograd")):
                continue
        return f"{path}:{frame.lineno}: {(frame.line or '').strip()}"
    return "<unknown>"
