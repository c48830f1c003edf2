"""``popxl.compile``: a ``torch.nn.Module`` to a replicated, sharded, off-chip PopXL program.

The program is written with the public low-level API only, the way an IPU programmer would
write it by hand:

* every parameter and buffer is a ``popxl.variable``; every parameter has a gradient
  accumulator;
* the forward is the module run on the graph's inputs (``torch.func.functional_call`` under
  capture) followed by ``loss_fn``; ``popxl.transforms.autodiff`` builds the backward from
  ``torch.autograd``;
* a ``repeat`` over ``gradient_accumulation`` micro-batches loads each micro-batch from the
  host, runs forward and backward and accumulates the gradients;
* each micro-batch's loss is its part of the global batch's loss (Note [exact losses over
  micro-batches] in compile_loss.py), so the gradients are then summed over the replicas
  (all-reduce, or reduce-scatter when the optimizer state is sharded) and the optimizer
  update runs with exactly the torch
  optimizer's formulas (SGD, Adam and AdamW written by hand; every other optimizer, a user's
  subclass included, runs its own ``step()`` under capture: Note [captured optimizer steps]
  in compile_optim.py). Sharded state (RTS, ZeRO-1 style) updates one shard of every large
  parameter per replica and all-gathers the result; off-chip state lives in remote buffers and
  is loaded and stored around the update. An Adam/AdamW built with ``fused=True`` updates
  each param group's parameters (or their shards) with one fused kernel call, as eager torch
  does (Note [fused optimizer updates]).

The torch objects stay the source of truth: the hyperparameters are read from
``optimizer.param_groups`` at each step (Note [hyperparameters at run time]), the module's
own tensors and ``optimizer.state`` hold the program's values (Note [live torch tensors]) and
``model.training`` selects the program.

Modules: this one holds the trainer and ``compile``; ``compile_updates`` the step's arithmetic
(optimizer formulas, loss scaling, clipping), ``compile_loss`` the loss split,
``compile_optim`` captured optimizers, ``compile_infer`` the inference program and
``compile_common`` the helpers both programs use.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.modules.module as _nn_module
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes

from . import compile_optim as _optim
from . import ops
from . import remote as _remote
from .capture import call_torch, values_read_by
from .compile_common import (
    _MAX_PROGRAMS,
    _attributes_restored,
    _check_positive,
    _check_tensors,
    _describe,
    _h2d,
    _host,
    _mark_eager_step,
    _micro_batches,
    _pad_rows,
    _sizes_that_split,
    _split_advice,
    _structured,
    _structured_targets,
    _without_caches,
    as_host_dtype,
    cumulative_batch_norms,
    host_float,
    loss_dtype,
    model_loss,
    options_key,
)
from .compile_guards import GuardedReads, Guards, ValuesDiffer, first_holding, micro_batches
from .compile_infer import InferenceProgram
from .compile_loss import (
    MAX_COUNTS,
    LossDecompositionError,
    LossSplitter,
    check_decomposition,
    host_counts,
    parts_differ,
    term_mismatch,
)
from .compile_masked import MaskedRows
from .compile_renorm import EmbeddingRenorm, renormed
from .compile_rows import OnRealRows, check_rows_independent, padded_split
from .compile_updates import (
    _N_HYPER,
    _adam_one_pass,
    _any_positive,
    _clip_coefficient,
    _count_factor,
    _factors,
    _fused_adam_group,
    _fused_reason,
    _group_scalars,
    _group_specs,
    _group_values,
    _GroupSpec,
    _inverse_scale,
    _loss_scaling,
    _nonfinite_count,
    _norm,
    _one_pass_reason,
    _optimizer_kind,
    _optimizer_update,
    _rescale,
    _scale,
    _seed,
    _sgd_one_pass,
    _sharded_norm,
    _step_increment,
    _sum_of_squares,
    _total_norm,
    _unpad,
    _update_scale,
    scalar_dtype,
)
from .dtypes import dtype as _dtype
from .dtypes import float32 as _float32
from .dtypes import numpy_to_torch, torch_to_numpy
from .ir.context import in_sequence
from .ir.graph import Graph
from .ir.ir import Ir
from .ir.remote_buffer import remote_buffer
from .ir.streams import d2h_stream
from .ir.tensor import Tensor, constant, graph_input, graph_output, variable
from .ir.walk import mutated_inputs
from .opdefs._api import float64_collectives
from .runtime import distributed as _distributed
from .runtime.session import Session, check_backend, resolve_device
from .transforms.autodiff import autodiff

__all__ = ["compile", "Trainer", "InferenceProgram"]

_STATE = ("on_chip", "remote")

# Note [a program per input signature]
#     A program has static shapes, eager torch has none. So a Trainer or InferenceProgram
#     keeps one program per (train/eval mode, input shapes and dtypes), built when that
#     signature is first seen (a DataLoader's short last batch, an evaluation batch) and kept
#     for the next time; beyond ``max_programs`` the least recently used one is dropped and
#     rebuilt if seen again. ``programs`` lists them. Switching between training programs
#     hands the optimizer state over through torch's ``optimizer.state`` (as a change of
#     structure does), so every program trains the same state. A training batch runs as
#     equal micro-batches (the loss parts add up to the global batch's loss: Note [exact
#     losses over micro-batches]; Note [a short last batch]); one that cannot split over the
#     replicas is padded (Note [padded rows] in compile_rows.py). An eval-mode inference
#     batch that does not split over the replicas is padded with copies of its last row,
#     whose outputs are dropped (its rows are independent).

# Note [a short last batch]
#     A DataLoader without ``drop_last`` ends an epoch with a short batch, 80 of CIFAR's
#     50,000 samples at batch size 128, which rarely splits into R x GA micro-batches (32).
#     Gradient accumulation is the trainer's own loop, not part of the math: the same
#     optimizer step comes from any number of equal micro-batches (the loss parts are
#     weighted for the count they run as). So a batch of ``n`` samples runs as ``GA'``
#     micro-batches per replica, ``GA' = GA`` where ``R x GA`` divides ``n``, else the
#     largest ``GA' < GA`` that divides each replica's share ``n / R`` (80 samples on 4
#     replicas with GA 8: 5 micro-batches of 4 each). Its program is built for that batch's
#     shapes (as any new shape is) with ``GA'`` repeats. The replicas' shares must be equal
#     (each replica runs the same program): ``n`` not a multiple of R is padded with rows
#     the loss does not read (Note [padded rows] in compile_rows.py). As for any batch,
#     BatchNorm normalises per micro-batch (Note [per-replica batch statistics]) and updates
#     its running statistics ``GA'`` times.


# ---- the forward and the loss (Note [exact losses over micro-batches]) ---------------------


# Note [the loss reads the model's parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A loss_fn may read the model, not only its output: an L2 penalty written into the loss
# (``ce(out, y) + wd * sum(p.pow(2).sum() for p in model.parameters())``), a second forward
# for a consistency term. Run as ``functional_call(model, ...)`` followed by ``loss_fn``,
# those reads would see the module's own tensors: the values at build time, captured as
# constants, with no gradient (each step then trained without the penalty's gradient, and
# the loss value went stale from the second step). So the module holds the program's
# parameter and buffer tensors for the forward and the loss both, as torch.func's
# functional_call does for the forward alone (the same reparametrisation, tied weights
# kept tied).


def _on_program_tensors(model: torch.nn.Module, tensors: dict):
    """A context in which ``model``'s parameters and buffers are the program's ``tensors``
    (Note [the loss reads the model's parameters])."""
    return _reparametrize_module(model, tensors, tie_weights=True, strict=False)


def _forward_and_loss(model, tensors, args, kwargs, targets, inv_counts, real=None, *, loss_fn,
                      chunks: int, dtype: torch.dtype, over_rows: bool = False):  # fmt: skip
    """The module on one micro-batch and the part of the loss it contributes: (objective,
    count or None, count bound, number of host counts, model outputs, the rows of max-norm
    embeddings it looked up, the recipe of the host counts where the forward computes one:
    Note [counts computed in the forward]). ``over_rows``: a division of sums by a multiple of the
    micro-batch's rows is a mean (Note [a sum divided by the batch's size]). ``real``: the
    real rows of a padded batch (Note [padded rows])."""
    if real is not None:
        loss_fn, targets = OnRealRows(loss_fn), (targets, real)
    renorm = EmbeddingRenorm(tensors)  # Note [embedding rows renormalised]
    if chunks == 1:  # the micro-batch is the global batch: the loss as written
        with MaskedRows(), _on_program_tensors(model, tensors):  # Note [rows selected by a mask]
            with renorm:
                out = model(*args, **kwargs)
            loss = loss_fn(out, targets)
        return _scalar_loss(loss), None, 1, 0, out, renorm.marked, None
    splitter, split, out = _split_loss(model, tensors, args, kwargs, targets, real,
                                       loss_fn=loss_fn, chunks=chunks, over_rows=over_rows,
                                       renorm=renorm)  # fmt: skip
    obj, count = split.objective(chunks, inv_counts, dtype)
    counted = split.counted
    if split.deferred:
        return obj, count, counted[0].bound, 0, out, renorm.marked, None
    recipe = None  # Note [counts computed in the forward]
    if splitter.recording and any(t.forward for t in counted):
        recipe = splitter.count_recipe(counted, chunks)
    return obj, count, 1, len(counted), out, renorm.marked, recipe


def _split_loss(model, tensors, args, kwargs, targets, real, *, loss_fn, chunks: int,
                over_rows: bool, renorm=None, eager: bool = False):  # fmt: skip
    """The module and the loss (``targets``: with ``real`` where ``loss_fn`` reads the real
    rows) under the loss splitter: (splitter, split, model outputs). ``eager``: on torch
    tensors, every selection by a mask kept whole as the capture keeps it."""
    # The model too: a forward may reduce the batch itself (a model that returns its loss).
    rows = None
    if over_rows:  # every input and target is split on dim 0
        rows = next(t.shape[0] for t in pytree.tree_leaves((args, kwargs, targets))
                    if isinstance(t, torch.Tensor) and t.ndim > 0)  # fmt: skip
    # (the leaves ``_loss_leaves`` gives on the host)
    splitter = LossSplitter((args, kwargs, targets), rows, real, recipes=True)
    # Note [rows selected by a mask]; Note [the loss reads the model's parameters]
    with (
        splitter,
        MaskedRows(splitter.untracked, always=eager),
        _on_program_tensors(model, tensors),
    ):
        with renorm if renorm is not None else contextlib.nullcontext():
            splitter.in_forward = True
            out = model(*args, **kwargs)
            splitter.in_forward = False
        loss = loss_fn(out, targets)
    return splitter, splitter.split(_scalar_loss(loss), chunks), out


def _loss_inputs(batch: _Batch, values: list) -> tuple:
    """(args, kwargs, targets, real rows or None) of ``values`` laid out as ``batch.arrays``
    (the stream handles, or one micro-batch's arrays)."""
    n_in = len(batch.args) + len(batch.kwargs)
    args, kwargs = pytree.tree_unflatten(values[:n_in], batch.spec)
    kwargs = {**kwargs, **dict(batch.options)}  # Note [keyword options]
    targets = values[n_in : n_in + len(batch.targets)]
    t = pytree.tree_unflatten(targets, batch.targets_spec) if targets else None
    real = values[-1] if batch.real is not None else None  # Note [padded rows]
    return args, kwargs, t, real


def _micro_arrays(batch: _Batch, chunks: int) -> list[list[np.ndarray]]:
    """The arrays of each of this instance's ``chunks`` micro-batches (any order: what is
    read from them is summed)."""
    micro = batch.size // chunks
    return [[a[i * micro : (i + 1) * micro] for a in batch.arrays] for i in range(chunks)]


def _recipe_counts(recipe, batch: _Batch, parts: list[list[np.ndarray]]) -> list:
    """Each counted term's count over the micro-batches ``parts``: ``recipe`` replayed on
    each, summed (Note [counts computed in the forward])."""
    return [sum(c) for c in zip(*(recipe(_loss_leaves(batch, p)) for p in parts), strict=True)]


def _loss_leaves(batch: _Batch, values: list) -> list:
    """The leaves the loss splitter follows (``_forward_and_loss``'s), of ``values``."""
    args, kwargs, t, real = _loss_inputs(batch, values)
    return pytree.tree_leaves((args, kwargs, t if real is None else (t, real)))


def _check_forward_split(model, loss_fn, batch: _Batch, chunks: int, recipe, *, dtype,
                         over_rows: bool) -> None:  # fmt: skip
    """The loss of the first batch, computed eagerly on the host in eval mode (no dropout),
    whole and as the step adds up its ``chunks`` parts with ``recipe``'s counts, term by term:
    a loss whose forward pairs the samples of a micro-batch (a contrastive loss, a product of
    two means over the batch) has parts that do not add up (Note [counts computed in the
    forward]); one that divides a sum by the micro-batch's rows taken as a number (``(p **
    2).sum() / p.shape[0]``) adds up read as a mean over rows (``_LossOverRows``: Note [a sum divided by the
    batch's size])."""
    tensors = {n: t.detach().clone() for n, t in
               (*model.named_parameters(), *model.named_buffers())}  # fmt: skip

    def torch_values(values):
        return [torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
                for a in values]  # fmt: skip

    parts = _micro_arrays(batch, chunks)
    counts = _recipe_counts(recipe, batch, parts)
    inv = torch.ones(MAX_COUNTS, dtype=dtype)
    inv[: len(counts)] = torch.tensor([1.0 / c if c else math.inf for c in counts])

    def splits(over_rows: bool):
        """The whole batch's split (as one micro-batch) and its parts'."""
        out = []
        for values in (batch.arrays, *parts):
            args, kwargs, t, real = _loss_inputs(batch, torch_values(values))
            lf, t = (loss_fn, t) if real is None else (OnRealRows(loss_fn), (t, real))
            n = 1 if values is batch.arrays else chunks
            out.append(_split_loss(model, tensors, args, kwargs, t, real, loss_fn=lf, chunks=n,
                                   over_rows=over_rows, eager=True)[1])  # fmt: skip
        return out[0], out[1:], inv, chunks

    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), _attributes_restored(model):
            model.eval()
            mismatch = term_mismatch(*splits(over_rows))
            if mismatch is not None and not over_rows and term_mismatch(*splits(True)) is None:
                raise _LossOverRows  # Note [a sum divided by the batch's size]
    except (LossDecompositionError, _LossOverRows):
        raise
    except Exception:  # (it does not run eagerly on the host arrays: the structural split only)
        return
    if mismatch is not None:
        raise parts_differ(mismatch, chunks)


def _loss_of(loss_fn, batch: _Batch):
    """``loss_fn`` and the batch's targets as the step's loss reads them: on a padded batch's
    real rows (Note [padded rows]); None for targets ``_torch_targets`` cannot give."""
    targets = _torch_targets(batch)
    if batch.real is None or (targets is None and batch.targets):
        return loss_fn, targets
    return OnRealRows(loss_fn), (targets, torch.from_numpy(batch.real))


def _torch_targets(batch: _Batch):
    """The batch's targets as torch tensors, as ``loss_fn`` gets them; None for bf16 bit
    patterns and the like."""
    if not batch.targets or any(
        a.dtype.kind not in "iub" and a.dtype not in (np.float32, np.float64) for a in batch.targets
    ):
        return None
    ts = [torch.from_numpy(np.ascontiguousarray(a)) for a in batch.targets]
    ts = [t.long() if t.dtype == torch.int32 else t for t in ts]
    return pytree.tree_unflatten(ts, batch.targets_spec)


def _check_split(loss_fn, metas, batch: _Batch, chunks: int, n_host: int, over_rows: bool
                 ) -> bool:  # fmt: skip
    """``check_decomposition`` on the captured outputs' shapes and this batch's targets, and
    host counts where the step needs them (so a loss they cannot count fails at build); True
    when the loss must be captured again reading divisions by the rows as means."""
    loss_fn, targets = _loss_of(loss_fn, batch)
    if targets is None:
        if n_host and not batch.targets:  # a model's own loss: its counts cannot be counted
            host_counts(loss_fn, metas, None, chunks, n_host)  # (raises, saying why)
        return False
    if check_decomposition(loss_fn, metas, targets, chunks, over_rows):
        return True
    if n_host:
        host_counts(loss_fn, metas, targets, chunks, n_host)
    return False


def _scalar_loss(loss):
    if not isinstance(loss, torch.Tensor) or loss.shape != ():
        raise ValueError(
            f"popxl.compile: loss_fn must return a scalar tensor; got "
            f"{getattr(loss, 'shape', type(loss).__name__)}."
        )
    return loss


# ---- the trainer --------------------------------------------------------------------------


@dataclass
class _Slot:
    """One parameter: its variable, accumulator and optimizer state placement."""

    name: str
    group: int
    var: Any
    accum: Any
    spec: _GroupSpec
    sharded: bool
    state: dict[str, Any]  # name -> Variable handle (host side)
    shards: dict[str, Any]  # name -> on-device shard tensor (replica_sharded_variable)
    buffers: dict[str, Any]  # name -> RemoteBuffer (remote state)


# Note [the batch is dim 0]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# The step cuts every input and target into R x GA micro-batches on dim 0 and joins the
# outputs' micro-batches on dim 0, so with replicas or accumulation all of them must be
# batch-first with the same number of samples (a time-major model is refused, with the
# batch-first wrapper as the way out: docs/compile.md). One replica without accumulation cuts
# nothing: any layout runs as written (a time-major LSTM's (seq, batch) tokens with its
# (layers, batch, hidden) state), the streams hold the whole arrays and the outputs come
# back as they are.
@dataclass
class _Batch:
    """One step's host data: positional and keyword inputs, targets (a tensor or a tuple, list
    or dict of them)."""

    args: list[np.ndarray]
    kwargs: dict[str, np.ndarray]
    targets: list[np.ndarray]
    targets_spec: Any  # rebuilds the targets from their leaves; None without targets
    spec: Any = None  # rebuilds (args, kwargs) from their leaves (Note [nested inputs])
    options: tuple[tuple[str, Any], ...] = ()  # Note [keyword options]
    ga: int = 1  # micro-batches per replica (Note [a short last batch])
    real: np.ndarray | None = None  # the real rows of a padded batch (Note [padded rows])

    @property
    def arrays(self) -> list[np.ndarray]:
        return [*self.args, *self.kwargs.values(), *self.targets, *self.real_rows]

    @property
    def real_rows(self) -> list[np.ndarray]:
        return [] if self.real is None else [self.real]

    @property
    def n_real(self) -> int:
        return self.size if self.real is None else int(self.real.sum())

    def padded(self, n: int) -> None:
        """Rows up to ``n`` as copies of the last, and the mask of the real ones."""
        self.real = np.arange(n) < self.size
        self.args = [_pad_rows(a, n) for a in self.args]
        self.kwargs = {k: _pad_rows(a, n) for k, a in self.kwargs.items()}
        self.targets = [_pad_rows(a, n) for a in self.targets]

    @property
    def size(self) -> int:
        return self.arrays[0].shape[0]

    @property
    def key(self) -> tuple:
        """What the program is built for: the structure, shapes and dtypes."""
        # numpy dtypes themselves (hashed and compared in C; printed as their names)
        return (
            tuple((a.shape, a.dtype) for a in self.args),
            tuple((k, a.shape, a.dtype) for k, a in self.kwargs.items()),
            tuple((a.shape, a.dtype) for a in self.targets),
            self.targets_spec,
            self.spec,
            options_key(self.options),
            self.real is not None,
        )


# Note [the step's fast path]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A training loop feeds batches of one shape. Once a step has checked a batch, built or found
# its program and run, the trainer keeps what that proved (``_FastStep``): the input's and
# target's types, shapes and dtypes, the program and how each array enters its stream. A later
# batch of the same types, shapes and dtypes skips what depends on them alone (the structure,
# equal sample counts, the micro-batch split, the streams' shape and dtype checks, the
# program lookup) and enters the streams as views of the caller's arrays reshaped to
# ``[nht, R, ...]`` (copied where the program writes a stream, Note [inputs are never
# written]). Everything a user can change between steps is still checked every step, with the
# same errors: replaced module tensors, train/eval mode, gradient hooks, the optimizer's param
# groups, replaced storages, optimizer state; any change takes the full path (which may build
# a program). Only a plain array or CPU tensor as input and as target, of a dtype that enters
# its stream unconverted or by a plain cast, takes it (the full path narrows float64, reads
# bf16 bits, walks nested inputs); a loss with host-counted means or ``return_outputs``
# never does, nor a program with guards (checked every step: Note [guarded specialisation]). Why it matters: the step moves ~24 MB, which evicts the interpreter's code and
# data, so each Python line around the generated function costs 5-15 times what it costs hot
# (the seed MLP's trainer and session code: ~70 us in a loop, ~0.7 ms inside its steps before
# this path, ~0.45 ms with it; docs/benchmarks.md, "Peers, latest").
_FAST_NUMPY = frozenset(np.dtype(t) for t in (np.float32, np.float16, np.int64, np.int32,
                                               np.int16, np.int8, np.uint8, np.bool_))  # fmt: skip
_FAST_TORCH = frozenset({torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                         torch.int8, torch.uint8, torch.bool})  # fmt: skip


def _fast_leaf(x) -> tuple | None:
    """(type, shape, dtype) of a step's array that may take the fast path, else None."""
    if type(x) is np.ndarray and x.dtype in _FAST_NUMPY and x.ndim and x.flags.c_contiguous:
        return np.ndarray, x.shape, x.dtype
    if type(x) is torch.Tensor and x.dtype in _FAST_TORCH and x.ndim and x.device.type == "cpu":
        return torch.Tensor, tuple(x.shape), x.dtype
    return None


@dataclass(frozen=True)
class _FastStep:
    """What a checked step proved for batches like it (Note [the step's fast path])."""

    leaves: tuple  # (type, shape, dtype) of the input and, if any, of the target
    key: tuple  # the program's key (Trainer._prepare)
    prog: _Program
    streams: tuple  # per leaf: (position among the h2d streams, [nht, R, ...] shape, dtype, copy)
    device: torch.device

    @staticmethod
    def record(trainer: Trainer, prog: _Program, batch: _Batch, inputs, targets):
        """The fast step for batches like ``batch`` (just run by ``prog``), or None where
        they cannot take it."""
        given = (inputs,) if targets is None else (inputs, targets)
        leaves = tuple(_fast_leaf(x) for x in given)
        session, ir = prog.session, prog.ir
        h2d = list(ir._h2d_streams)
        in_streams = prog.streams[0]
        if (
            None in leaves
            or prog.guards is not None  # checked every step (Note [guarded specialisation])
            or trainer.return_outputs
            or prog.host_counts[0]
            or batch.options
            or len(batch.arrays) != len(given)
            or set(h2d) != set(in_streams)
        ):
            return None
        streams = tuple(
            (h2d.index(st), (ir.num_host_transfers, ir.instance_replication_factor, *st.shape),
             st.dtype.as_torch(), session._input_written(st))
            for st in in_streams
        )  # fmt: skip
        key = (trainer.model.training, batch.key, _parameter_hooks(trainer._params))
        return _FastStep(leaves, key, prog, streams, session._torch_device)

    def take(self, trainer: Trainer, inputs, targets) -> tuple[_Program, list] | None:
        """The program and its stream inputs for a batch like the recorded one, with every
        check of the trainer's state run; None for another batch or a changed trainer."""
        given = (inputs,) if targets is None else (inputs, targets)
        if len(given) != len(self.leaves):
            return None
        for x, (kind, shape, dtype) in zip(given, self.leaves, strict=True):
            if type(x) is not kind or x.shape != shape or x.dtype != dtype:
                return None
            if kind is np.ndarray and not x.flags.c_contiguous:
                return None
            if kind is torch.Tensor and x.device.type != "cpu":
                return None
        trainer._check_module_tensors()
        prog = self.prog
        key = (trainer.model.training, self.key[1], _parameter_hooks(trainer._params))
        if (
            key != self.key
            or trainer._active is not prog
            or trainer._programs.get(key) is not prog
            or trainer._specs() != prog.specs
            or trainer._torch_state_changed()  # (its lags: Note [parameters stepped fewer times])
        ):
            return None
        ins: list = [None] * len(self.streams)
        for x, (i, shape, dtype, private) in zip(given, self.streams, strict=True):
            t = (torch.from_numpy(x) if type(x) is np.ndarray else x.detach()).reshape(shape)
            if private or t.dtype != dtype or t.device != self.device:
                t = t.to(device=self.device, dtype=dtype, copy=private)
            ins[i] = t
        return prog, ins


# Note [requires_grad in captured code]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Torch code reads ``requires_grad``: a tensor hook is registered only on a tensor that needs a
# gradient (torch raises otherwise, so code guards it with ``if t.requires_grad:``), the
# reentrant checkpoint warns where none of its inputs does, attention picks its kernel by it.
# So while the forward is captured the trained parameters' fakes require grad, as the module's
# parameters do in eager torch, and torch's autograd follows them through the captured ops
# (on fake tensors: no values). A hook registered on a captured tensor is kept on its graph
# (``Graph._grad_hooks``); autodiff registers it on the tensor's replayed value, so it sees and
# may replace that tensor's gradient as in eager torch.
@contextlib.contextmanager
def _requiring_grad(handles: list[Tensor]):
    for h in handles:
        h._fake.requires_grad_(True)
    try:
        yield
    finally:
        for h in handles:
            h._fake.requires_grad_(False)


def _grad_hooks_of(graph: Graph) -> dict[str, tuple]:
    """The tensor hooks torch code registered on the graph's captured tensors."""
    hooks = {}
    for fake, t in graph._by_fake.values():
        registered = getattr(fake, "_backward_hooks", None)
        if registered:
            hooks[t.id] = tuple(registered.values())
    return hooks


def _refuse_backward_hooks(model: torch.nn.Module) -> None:
    """Module backward hooks change gradients in eager torch; the compiled step differentiates
    the captured ops and would silently leave them out, so they are refused."""
    hooked = [name or type(model).__name__ for name, m in model.named_modules()
              if m._backward_hooks or m._backward_pre_hooks]  # fmt: skip
    if hooked or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks:
        where = f"modules {hooked}" if hooked else "all modules (a global hook)"
        raise ValueError(
            f"popxl.compile: {where} have backward hooks (register_full_backward_hook / "
            "register_full_backward_pre_hook); the compiled step does not run them. Remove "
            "them, or express the gradient change as a custom torch.autograd.Function in "
            "forward (its backward runs: docs/compile.md)."
        )


# Note [parameter gradient hooks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``p.register_hook(fn)`` on a parameter (a leaf) changes the gradient autograd accumulates
# into ``p.grad``: eager torch calls ``fn`` once per backward with the parameter's whole
# gradient (all its uses summed, tied weights included), before ``clip_grad_norm_`` and the
# optimizer see it. The eager loop on the global batch is one backward, so the program calls
# the hooks, captured like forward code, on the full gradient summed over micro-batches and
# replicas, before clipping (``clip_grad_value_`` is ``p.register_hook(lambda g:
# g.clamp(-c, c))`` this way). The hooks are part of the program's key: one added or removed
# later builds a new program. Refused, because the step could not call them as eager does:
# a sharded gradient (RTS: a replica holds a part of it), loss scaling (eager's hooks see the
# scaled gradient) and ``register_post_accumulate_grad_hook`` (it acts on ``p.grad`` and the
# optimizer, outside the gradient).
def _parameter_hooks(params: dict[str, torch.nn.Parameter]) -> tuple[tuple[str, tuple], ...]:
    """The gradient hooks of the trained parameters: (name, hooks) in registration order."""
    post = [n for n, p in params.items() if getattr(p, "_post_accumulate_grad_hooks", None)]
    if post:
        raise ValueError(
            f"popxl.compile: parameters {post} have register_post_accumulate_grad_hook hooks; "
            "the compiled step does not call them (it updates the parameters itself). Remove "
            "them (an optimizer step in backward is the step popxl.compile runs), or use "
            "p.register_hook(fn), which changes the gradient and runs (Note [parameter "
            "gradient hooks])."
        )
    return tuple(
        (n, tuple(p._backward_hooks.values()))
        for n, p in params.items()
        if p.requires_grad and p._backward_hooks
    )


def _run_parameter_hooks(grad: torch.Tensor, *, hooks: tuple) -> torch.Tensor:
    for hook in hooks:  # as autograd: a hook returning None leaves the gradient as it is
        out = hook(grad)
        grad = grad if out is None else out
    return grad


# Note [parameters without a gradient]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A trained parameter the loss does not depend on (a layer the forward skips, a head used only
# in eval, a weight a custom Function reads by closure) gets no gradient in eager torch: its
# ``.grad`` stays None and torch's optimizers skip it (no update, no weight decay, no state).
# The program finds such parameters when it differentiates the loss (``_NoGradientPath``);
# the trainer then freezes them (Note [frozen parameters]) and builds the program again.
class _NoGradientPath(Exception):
    def __init__(self, names: frozenset[str]):
        super().__init__(sorted(names))
        self.names = names


class _LossOverRows(Exception):
    """The loss adds up over micro-batches only where divisions by the micro-batch's rows
    are means (Note [a sum divided by the batch's size]): capture it again so."""


@dataclass
class _Program:
    """One built training program (per train/eval mode) and how its variables reach torch.

    Note [live torch tensors]
        Where the simulator keeps one copy of a variable for all replicas (Session
        ``_bind_variable``), that copy *is* the torch tensor: the module's parameter, a
        buffer, a tensor in ``optimizer.state``, a hyperparameter vector. Runs update them in
        place and the next run reads whatever the user wrote into them, at no copying cost.
        The others (per-replica buffers such as BatchNorm statistics with several replicas,
        sharded or off-chip optimizer state, a CUDA simulator) are copied: module tensors
        after each step and when changed, optimizer state when ``optimizer.state`` is read
        (``_LiveState``, which holds the trainer weakly so that the optimizer does not keep
        a trainer's programs alive) and when the trainer is finalized (``Trainer.__del__``),
        so a trainer dropped right after its last step leaves that step's state behind.
    """

    ir: Ir
    session: Session
    training: bool
    specs: tuple[_GroupSpec, ...]
    shapes: tuple
    streams: tuple
    slots: list[_Slot]
    buffer_vars: dict[str, Any]
    step_var: Any
    hyper_vars: list[Any]
    hyper_t: list[torch.Tensor]
    step_t: torch.Tensor
    bound: set = field(default_factory=set)  # ids of variables living in torch tensors
    state_t: dict = field(default_factory=dict)  # (param, state name) -> bound torch tensor
    copied: list = field(default_factory=list)  # [variable, module tensor, snapshot]
    hyper_last: tuple | None = None
    fresh: bool = True  # holds the zero optimizer state it was built with
    # per param group: why it runs the per-parameter chain, None where it runs the fused
    # kernel (Note [fused optimizer updates])
    fused_reasons: tuple = ()
    storages: list = field(default_factory=list)  # (name, module tensor, data_ptr) at compile time
    scale_vars: list = field(default_factory=list)  # Note [loss scaling]
    overflow_t: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    # the count of a counted-mean loss over the step (Note [exact losses over micro-batches])
    count_var: Any = None
    count_bound: int = 1
    inv_vars: list = field(default_factory=list)
    frozen_vars: dict = field(default_factory=dict)  # Note [frozen parameters]
    grad_vars: dict = field(default_factory=dict)  # name -> variable (Note [p.grad ...])
    grad_t: dict = field(default_factory=dict)  # name -> the bound torch tensor, where bound
    grads: tuple | None = None  # (parameter, bound tensor or None, variable) per grad_vars entry
    norm_var: Any = None  # the total gradient norm before clipping (max_grad_norm)
    out_streams: list = field(default_factory=list)  # return_outputs=True
    out_spec: Any = None  # (pytree spec, leaves: None where a tensor comes from a stream)
    # (number of host-counted means, captured output metas, their recipe or None: Note
    # [counts computed in the forward])
    host_counts: tuple = (0, None, None)
    lags: tuple = ()  # ((param name, lag), ...): Note [parameters stepped fewer times]
    guards: Guards | None = None  # Note [guarded specialisation]


def _lag_key(lags: dict[str, int]) -> tuple:
    """A program's lags as structure (Note [parameters stepped fewer times])."""
    return tuple(sorted((n, lag) for n, lag in lags.items() if lag))


def _lagged(step: torch.Tensor, *, lag: int) -> torch.Tensor:
    """A parameter's step count, ``lag`` behind the program's (Note [parameters stepped fewer
    times])."""
    return step - lag


class _LiveState(collections.defaultdict):
    """``optimizer.state`` of an optimizer driven by a Trainer: every read first brings it up
    to date with the program (Note [live torch tensors]); copies and pickles are plain."""

    def __init__(self, trainer: Trainer, data=()):
        super().__init__(dict, data)
        self._trainer = weakref.ref(trainer)
        # an entry set or removed by the user (``state.clear()`` to restart the moments,
        # ``state[p] = {...}``): the next step imports the state as torch would use it
        self.edited = False

    def _edit(self) -> None:
        self._sync()
        self.edited = True

    def __setitem__(self, key, value):
        self._edit()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._edit()
        super().__delitem__(key)

    def clear(self):
        self._edit()
        super().clear()

    def pop(self, *args):
        self._edit()
        return super().pop(*args)

    def popitem(self):
        self._edit()
        return super().popitem()

    def setdefault(self, key, default=None):
        self._sync()
        if not super().__contains__(key):
            self.edited = True
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        self._edit()
        super().update(*args, **kwargs)

    def _sync(self) -> None:
        tr = self._trainer()
        if tr is not None and tr._opt_stale:
            tr._publish_optimizer_state()

    def __getitem__(self, key):
        self._sync()
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._sync()
        return super().get(key, default)

    def __contains__(self, key):
        self._sync()
        return super().__contains__(key)

    def __iter__(self):
        self._sync()
        return super().__iter__()

    def __len__(self):
        self._sync()
        return super().__len__()

    def keys(self):
        self._sync()
        return super().keys()

    def values(self):
        self._sync()
        return super().values()

    def items(self):
        self._sync()
        return super().items()

    def copy(self):
        self._sync()
        return collections.defaultdict(dict, dict.items(self))

    def __repr__(self):
        self._sync()
        return repr(collections.defaultdict(dict, dict.items(self)))

    def __reduce__(self):
        return (collections.defaultdict, (dict, dict(self.items())))

    def __deepcopy__(self, memo):
        return copy.deepcopy(self.copy(), memo)


class Trainer:
    """A compiled training program. ``step(inputs, targets)`` runs one optimizer step.

    The torch objects stay the source of truth: the hyperparameters are read from
    ``optimizer.param_groups`` at every step, ``model.training`` selects the program (one
    build per mode), the module's parameters and buffers hold the trained values after each
    step and ``optimizer.state`` holds the optimizer state as torch keeps it.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 replication_factor: int = 1, gradient_accumulation: int = 1,
                 rts_threshold: int | None = None, optimizer_state: str = "on_chip",
                 device: str | torch.device | None = None, executor: str = "fast",
                 max_grad_norm: float | None = None, loss_scaling=None, backend: str = "default",
                 keep_grads: bool = True, return_outputs: bool = False):  # fmt: skip
        _check_positive("replication_factor", replication_factor)
        _check_positive("gradient_accumulation", gradient_accumulation)
        if optimizer_state not in _STATE:
            raise ValueError(
                f"optimizer_state must be 'on_chip' or 'remote'; got {optimizer_state!r}."
            )
        if rts_threshold is not None and (not isinstance(rts_threshold, int) or rts_threshold < 1):
            raise ValueError(
                f"rts_threshold must be a positive int or None; got {rts_threshold!r}."
            )
        if not callable(loss_fn):
            raise TypeError(
                "popxl.compile: loss_fn must be callable as loss_fn(output, target) -> scalar."
            )
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, int | float)
            or not max_grad_norm > 0
        ):
            raise ValueError(
                f"max_grad_norm must be a positive number or None; got {max_grad_norm!r}."
            )
        self.device = resolve_device(device)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.replication_factor = replication_factor
        self.gradient_accumulation = gradient_accumulation
        self.rts_threshold = rts_threshold
        self.optimizer_state = optimizer_state
        self.executor = executor
        self.backend = check_backend(backend, executor)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.keep_grads = bool(keep_grads)
        self.return_outputs = bool(return_outputs)
        self._out_spec: Any = None
        # the loss split of the program being built (Note [exact losses over micro-batches])
        self._loss_bound: int | None = None
        self._loss_host: tuple = (0, None, None)
        self._n_outputs = 0
        self._scaling = _loss_scaling(loss_scaling)
        # The loss scale and GradScaler's growth tracker, shared by the programs of both
        # modes (bound to their variables, or copied: Note [live torch tensors]).
        init = 1.0 if self._scaling is None else self._scaling.init_scale
        self._scale_t = torch.tensor(init, dtype=torch.float32)
        self._tracker_t = torch.zeros((), dtype=torch.float32)
        self._params = dict(model.named_parameters())
        self._buffers = dict(model.named_buffers())
        # the same tensors listed once: every step reads their dtypes (Note [float64 models])
        # without walking the module; a step whose module holds other ones is refused
        # (``_check_module_tensors``) before it changes anything
        self._tensors = (*self._params.values(), *self._buffers.values())
        _optimizer_kind(optimizer)  # a torch optimizer
        # the copy of the optimizer whose step() is captured (Note [captured optimizer steps])
        self._shadow = _optim.shadow(optimizer)
        _group_specs(optimizer, self._params)  # validate now, not at the first step
        # Trained parameters the loss has no gradient path to (Note [parameters without a
        # gradient]): found by the first program that lacks one; from then on frozen.
        self._no_grad_path: frozenset[str] = frozenset()
        # Note [a sum divided by the batch's size]: found by the first program that needs it
        self._loss_over_rows = False
        # (training, input signature) -> program, least recently used first
        self._programs: dict[tuple, _Program] = {}
        # a signature's programs with guards, the most recently built first (Note [guarded
        # specialisation])
        self._variants: dict[tuple, list[_Program]] = {}
        self._guards: Guards | None = None  # those of the program being built
        self.max_programs = _MAX_PROGRAMS
        self._active: _Program | None = None
        self._fast: _FastStep | None = None  # Note [the step's fast path]
        self._stepped: _Program | None = None  # the program of the last step
        self._step_count = 0
        self._lags: dict[str, int] = {}  # Note [parameters stepped fewer times]
        self._opt_stale = False
        self._live: _LiveState | None = None
        # Note [state of parameters the program does not train]: param id -> (param, entry)
        self._kept_state: dict[int, tuple[Any, dict]] = {}
        self._loaded_step: int | None = None  # Trainer.load_state_dict's step, until applied
        # Note [eager optimizer steps]: an eager ``optimizer.step()`` between compiled steps
        # changes optimizer.state (and its step count) behind the program's back; the hook
        # makes the next compiled step import the state as torch left it.
        self._eager_stepped = False
        ref = weakref.ref(self)
        optimizer.register_step_post_hook(lambda *_: _mark_eager_step(ref))

    def __del__(self) -> None:
        # Note [live torch tensors]: the last step's optimizer state outlives the trainer
        # (not at interpreter exit, when the modules it needs may already be gone).
        if getattr(self, "_opt_stale", False) and not sys.is_finalizing():
            # The collector may run this inside a fake or tracing mode (a fragment traced on
            # fake tensors): the state is read as the real tensors it is.
            with _disable_current_modes():
                self._publish_optimizer_state()

    @property
    def programs(self) -> tuple[tuple[bool, str], ...]:
        """The programs built and kept, least recently used first: (training mode, the
        (inputs, targets) shapes it runs); at most ``max_programs`` (Note [a program per
        input signature])."""
        return tuple((training, _describe(key)) for training, key, _hooks in self._programs)

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (``None`` without ``loss_scaling``), as
        ``GradScaler.get_scale()``."""
        return None if self._scaling is None else float(self._scale_t)

    @property
    def last_grad_norm(self) -> float | None:
        """The total gradient norm of the last step before ``max_grad_norm`` clipped it, as
        ``clip_grad_norm_`` returns it (Note [gradient clipping as torch rounds it]); None
        without ``max_grad_norm`` or before the first step."""
        prog = self._stepped
        if prog is None or prog.norm_var is None:
            return None
        if prog.ir._num_instances > 1:
            return float(prog.session.get_tensors_data([prog.norm_var])[prog.norm_var])
        return float(prog.session._device_rows(prog.norm_var)[0])

    # the active program's Ir and session (for inspection, memory reports and tests)
    @property
    def ir(self) -> Ir | None:
        return None if self._active is None else self._active.ir

    @property
    def session(self) -> Session | None:
        return None if self._active is None else self._active.session

    def explain(self) -> list[str]:
        """What of the current program runs on a slow path and why (``Session.explain``); an
        empty list when all of it runs on the fast path."""
        if self.session is None:
            raise ValueError("explain(): no program yet; it is built by the first step().")
        return self.session.explain()

    @property
    def fused_reasons(self) -> tuple[str | None, ...] | None:
        """Per param group of the current program: None where the update runs as one fused
        kernel call (Adam/AdamW with ``fused=True``; SGD: one pass per parameter), else why
        it runs as the per-parameter op chain (Note [fused optimizer updates], Note [one-pass
        SGD update] in opdefs/sgd.py). None before the first step builds a program."""
        return None if self._active is None else self._active.fused_reasons

    # ---- building -------------------------------------------------------------------------

    def _specs(self) -> tuple[_GroupSpec, ...]:
        """The optimizer's param groups as the program trains them."""
        return _group_specs(self.optimizer, self._params, self._no_grad_path)

    def _shard(self, numel: int) -> bool:
        return (
            self.rts_threshold is not None
            and self.replication_factor > 1
            and numel >= self.rts_threshold
        )

    def _torch_state_changed(self) -> bool:
        """Whether ``optimizer.state`` is no longer what the active program published."""
        live = self._live
        return (
            live is None or self.optimizer.state is not live or self._eager_stepped or live.edited
        )

    def _build(
        self, batch: _Batch, specs: tuple[_GroupSpec, ...], lags: dict[str, int]
    ) -> _Program:
        _refuse_backward_hooks(self.model)
        R, GA = self.replication_factor, batch.ga  # Note [a short last batch]
        chunks = _distributed.local_replicas(R) * GA  # Note [the batch is dim 0]
        if batch.real is not None:  # Note [padded rows]
            self._check_rows_independent(batch, chunks)
        spec_of = {n: (i, spec) for i, spec in enumerate(specs) for n in spec.names}
        ir = _distributed.make_ir(R)
        ir.num_host_transfers = GA
        # a float64 model's gradients are reduced as float64 (Note [float64 collectives])
        with ir.main_graph, in_sequence(True), float64_collectives():
            names = [f"inputs/{i}" for i in range(len(batch.args))]
            names += [f"inputs/{k}" for k in batch.kwargs]
            names += [f"targets/{i}" for i in range(len(batch.targets))]
            names += ["rows/real" for _ in batch.real_rows]  # Note [padded rows]
            in_streams = [
                _h2d((a.shape[0] // chunks, *a.shape[1:]), a.dtype, n)
                for n, a in zip(names, batch.arrays, strict=True)
            ]
            loss_stream = None
            out_streams: list = []  # the model's outputs (return_outputs=True)
            hyper_vars = [
                # float64, as torch's Python-float hyperparameters (no downcast: Note
                # [optimizer arithmetic as torch rounds it])
                variable(np.zeros(_N_HYPER, np.float64), downcast=False, name=f"hyper/{i}")
                for i in range(len(specs))
            ]
            # Note [frozen parameters]: only the optimizer's trainable parameters get slots.
            slots = [
                self._make_slot(n, p, *spec_of[n]) for n, p in self._params.items() if n in spec_of
            ]
            frozen_vars = {
                n: variable(_host(p), _dtype.as_dtype(p.dtype), name=n)
                for n, p in self._params.items()
                if n not in spec_of
            }
            buffer_vars = {
                n: variable(_host(b), _dtype.as_dtype(b.dtype), name=n)
                for n, b in self._buffers.items()
            }
            step = variable(np.zeros((), np.float32), name="optimizer_step")
            scaling = self._scaling
            scale_vars = []  # loss scale, growth tracker, overflow flag (Note [loss scaling])
            if scaling is not None:
                scale_vars.append(variable(np.float32(scaling.init_scale), name="loss_scale"))
                if scaling.dynamic:
                    scale_vars.append(variable(np.float32(0), name="loss_scale/growth_tracker"))
                    scale_vars.append(variable(np.float32(0), name="loss_scale/overflow"))

            fwd = self._forward_graph(ir, batch, in_streams, frozen_vars)
            counted = self._loss_bound is not None
            count_var = total_var = None
            book = host_float(self.model)  # the loss's bookkeeping (Note [float64 models])
            if counted:
                # summed in the loop and then over the replicas, as a gradient accumulator
                # (Note [replica-sum accumulators] in runtime/lower.py); the step's total is
                # kept in ``total_var`` for the host
                count_var = variable(np.zeros((), book), downcast=False, name="loss/count")
                count_var._set_hints(replica_sum=True)
                total_var = variable(np.zeros((), book), downcast=False, name="loss/total_count")
            inv_vars = []  # one over each host-counted mean's count (Note [exact losses ...])
            if R * GA > 1:
                inv_vars.append(
                    variable(np.ones(MAX_COUNTS, book), downcast=False, name="loss/inv_counts")
                )
            # the rows of max-norm embeddings looked up, summed over the micro-batches and then
            # over the replicas as a gradient is (Note [embedding rows renormalised])
            seen_vars = []
            for name, _, _ in self._renorms:
                seen = variable(np.zeros(self._params[name].shape[0], np.float32),
                                name=f"renorm/{name}")  # fmt: skip
                seen._set_hints(replica_sum=True)
                seen_vars.append(seen)
            n_params, n_io = len(slots), len(in_streams)
            param_inputs = list(fwd.inputs[n_io : n_io + n_params])
            mutated = mutated_inputs(fwd)
            names = [s.name for s in slots] + list(frozen_vars)  # the inputs after the data
            written = [n for i, n in enumerate(names) if n_io + i in mutated]
            if written:
                raise ValueError(
                    f"popxl.compile: the forward writes the parameters {written} in place "
                    "(nn.EmbeddingBag(max_norm=...) renormalises its rows so); the compiled step "
                    "keeps parameters as the optimizer leaves them (a frozen one as it is) and "
                    "cannot follow such a write. Renormalise outside the step (under "
                    "torch.no_grad(), between steps), or compute the normalised weight out of "
                    "place in forward."
                )
            bwd = autodiff(
                fwd,
                grads_provided=fwd.outputs[:1],
                grads_required=param_inputs,
                _allow_modifying=True,
                _missing_ok=True,
            )
            with_grad = {e.fwd_tensor.id for e in bwd.expected_outputs}
            missing = [s.name for s, t in zip(slots, param_inputs, strict=True)
                       if t.id not in with_grad]  # fmt: skip
            if missing:
                raise _NoGradientPath(frozenset(missing))

            body = ir.create_empty_graph("micro_batch")
            with body:
                accs = [
                    graph_input(s.accum.shape, s.accum.dtype, f"accum/{s.name}", by_ref=True)
                    for s in slots
                ]
                ps = [graph_input(s.var.shape, s.var.dtype, s.name) for s in slots]
                fs = [graph_input(v.shape, v.dtype, n) for n, v in frozen_vars.items()]
                bs = [graph_input(v.shape, v.dtype, n, by_ref=True) for n, v in buffer_vars.items()]
                sc = graph_input((), _float32, "loss_scale") if scale_vars else None
                loaded = [ops.host_load(st, st.tensor_id) for st in in_streams]
                cnt = (
                    graph_input((), count_var.dtype, "loss/count", by_ref=True)
                    if count_var is not None
                    else None
                )
                inv = [graph_input((MAX_COUNTS,), v.dtype, "loss/inv_counts") for v in inv_vars]
                seen_in = [graph_input(v.shape, v.dtype, f"renorm/{n}", by_ref=True)
                           for v, (n, _, _) in zip(seen_vars, self._renorms, strict=True)]  # fmt: skip
                info = ops.call_with_info(fwd, *loaded, *ps, *fs, *bs, *inv)
                loss = info.outputs[0]
                # The loss is this micro-batch's part of the global loss (Note [exact losses
                # over micro-batches]): seeded with 1, the parts' gradients add up.
                if sc is not None:  # GradScaler: scaler.scale(loss).backward()
                    seed = call_torch(_seed, (sc,), {"ga": 1, "dtype": loss.dtype.as_torch()})
                else:
                    seed = constant(np.float32(1.0), loss.dtype, "loss_grad")
                grads = ops.call(bwd.graph, seed, inputs_dict=bwd.inputs_dict(info))
                for acc, g in zip(accs, grads, strict=True):
                    ops.var_updates.accumulate_(acc, g)
                if cnt is not None:
                    ops.var_updates.accumulate_(cnt, info.outputs[1])
                loss_stream = d2h_stream(loss.shape, loss.dtype, "loss")
                ops.host_store(loss_stream, loss)
                first = 1 + int(cnt is not None)
                for i, v in enumerate(info.outputs[first : first + self._n_outputs]):
                    out_streams.append(d2h_stream(v.shape, v.dtype, f"outputs/{i}"))
                    ops.host_store(out_streams[-1], v)
                first += self._n_outputs
                for acc, v in zip(seen_in, info.outputs[first : first + len(seen_in)], strict=True):
                    ops.var_updates.accumulate_(acc, v)
            # Note [zeroed before the loop]
            #     The accumulators are zeroed as the step begins, not after the update reads
            #     them: the same values for every step (nothing else reads them), and the
            #     fast executor then writes each one once, a copy where the loop's add was
            #     (Note [zeroed accumulators written once] in runtime/lower.py).
            for s in slots:
                ops.var_updates.accumulator_zero_(s.accum)
            ops.repeat(body, GA, *[s.accum for s in slots], *[s.var for s in slots],
                       *frozen_vars.values(), *buffer_vars.values(), *scale_vars[:1],
                       *([count_var] if count_var is not None else []), *inv_vars,
                       *seen_vars)  # fmt: skip
            # Note [embedding rows renormalised]: the rows the global batch looked up, once,
            # before the optimizer reads the weight
            var_of = {s.name: s.var for s in slots} | frozen_vars
            for seen, (name, max_norm, p) in zip(seen_vars, self._renorms, strict=True):
                rows: Any = seen
                if R > 1:
                    rows = ops.collectives.replicated_all_reduce(seen, "add")
                weight = var_of[name]
                ops.var_updates.copy_var_update_(
                    weight, call_torch(renormed, (weight, max_norm, p, rows), {})
                )
                ops.var_updates.accumulator_zero_(seen)

            dynamic = scaling is not None and scaling.dynamic
            fused_reasons = [
                _fused_reason(spec, [s for s in slots if s.group == i], dynamic, self.device)
                for i, spec in enumerate(specs)
            ]
            group_one_pass = [
                _one_pass_reason(spec, [s for s in slots if s.group == i], dynamic, self.device)
                is None
                for i, spec in enumerate(specs)
            ]
            one_pass = [group_one_pass[s.group] for s in slots]
            scalar_dtypes = [
                scalar_dtype(s.var.dtype.as_torch() for s in slots if s.group == i)
                for i in range(len(specs))
            ]
            # each parameter's step count (Note [parameters stepped fewer times])
            lag_of = [lags.get(s.name, 0) for s in slots]
            steps = {lag: step if lag == 0 else call_torch(_lagged, (step,), {"lag": lag})
                     for lag in sorted(set(lag_of))}  # fmt: skip
            scalars = {  # per (group, lag); a captured step reads its lr from hyper/i itself
                (i, lag): h
                if spec.kind == "torch"
                else None  # the one-pass kernel reads hyper/i itself
                if spec.kind == "sgd" and reason is None
                else call_torch(
                    _group_scalars, (h, steps[lag]), {"kind": spec.kind, "dtype": dtype}
                )
                for i, (h, spec, reason, dtype) in enumerate(
                    zip(hyper_vars, specs, fused_reasons, scalar_dtypes, strict=True)
                )
                for lag in sorted({lag_of[k] for k, s in enumerate(slots) if s.group == i})
            }
            reduced = [self._reduce(s, R) for s in slots]
            # The gradients' multipliers (how each multiplies, by what), applied as they come
            # except for the one-pass kernels, which apply those after the last one a
            # gradient needed whole (Note [one-pass SGD update] in opdefs/sgd.py, Note [Adam
            # chain in three passes] in csrc/adam.cpp).
            pending: list[tuple[Callable, Tensor]] = []
            applied = [0] * len(slots)

            def settle(k: int) -> None:
                for fn, f in pending[applied[k] :]:
                    reduced[k] = call_torch(fn, (reduced[k], f), {})
                applied[k] = len(pending)

            if count_var is not None and total_var is not None:  # divide once by the count
                total: Any = count_var
                if R > 1:
                    total = ops.collectives.replicated_all_reduce(count_var, "add")
                ops.var_updates.copy_var_update_(total_var, total)
                factor = call_torch(_count_factor, (total,), {"bound": self._loss_bound})
                pending.append((_rescale, factor))
                ops.var_updates.accumulator_zero_(count_var)
            found = None
            if scale_vars:
                pending.append((_rescale, call_torch(_inverse_scale, (scale_vars[0],), {})))
                if dynamic:
                    for k in range(len(slots)):
                        settle(k)
                    found = self._overflow(slots, reduced)
            hooks = dict(_parameter_hooks(self._params))
            for k, s in enumerate(slots):
                if s.name in hooks:  # Note [parameter gradient hooks]
                    self._check_hookable(s)
                    settle(k)
                    reduced[k] = call_torch(_run_parameter_hooks, (reduced[k],),
                                            {"hooks": hooks[s.name]})  # fmt: skip
            norm_var = None
            if self.max_grad_norm is not None:
                for k in range(len(slots)):
                    settle(k)
                coef, total_norm = self._clip(slots, reduced)
                pending.append((_scale, coef))
                norm_var = variable(np.float32(0), name="grad_norm")
                if total_norm.dtype != _float32:
                    total_norm = ops.cast(total_norm, _float32)
                ops.var_updates.copy_var_update_(norm_var, total_norm)
            grad_vars = {}
            for k, s in enumerate(slots):
                if not one_pass[k]:
                    settle(k)
                if self.keep_grads:  # Note [p.grad after a step]
                    zeros = np.zeros_like(_host(self._params[s.name]))
                    grad_vars[s.name] = variable(zeros, s.var.dtype, name=f"grad/{s.name}")
                    if one_pass[k]:
                        continue  # the kernel writes it (a shard of it: Note [p.grad after a step])
                    settle(k)
                    ops.var_updates.copy_var_update_(grad_vars[s.name], self._gather(s, reduced[k]))
            factor_lists: dict[int, Tensor] = {}
            for k in range(len(slots)):
                if one_pass[k] and applied[k] not in factor_lists:
                    factor_lists[applied[k]] = (
                        call_torch(_factors, tuple(f for _, f in pending[applied[k] :]), {})
                        if applied[k] < len(pending)
                        else constant(np.zeros((0,), np.float32), _float32, "no_factors")
                    )
            for i, spec in enumerate(specs):
                members = [k for k, s in enumerate(slots) if s.group == i]
                if group_one_pass[i]:
                    for k in members:
                        s, lag = slots[k], lag_of[k]
                        self._one_pass_update(s, reduced[k], steps[lag], hyper_vars[i],
                                              scalars[i, lag], factor_lists[applied[k]],
                                              grad_vars.get(s.name))  # fmt: skip
                elif fused_reasons[i] is not None or not members:
                    for k in members:
                        lag = lag_of[k]
                        self._update(slots[k], reduced[k], steps[lag], scalars[i, lag], found)
                else:  # one kernel call per step count
                    for lag in sorted({lag_of[k] for k in members}):
                        self._fused_update(
                            [(slots[k], reduced[k]) for k in members if lag_of[k] == lag],
                            spec, steps[lag], hyper_vars[i],
                        )  # fmt: skip
            if found is None:
                ops.var_updates.accumulate_(step, constant(np.float32(1.0)))
            else:  # a skipped step is no step (GradScaler skips optimizer.step())
                ops.var_updates.accumulate_(step, call_torch(_step_increment, (found,), {}))
                assert scaling is not None
                call_torch(_update_scale, (scale_vars[0], scale_vars[1], found),
                           {"growth": scaling.growth_factor, "backoff": scaling.backoff_factor,
                            "interval": scaling.growth_interval})  # fmt: skip
                ops.var_updates.copy_var_update_(scale_vars[2], found)
        session = Session(
            ir, "ipu_hw", device=self.device, executor=self.executor, backend=self.backend
        )
        session.__enter__()
        prog = _Program(
            ir, session, self.model.training, specs, batch.key, (in_streams, loss_stream), slots, buffer_vars, step, hyper_vars,
            [torch.zeros(_N_HYPER, dtype=torch.float64) for _ in specs], torch.zeros(()),
            scale_vars=scale_vars, fused_reasons=tuple(fused_reasons), count_var=total_var,
            count_bound=self._loss_bound or 1, inv_vars=inv_vars, host_counts=self._loss_host,
            out_streams=out_streams, out_spec=self._out_spec,
            frozen_vars=frozen_vars, grad_vars=grad_vars, norm_var=norm_var, lags=_lag_key(lags),
            guards=self._guards,
        )  # fmt: skip
        self._link(prog)
        return prog

    def _link(self, prog: _Program) -> None:
        """Note [live torch tensors]: bind what can be bound, remember what must be copied."""
        session = prog.session
        distributed = prog.ir._num_instances > 1

        def bind(var, tensor) -> bool:
            ok = not distributed and session._bind_variable(var, tensor)
            if ok:
                prog.bound.add(var.id)
            return ok

        for s in prog.slots:
            p = self._params[s.name]
            # A bound tensor is the variable; a copied one is pushed and pulled at every step:
            # either way a replaced storage (model.double()) is refused before a step runs.
            prog.storages.append((s.name, p, p.data_ptr()))
            if not bind(s.var, p.detach()):
                prog.copied.append([s.var, p, None])
            init = self._initial_state(s.name, s.spec)
            for sname, v in s.state.items():
                if sname not in s.shards and sname not in s.buffers:
                    t = init[sname].clone(memory_format=torch.contiguous_format)
                    if bind(v, t):
                        prog.state_t[(s.name, sname)] = t
        for n, v in prog.grad_vars.items():
            t = torch.zeros_like(self._params[n].detach(), memory_format=torch.contiguous_format)
            if bind(v, t):
                prog.grad_t[n] = t
        for n, v in prog.frozen_vars.items():
            p = self._params[n]
            prog.storages.append((n, p, p.data_ptr()))
            if not bind(v, p.detach()):
                prog.copied.append([v, p, None])
        for n, v in prog.buffer_vars.items():
            b = self._buffers[n]
            prog.storages.append((n, b, b.data_ptr()))
            if not bind(v, b.detach()):
                prog.copied.append([v, b, None])
        for v, t in zip(prog.hyper_vars, prog.hyper_t, strict=True):
            bind(v, t)
        bind(prog.step_var, prog.step_t)
        scale_tensors = [self._scale_t, self._tracker_t, prog.overflow_t]
        for v, t in zip(prog.scale_vars, scale_tensors[: len(prog.scale_vars)], strict=True):
            if not bind(v, t):
                prog.copied.append([v, t, None])
        # What the program holds now is what the module holds: nothing to push before step 1.
        for entry in prog.copied:
            entry[2] = entry[1].detach().clone()

    def _make_slot(self, name: str, p: torch.nn.Parameter, group: int, spec: _GroupSpec) -> _Slot:
        data = _host(p)
        dt = _dtype.as_dtype(p.dtype)
        var = variable(data, dt, name=name)
        accum = variable(np.zeros_like(data), dt, name=f"accum/{name}")
        # Only summed over replicas by the update's reduction: the fast executor may keep it
        # as that sum (Note [replica-sum accumulators] in runtime/lower.py).
        accum._set_hints(replica_sum=True)
        # Note [steps on whole parameters] (compile_optim.py): a captured step that mixes a
        # parameter's elements (other than a full reduction) or keeps state of other shapes
        # updates it whole
        whole = spec.kind == "torch" and spec.layout_of(name).whole
        sharded = self._shard(data.size) and not whole
        init = self._initial_state(name, spec)
        state, shards, buffers = {}, {}, {}
        for sname in spec.state_of(name):
            zeros = torch_to_numpy(init[sname], _dtype.as_dtype(init[sname].dtype))
            dt = _dtype.as_dtype(init[sname].dtype)
            vname = f"{sname}/{name}"
            if spec.state_shape(name, sname, p.shape) == ():  # small: on chip, replicated
                state[sname] = variable(zeros, dt, name=vname)
            elif sharded and self.optimizer_state == "remote":
                buf = _remote.replica_sharded_buffer(zeros.shape, dt)
                state[sname] = _remote.remote_replica_sharded_variable(
                    zeros, buf, 0, dt, name=vname
                )
                buffers[sname] = buf
            elif sharded:
                state[sname], shards[sname] = _remote.replica_sharded_variable(
                    zeros, dt, name=vname
                )
            elif self.optimizer_state == "remote":
                buf = remote_buffer(zeros.shape, dt, 1)
                state[sname] = _remote.remote_variable(zeros, buf, 0, dt, name=vname)
                buffers[sname] = buf
            else:
                state[sname] = variable(zeros, dt, name=vname)
        return _Slot(name, group, var, accum, spec, sharded, state, shards, buffers)

    def _forward_graph(self, ir: Ir, batch: _Batch, in_streams, frozen_vars: dict):
        graph = ir.create_empty_graph("forward")
        with graph:
            io = [graph_input(st.shape, st.dtype, st.tensor_id) for st in in_streams]
            io = [as_host_dtype(t, a.dtype) for t, a in zip(io, batch.arrays, strict=True)]
            args, kwargs, t, real = _loss_inputs(batch, io)
            params = {
                n: graph_input(p.shape, _dtype.as_dtype(p.dtype), n)
                for n, p in self._params.items()
                if n not in frozen_vars
            }
            trained = [h for h in params.values() if h.dtype.as_torch().is_floating_point]
            params.update({n: graph_input(v.shape, v.dtype, n) for n, v in frozen_vars.items()})
            bufs = {
                n: graph_input(b.shape, _dtype.as_dtype(b.dtype), n, by_ref=True)
                for n, b in self._buffers.items()
            }
            chunks = self.replication_factor * batch.ga
            dtype = loss_dtype(self.model)  # Note [float64 models]
            inv = (
                graph_input((MAX_COUNTS,), _dtype.as_dtype(dtype), "loss/inv_counts")
                if chunks > 1
                else None
            )
            sources = ([("io", i) for i in range(len(io))] + [("param", n) for n in params]
                       + [("buffer", n) for n in bufs] + ([("inv", dtype)] if inv is not None
                                                          else []))  # fmt: skip
            reads = None
            if _distributed.local_replicas(self.replication_factor) == self.replication_factor:
                # Note [guarded specialisation]
                reads = GuardedReads(
                    graph, tuple(graph._inputs),
                    lambda: self._forward_values(sources, graph._inputs, batch, chunks, clone=True),
                    self.replication_factor, n=chunks,
                )  # fmt: skip
            with (
                _attributes_restored(self.model),
                _requiring_grad(trained),
                cumulative_batch_norms(self.model),  # Note [cumulative batch norm]
                values_read_by(graph, reads) if reads is not None else contextlib.nullcontext(),
            ):
                captured = call_torch(
                    _forward_and_loss,
                    (self.model, {**params, **bufs}, args, kwargs, t, inv, real),
                    {
                        "loss_fn": self.loss_fn,
                        "chunks": chunks,
                        "dtype": dtype,
                        "over_rows": self._loss_over_rows,
                    },
                )
            graph._grad_hooks.update(_grad_hooks_of(graph))
            self._guards = None if reads is None else reads.kept(tuple(sources))
            obj, count, bound, n_host, outputs, marked, recipe = captured
            outputs = _without_caches(outputs)
            graph_output(obj)
            if count is not None:
                graph_output(count)
            n_out = 0
            if self.return_outputs:  # the model's outputs, streamed to the host
                for v in pytree.tree_leaves(outputs):
                    if isinstance(v, Tensor):
                        graph_output(v)
                        n_out += 1
            for _, seen, _, _ in marked:  # Note [embedding rows renormalised]
                graph_output(seen)
        self._n_outputs = n_out  # (autodiff appends the saved activations after them)
        self._renorms = [(name, max_norm, p) for name, _, max_norm, p in marked]
        metas = pytree.tree_map(
            lambda h: torch.empty(h.shape, dtype=h.dtype.as_torch(), device="meta")
            if isinstance(h, Tensor) else h, outputs)  # fmt: skip
        leaves, spec = pytree.tree_flatten(outputs)
        self._out_spec = (spec, [None if isinstance(v, Tensor) else v for v in leaves])
        if chunks > 1:  # this instance's share of the batch (all of it in one process)
            local = _distributed.local_replicas(self.replication_factor) * batch.ga
            # (host counts from a recipe need no loss_fn replay to count them)
            n_loss_fn = n_host if recipe is None else 0
            if _check_split(self.loss_fn, metas, batch, local, n_loss_fn, self._loss_over_rows):
                raise _LossOverRows
            if recipe is not None:
                _check_forward_split(self.model, self.loss_fn, batch, local, recipe,
                                     dtype=dtype, over_rows=self._loss_over_rows)  # fmt: skip
        # Note [exact losses over micro-batches]: with a counted mean alone, the summed
        # gradients are multiplied by bound * chunks / (the count over micro-batches and
        # replicas); counted means among other terms are counted on the host at every step.
        self._loss_bound = None if count is None else bound * chunks
        self._loss_host = (n_host, metas, recipe)
        return graph

    def _check_hookable(self, s: _Slot) -> None:
        """Note [parameter gradient hooks]: refused where the program cannot call a hook on
        the whole, unscaled gradient as eager torch does."""
        why = (
            "its gradient is sharded over the replicas (rts_threshold), so no replica holds "
            "all of it; raise rts_threshold above its size"
            if s.sharded
            else "with loss_scaling eager torch calls it on the scaled gradient; compile "
            "without loss_scaling"
            if self._scaling is not None
            else None
        )
        if why is not None:
            raise ValueError(
                f"popxl.compile: parameter {s.name!r} has a gradient hook (p.register_hook), "
                f"which the step cannot call as eager torch does: {why}, or remove the hook. "
                "Nothing was changed."
            )

    def _reduce(self, s: _Slot, R: int):
        """The gradient sum over replicas (each replica's loss is its part of the global loss:
        Note [exact losses over micro-batches]): a shard of it when the state is sharded."""
        if R == 1 and not s.sharded:
            return s.accum
        # PopXL collectives take no bfloat16: reduce in float32 and round the mean once.
        g = ops.cast(s.accum, _float32) if s.accum.dtype.name == "bfloat16" else s.accum
        if s.sharded:
            g = ops.collectives.replicated_reduce_scatter(
                g, "add", configure_output_for_replicated_tensor_sharding=True)  # fmt: skip
        else:
            g = ops.collectives.replicated_all_reduce(g, "add")
        return ops.cast(g, s.accum.dtype) if g.dtype != s.accum.dtype else g

    def _overflow(self, slots: list[_Slot], grads: list[Tensor]) -> Tensor:
        """1.0 where any gradient holds inf or nan (a shard's count summed over replicas)."""
        counts = []
        for s, g in zip(slots, grads, strict=True):
            c = call_torch(_nonfinite_count, (g,), {})
            if s.sharded:
                c = ops.collectives.replicated_all_reduce(c, "add")
            counts.append(c)
        return call_torch(_any_positive, tuple(counts), {})

    def _clip(self, slots: list[_Slot], grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        """``clip_grad_norm_`` over the full, replica-reduced gradients; returns the clip
        coefficient the gradients are multiplied by (``_scale``) and the total norm before
        clipping (Note [gradient clipping as torch rounds it])."""
        by_dtype: dict[Any, list[Tensor]] = {}  # torch's grouping: first-seen dtype order
        for s, g in zip(slots, grads, strict=True):
            if s.sharded:  # the shards partition the gradient (padding is 0)
                sq = call_torch(_sum_of_squares, (g,), {})
                sq = ops.collectives.replicated_all_reduce(sq, "add")
                norm = call_torch(_sharded_norm, (sq,), {"dtype": g.dtype.as_torch()})
            else:
                norm = call_torch(_norm, (g,), {})
            by_dtype.setdefault(g.dtype, []).append(norm)
        norms = tuple(n for group in by_dtype.values() for n in group)
        total = call_torch(_total_norm, norms, {})
        coef = call_torch(_clip_coefficient, (total,), {"max_norm": self.max_grad_norm})
        return coef, total

    def _update(self, s: _Slot, g, step, scalars, found=None) -> None:
        p = self._update_target(s)
        state = self._load_state(s)
        if s.spec.kind == "torch":  # scalars: hyper/i (Note [captured optimizer steps])
            sharding = None
            if s.sharded:  # Note [whole-parameter reductions on shards]
                rg = s.var.ir._check_grouping(None)  # RTS shards over all replicas
                sharding = _optim.Sharding(int(np.prod(s.var.shape)), rg.group_size, rg.stride)
            _optim.torch_step(p, g, step, scalars, state, opt=self._shadow,
                              layout=s.spec.layout_of(s.name), found=found,
                              sharding=sharding)  # fmt: skip
        else:
            _optimizer_update(p, g, step, scalars, state, s.spec, found)
        self._finish_update(s, p, state)

    def _one_pass_update(self, s: _Slot, g, step, hyper, scalars, factors, grad_out) -> None:
        """One parameter's step by its kernel with the gradient's finishing inside: ``g``
        multiplied by ``factors`` is the gradient, written to ``grad_out`` (``p.grad``) unless
        None (SGD: Note [one-pass SGD update] in opdefs/sgd.py, reading ``hyper``; Adam: Note
        [Adam chain in three passes] in csrc/adam.cpp, reading the group's ``scalars``);
        parameter and state prepared as ``_update`` prepares them. A sharded parameter's kernel
        writes its shard of ``grad_out``, which is then gathered into it as the parameter is
        (Note [p.grad after a step])."""
        p = self._update_target(s)
        state = self._load_state(s)
        grad_shard = grad_out
        if s.sharded and grad_out is not None:
            grad_shard = ops.collectives.replica_sharded_slice(grad_out)
        if s.spec.kind == "sgd":
            buf = state[0] if state else None
            args = (p, buf, grad_shard, g, hyper, step, factors)
            call_torch(_sgd_one_pass, args, {"spec": s.spec})
        else:
            call_torch(
                _adam_one_pass, (p, grad_shard, g, factors, *scalars, *state), {"spec": s.spec}
            )
        self._finish_update(s, p, state)
        if grad_out is not None and grad_shard is not grad_out:
            ops.var_updates.copy_var_update_(
                grad_out, ops.collectives.replicated_all_gather(grad_shard)
            )

    def _fused_update(self, members: list, spec: _GroupSpec, step, hyper) -> None:
        """One fused kernel call for a whole param group (Note [fused optimizer updates]):
        every member's parameter (or shard) and state are prepared as ``_update`` prepares
        them, updated together, then stored and gathered one by one."""
        assert spec.fused is not None
        slots = [s for s, _ in members]
        ps = [self._update_target(s) for s in slots]
        states = [self._load_state(s) for s in slots]
        b1, b2, eps, wd = spec.fused
        call_torch(
            _fused_adam_group,
            (*ps, *[g for _, g in members], *[st[0] for st in states], *[st[1] for st in states],
             step, hyper),
            {"n": len(slots), "kind": spec.kind, "beta1": b1, "beta2": b2, "eps": eps,
             "weight_decay": wd},
        )  # fmt: skip
        for s, p, st in zip(slots, ps, states, strict=True):
            self._finish_update(s, p, st)

    def _update_target(self, s: _Slot) -> Tensor:
        """What the update writes: the parameter, or this replica's shard of it (RTS)."""
        if not s.sharded:
            return s.var
        if s.var.dtype.name == "bfloat16":  # exact: float32 holds every bf16 value
            p32 = ops.collectives.replica_sharded_slice(ops.cast(s.var, _float32))
            return ops.cast(p32, s.var.dtype)
        return ops.collectives.replica_sharded_slice(s.var)

    @staticmethod
    def _gather(s: _Slot, g: Tensor) -> Tensor:
        """The full tensor of a sharded slot's shard ``g`` (``g`` itself when unsharded)."""
        if not s.sharded:
            return g
        bf16 = g.dtype.name == "bfloat16"  # exact: float32 holds every bf16 value
        flat = ops.collectives.replicated_all_gather(
            ops.cast(g, _float32) if bf16 else g, output_shape="concat"
        )
        full = call_torch(_unpad, (flat,), {"shape": tuple(s.var.shape)})
        return ops.cast(full, g.dtype) if bf16 else full

    def _finish_update(self, s: _Slot, p: Tensor, state: list[Tensor]) -> None:
        """Stores off-chip state and all-gathers an updated shard into the parameter."""
        self._store_state(s, state)
        if s.sharded:
            if p.dtype.name == "bfloat16":
                full = self._gather(s, p)
            else:  # the slice knows its parameter's shape
                full = ops.collectives.replicated_all_gather(p)
            ops.var_updates.copy_var_update_(s.var, full)

    def _load_state(self, s: _Slot) -> list[Tensor]:
        out = []
        for name in s.spec.state_of(s.name):
            if name in s.buffers:
                out.append(ops.remote_load(s.buffers[name], 0, f"{name}/{s.name}"))
            elif name in s.shards:
                out.append(s.shards[name])
            else:
                out.append(s.state[name])
        return out

    def _store_state(self, s: _Slot, state: list[Tensor]) -> None:
        for name, t in zip(s.spec.state_of(s.name), state, strict=True):
            if name in s.buffers:
                ops.remote_store(s.buffers[name], 0, t)

    # ---- running --------------------------------------------------------------------------

    def _split(self, a: np.ndarray, GA: int) -> np.ndarray:
        R = _distributed.local_replicas(self.replication_factor)
        micro = a.shape[0] // (R * GA)
        a = a.reshape(GA, R, micro, *a.shape[1:])
        if R == 1:
            a = a[:, 0]
        if GA == 1:
            a = a[0]
        return a

    def _check_batch(self, inputs, targets) -> _Batch:
        floats = host_float(self._tensors)
        args, kwargs, spec, options = _structured(inputs, "inputs", floats)
        # (no targets: a model that returns its loss may take none)
        t, targets_spec = _structured_targets(targets, floats)
        batch = _Batch(args, kwargs, t, targets_spec, spec, options)
        R, GA = _distributed.local_replicas(self.replication_factor), self.gradient_accumulation
        sizes = [a.shape[0] for a in batch.arrays]
        # Note [the batch is dim 0]
        if R * GA > 1 and len(set(sizes)) > 1:
            raise ValueError(
                f"inputs and targets must have the same number of samples (dim 0); got {sizes} "
                f"for {len(args) + len(kwargs)} input(s) and {len(t)} target(s). With "
                f"replication_factor * gradient_accumulation = {R * GA} every input and target "
                "is cut into micro-batches on dim 0: give them batch-first. A time-major "
                "model (nn.LSTM/nn.GRU/nn.Transformer without batch_first, tokens as (seq, "
                "batch), states as (layers, batch, hidden)) runs unchanged inside a wrapper "
                "module that takes batch-first tensors and transposes them (docs/compile.md, "
                "'Structured inputs and time-major models'). Nothing was changed."
            )
        ga = _micro_batches(batch.size, R, GA)  # Note [a short last batch]
        if ga is None:
            if not batch.size or R != self.replication_factor:  # (one instance's share only)
                raise ValueError(_split_advice(batch.size, R, GA))
            n, ga = padded_split(batch.size, R, GA)  # Note [padded rows]
            batch.padded(n)
        batch.ga = ga
        return batch

    def _check_rows_independent(self, batch: _Batch, chunks: int) -> None:
        """Note [padded rows]: refused where the forward mixes the rows of a micro-batch."""
        n_in = len(batch.args) + len(batch.kwargs)
        options = dict(batch.options)

        def rebuild(tensors):
            args, kwargs = pytree.tree_unflatten(list(tensors), batch.spec)
            return tuple(args), {**kwargs, **options}

        def refuse(why: str) -> ValueError:
            R, n = self.replication_factor, batch.n_real
            return ValueError(
                f"popxl.compile: a global batch of {n} samples does not split into equal "
                f"shares for the replication_factor = {R} replicas, so the step pads each "
                "replica's share with rows that add nothing to the loss (Note [padded rows]); "
                f"that is eager's step only where the forward keeps rows independent, but "
                f"{why}. Keep rows independent in training mode (BatchNorm normalises over the "
                f"batch: GroupNorm or LayerNorm do not). {_sizes_that_split(n, R)}"
            )

        micro = batch.size // chunks
        check_rows_independent(self.model, batch.arrays[:n_in], rebuild, micro, batch.n_real,
                               refuse)  # fmt: skip

    def _check_module_tensors(self) -> None:
        """The module must still hold the parameter and buffer objects the program trains: a
        replaced one (``model.fc.weight = nn.Parameter(...)``) would silently stop training
        (the program and the optimizer hold the old one)."""
        params, buffers = dict(self.model.named_parameters()), dict(self.model.named_buffers())
        changed = [n for n in params.keys() | self._params.keys()
                   if params.get(n) is not self._params.get(n)]  # fmt: skip
        changed += [n for n in buffers.keys() | self._buffers.keys()
                    if buffers.get(n) is not self._buffers.get(n)]  # fmt: skip
        if changed:
            raise ValueError(
                f"popxl.compile: {sorted(changed)} of the model were replaced (or added or "
                "removed) after compiling; the program and the optimizer still hold the old "
                "tensors. To change values, write in place: `with torch.no_grad(): "
                "model.fc.weight.copy_(new)`. To train new tensors, build a new optimizer "
                "from model.parameters() and call popxl.compile again."
            )

    def _prepare(self, batch: _Batch) -> _Program:
        """The program for the model's current mode and optimizer structure, built or
        rebuilt as needed, with the torch-side state it must start from."""
        self._check_module_tensors()
        specs = self._specs()
        # Note [a program per input signature]: one program per train/eval mode and input
        # shapes, built when first seen (a DataLoader's short last batch, eval batches) and
        # kept, the least recently used dropped beyond ``max_programs``.
        key = (self.model.training, batch.key, _parameter_hooks(self._params))
        held = self._programs.pop(key, None)
        try:
            return self._program_for(key, held, batch, specs)
        except BaseException as e:
            if held is not None and key not in self._programs:  # nothing changes on error
                self._programs[key] = held
            if isinstance(e, ValuesDiffer):  # Note [guarded specialisation]
                self._raise_as_eager(batch, e)
            raise

    def _program_for(self, key: tuple, prog: _Program | None, batch: _Batch,
                     specs: tuple[_GroupSpec, ...]) -> _Program:  # fmt: skip
        """``_prepare``'s program for ``key`` (``prog``: the one kept for it, if any)."""
        if prog is not None and prog.guards is not None:  # Note [guarded specialisation]
            prog = self._variant_for(key, prog, batch)
        lags = self._lags
        if (prog is None or prog is not self._active or prog.specs != specs
                or self._torch_state_changed()):  # fmt: skip
            # the program will import torch's state: its lags are structure
            lags = self._counts(*self._from_torch_state(self.optimizer.state))[1]
        if prog is not None and (prog.specs != specs or prog.lags != _lag_key(lags)):
            prog = None  # a new param group, nesterov or momentum/weight decay toggled
        while prog is None:
            try:
                prog = self._build(batch, specs, lags)
            except _NoGradientPath as e:
                if e.names <= self._no_grad_path:
                    raise
                self._no_grad_path |= e.names
                specs = self._specs()
            except _LossOverRows:  # Note [a sum divided by the batch's size]
                if self._loss_over_rows:
                    raise
                self._loss_over_rows = True
        if prog.guards is not None and all(v is not prog for v in self._variants.get(key, ())):
            self._variants[key] = [prog, *self._variants.get(key, ())][: max(self.max_programs, 1)]
        self._programs[key] = prog  # the most recently used last
        while len(self._programs) > max(self.max_programs, 1):
            # (a dropped active program still hands its state over below)
            dropped = next(iter(self._programs))
            del self._programs[dropped]
            self._variants.pop(dropped, None)
        if prog is not self._active:
            if self._active is not None and self._live is self.optimizer.state:
                self._live._sync()  # (keeps what the user set or removed since)
                # Hand the state over as a plain torch state: the new program imports it.
                self.optimizer.state = collections.defaultdict(
                    dict,
                    {p: {k: v.clone() for k, v in st.items()} for p, st in dict.items(self._live)},
                )
            self._active = prog
        return prog

    def _variant_for(self, key: tuple, prog: _Program, batch: _Batch) -> _Program | None:
        """The program built for ``key`` whose guards hold on ``batch``, ``prog`` first; None
        where none does (Note [guarded specialisation])."""
        assert prog.guards is not None
        R = self.replication_factor
        chunks = R * batch.ga
        values = self._forward_values(prog.guards.sources, prog.guards.inputs, batch, chunks)
        others = [v for v in self._variants.get(key, ()) if v is not prog]
        return first_holding([prog, *others], lambda p: p.guards, values, R)

    def _forward_values(self, sources, inputs, batch: _Batch, chunks: int, *,
                        clone: bool = False) -> list[list[torch.Tensor]]:  # fmt: skip
        """Each forward input's value on each of ``batch``'s ``chunks`` micro-batches, in the
        rows' order, on the host (Note [guarded specialisation]); buffers, which a forward
        may write, as copies (parameters too with ``clone``)."""
        values: list[list[torch.Tensor]] = []
        for (kind, what), t in zip(sources, inputs, strict=True):
            if kind == "io":
                values.append(micro_batches(batch.arrays[what], t.dtype, chunks))
            elif kind == "inv":  # (the counts' values: a read does not depend on them)
                values.append([torch.ones(MAX_COUNTS, dtype=what)] * chunks)
            else:
                held = (self._params if kind == "param" else self._buffers)[what].detach()
                held = held.to("cpu")
                if kind == "buffer" or clone:
                    values.append([held.clone() for _ in range(chunks)])
                else:
                    values.append([held] * chunks)
        return values

    def _raise_as_eager(self, batch: _Batch, err: ValuesDiffer) -> None:
        """A read whose value differs between micro-batches: the model and the loss run
        eagerly on the global batch, on copies of the module's tensors; what eager raises is
        raised, else ``err`` (Note [guarded specialisation])."""
        tensors = {n: t.detach().clone() for n, t in
                   (*self.model.named_parameters(), *self.model.named_buffers())}  # fmt: skip
        values = [torch.from_numpy(np.ascontiguousarray(a)) for a in batch.arrays]
        args, kwargs, t, real = _loss_inputs(batch, values)
        loss_fn = self.loss_fn if real is None else OnRealRows(self.loss_fn)
        t = t if real is None else (t, real)
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                _attributes_restored(self.model), _on_program_tensors(self.model, tensors):  # fmt: skip
            loss_fn(self.model(*args, **kwargs), t)
        raise err

    def plan(self, inputs, targets=None) -> None:
        """Build the program for this batch shape without running it (the memory report is
        then available, as PopVision is before going to hardware)."""
        self._prepare(self._check_batch(inputs, targets))

    def step(self, inputs, targets=None) -> float | tuple[float, Any]:
        """One optimizer step on a global batch of ``R * GA * micro`` samples; returns the loss.

        Under torchrun every process passes its own share, the ``R/W * GA * micro`` samples of
        its local replicas; the returned loss is the mean over all instances.
        """
        # Note [the step's fast path]
        fast = None if self._fast is None else self._fast.take(self, inputs, targets)
        batch: _Batch | None = None
        if fast:
            prog, ins = fast
        else:
            batch = self._check_batch(inputs, targets)
            prog = self._prepare(batch)
        for name, t, ptr in prog.storages:
            if t.data_ptr() != ptr:
                raise ValueError(
                    f"popxl.compile: the storage of {name!r} was replaced after compiling (for "
                    "example model.to(...), .half() or `.data = ...`); the program would no "
                    "longer train the module's tensor. Change the model first, then compile it."
                )
        inv = None
        if batch is not None:  # may raise: before anything changes
            inv = self._inverse_counts(prog, batch)
            feed = {st: self._split(a, batch.ga)
                    for st, a in zip(prog.streams[0], batch.arrays, strict=True)}  # fmt: skip
            # the arrays are narrowed already, float64 ones only for float64-free models
            # (Note [float64 models])
            ins = prog.session._stream_inputs(feed, downcast=False)
            self._fast = _FastStep.record(self, prog, batch, inputs, targets)
        if self._torch_state_changed():
            # optimizer.load_state_dict, a state set before compiling, an eager
            # optimizer.step() (Note [eager optimizer steps]) or entries set or removed:
            # applied now.
            self._import_torch_state(prog)
        self._push(prog)
        if inv is not None:
            prog.session._set_device_value(prog.inv_vars[0], inv)
        stored = prog.session._run_stacked(ins)
        self._stepped = prog
        self._pull(prog)
        self._set_grads(prog)
        self._step_count += 0 if float(prog.overflow_t) > 0 else 1  # skipped on overflow
        self._opt_stale = True
        # This step is the optimizer's step: tell torch's LR schedulers, which otherwise warn
        # that scheduler.step() came before optimizer.step() (the flag their wrapper sets).
        # (an attribute torch's wrapper sets, unknown to the stubs)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        loss = self._loss_value(prog, stored[prog.streams[1]._index])
        if not self.return_outputs:
            return loss
        assert batch is not None  # (no fast path with outputs)
        return loss, self._outputs(prog, prog.session._host_outputs(stored), batch)

    def _outputs(self, prog: _Program, out: dict, batch: _Batch):
        """The model's outputs of the global batch, in its rows' order: every micro-batch's
        output rows where dim 0 holds them, else the micro-batches' values stacked."""
        local_R = _distributed.local_replicas(self.replication_factor)
        GA, n = batch.ga, batch.size
        values = []
        for st in prog.out_streams:
            o = numpy_to_torch(out[st], st.dtype)
            o = o.reshape(GA * local_R, *st.shape)  # [GA, R, ...] with R, GA squeezed when 1
            if GA * local_R == 1:  # nothing was cut (Note [the batch is dim 0])
                o = o[0]
            elif st.shape and st.shape[0] * GA * local_R == n:
                o = o.reshape(n, *st.shape[1:])[: batch.n_real]  # Note [padded rows]
            values.append(o)
        spec, leaves = prog.out_spec
        it = iter(values)
        return pytree.tree_unflatten([next(it) if v is None else v for v in leaves], spec)

    def _inverse_counts(self, prog: _Program, batch: _Batch) -> torch.Tensor | None:
        """One over the global count of every counted mean that the step combines with other
        terms, counted on the host (Note [exact losses over micro-batches])."""
        n, metas, recipe = prog.host_counts
        if not n:
            return None
        R = self.replication_factor
        local = _distributed.local_replicas(R) * batch.ga
        if recipe is not None:  # Note [counts computed in the forward]
            counts = _recipe_counts(recipe, batch, _micro_arrays(batch, local))
        else:
            loss_fn, targets = _loss_of(self.loss_fn, batch)
            if targets is None:
                raise ValueError(
                    "popxl.compile: this loss combines a mean over counted elements with other "
                    "terms, which needs its targets as float32 or integer tensors to count them."
                )
            counts = host_counts(loss_fn, metas, targets, local, n, verify=False)
        instances = R // _distributed.local_replicas(R)
        counts = [_distributed.mean_over_instances(c, R) * instances for c in counts]
        inv = torch.ones(MAX_COUNTS, dtype=loss_dtype(self._tensors))  # Note [float64 models]
        inv[: len(counts)] = 1.0 / torch.tensor(counts, dtype=torch.float64)
        return inv

    def _loss_value(self, prog: _Program, parts: torch.Tensor) -> float:
        """The global batch's loss: the sum of the micro-batch parts over this instance's
        replicas and over the instances, divided once by a counted mean's count (Note [exact
        losses over micro-batches]). ``parts``: the loss stream's stored values, one per
        micro-batch and replica (in the host array's order: one full sum, as of that array)."""
        local = float(parts.double().sum())
        instances = prog.ir._num_instances  # (the layout the program was built for)
        total = local
        if instances > 1:
            total = _distributed.mean_over_instances(local, self.replication_factor) * instances
        if prog.count_var is None:
            return total
        count: Any
        if prog.ir._num_instances > 1:
            count = prog.session.get_tensors_data([prog.count_var])[prog.count_var]
        else:
            count = prog.session._device_rows(prog.count_var)[0]
        # (a batch that counts nothing: eager's mean over nothing, NaN)
        return total * prog.count_bound / float(count) if float(count) else math.nan

    def _set_grads(self, prog: _Program) -> None:
        """Every trained parameter's ``.grad`` is the gradient its update used.

        Note [p.grad after a step]
            Eager loops read ``p.grad`` after ``backward()`` (gradient norms for logging,
            clipping and inspecting), so after a step it holds what eager's would: the
            gradient of the global batch's loss, unscaled and clipped where the step unscales
            and clips (as after ``scaler.unscale_`` / ``clip_grad_norm_``), None for a frozen
            parameter. The program copies the gradient its update uses into a ``grad/<name>``
            variable (a sharded one all-gathered first; the one-pass SGD kernel and the Adam
            chain kernel write it as they read the gradient, a sharded parameter's kernel its
            shard of it, gathered as the parameter is: in place, Note [RTS updates in place] in
            runtime/lower.py, no separate rescale, gather or copy), which is the ``.grad``
            tensor itself
            where the simulator keeps one copy for all replicas (Note [live torch tensors])
            and is copied into ``.grad`` otherwise. It costs a parameter's size per
            parameter, as eager's ``.grad`` does; ``keep_grads=False`` leaves it out.
        """
        if not prog.grad_vars:
            return
        if prog.grads is None:  # (the trainer's parameters stay: _check_module_tensors)
            prog.grads = tuple((self._params[n], prog.grad_t.get(n), v)
                               for n, v in prog.grad_vars.items())  # fmt: skip
        unbound = [v for _, g, v in prog.grads if g is None]
        if unbound and prog.ir._num_instances > 1:
            data = prog.session.get_tensors_data(unbound)
            values = {v.id: numpy_to_torch(data[v], v.dtype) for v in unbound}
        else:
            values = {v.id: prog.session._device_rows(v)[0] for v in unbound}
        with torch.no_grad():
            for p, g, v in prog.grads:
                if g is None:
                    g = values[v.id].clone().to(p.device)
                if p.grad is not g:  # a bound one usually is already (its setter checks)
                    p.grad = g

    def _push(self, prog: _Program) -> None:
        """Hyperparameters and changed unbound module tensors into the program."""
        values = _group_values(self.optimizer, prog.specs)
        if values != prog.hyper_last:
            for i, (v, t) in enumerate(zip(prog.hyper_vars, prog.hyper_t, strict=True)):
                t.copy_(torch.tensor(values[i], dtype=torch.float64))
                if v.id not in prog.bound:
                    prog.session._set_device_value(v, t)
            prog.hyper_last = values
        # Note [per-replica batch statistics]: every replica starts from the module's buffers.
        per_replica = prog.ir.instance_replication_factor > 1
        buffers = {v.id for v in prog.buffer_vars.values()} if per_replica else set()
        for entry in prog.copied:
            var, tensor, snapshot = entry
            if var.id in buffers or snapshot is None or not torch.equal(tensor.detach(), snapshot):
                prog.session._set_device_value(var, tensor.detach())

    def _pull(self, prog: _Program) -> None:
        """Unbound module tensors (replica 0's value, as a DDP rank 0 checkpoint) from the
        program; bound ones already hold the trained values.

        Note [per-replica batch statistics]
            With several replicas a module's buffers (BatchNorm's running statistics and
            ``num_batches_tracked``) are per replica, as DDP keeps them: in training mode each
            replica normalises with the statistics of its own micro-batch (rows ``g*R + r`` of
            the ``R * GA`` equal parts of the global batch, for micro-batch ``g`` of replica
            ``r``) and updates its copy of the running statistics once per micro-batch, in
            order. Every step starts all replicas from the module's buffers (DDP's default
            ``broadcast_buffers=True``: rank 0's buffers at the start of a step), and after
            the step the module holds replica 0's. So a step equals eager torch run on each
            replica's micro-batches from the module's buffers, gradients summed, the module
            keeping replica 0's statistics. This is the one way a compiled step differs from
            the eager loop on the global batch (tests/test_compile_ported_examples.py builds
            that reference for a torchvision ResNet).
        """
        if not prog.copied:
            return
        session = prog.session
        if prog.ir._num_instances > 1:  # replica 0 may live in another process
            data = session.get_tensors_data([e[0] for e in prog.copied])
            values = [numpy_to_torch(data[e[0]], e[0].dtype) for e in prog.copied]
        else:
            values = [session._device_rows(e[0])[0] for e in prog.copied]
        with torch.no_grad():
            for entry, value in zip(prog.copied, values, strict=True):
                entry[1].copy_(value)
                entry[2] = entry[1].detach().clone()

    # ---- optimizer state ------------------------------------------------------------------

    def _state_by_name(self, prog: _Program) -> dict[str, dict[str, torch.Tensor]]:
        """The program's optimizer state per parameter: bound tensors as they are, the rest
        (sharded, off-chip) read back unsharded."""
        unbound = [
            v for s in prog.slots for k, v in s.state.items() if (s.name, k) not in prog.state_t
        ]
        data = prog.session.get_tensors_data(unbound) if unbound else {}
        out = {}
        for s in prog.slots:
            out[s.name] = {
                k: prog.state_t[(s.name, k)]
                if (s.name, k) in prog.state_t
                else numpy_to_torch(data[v], v.dtype)
                for k, v in s.state.items()
            }
        return out

    def _publish_optimizer_state(self) -> None:
        """Make ``optimizer.state`` what torch would hold after ``_step_count`` steps."""
        prog = self._active
        self._opt_stale = False
        if prog is None:
            return
        live = self._live
        if live is None or live is not self.optimizer.state:
            live = self._live = _LiveState(self)
            self.optimizer.state = live
        dict.clear(live)
        for p, entry in self._kept_state.values():
            dict.__setitem__(live, p, entry)
        if self._step_count == 0:  # torch's state is empty before the first step
            return
        state = self._state_by_name(prog)
        specs = {n: spec for spec in prog.specs for n in spec.names}
        for name, p in self._params.items():
            if name not in state:  # frozen: no state, as torch keeps none
                continue
            entry = {}
            count = self._step_count - self._lags.get(name, 0)
            if count == 0:  # unfrozen since the last step: torch has no state for it yet
                continue
            if specs[name].has_step:  # torch's Adam keeps a float32 step per parameter
                entry["step"] = torch.tensor(float(count))
            entry.update(state[name])
            if entry:
                dict.__setitem__(live, p, entry)

    # Note [state of parameters the program does not train]
    #     A frozen parameter (Note [frozen parameters]) or one the loss does not reach (Note
    #     [parameters without a gradient]) can still have optimizer state: torch's Adagrad
    #     makes it in its constructor, and a model trained eagerly before some of its layers
    #     were frozen keeps the state of those layers. Eager torch leaves such state as it is,
    #     so the trainer keeps those entries (the same dicts and tensors) when it imports a
    #     torch state and puts them back whenever it publishes ``optimizer.state``; only the
    #     trained parameters' entries come from the program.
    def _import_torch_state(self, prog: _Program) -> None:
        """Write a torch-format ``optimizer.state`` into the program (all-or-nothing)."""
        by_name, steps = self._from_torch_state(self.optimizer.state)
        step, lags = self._counts(by_name, steps)
        if _lag_key(lags) != prog.lags:  # _prepare built the program for this state
            raise AssertionError(f"program built for lags {prog.lags}, state has {lags}")
        self._loaded_step = None
        trained = {id(self._params[n]) for spec in prog.specs for n in spec.names}
        kept = {id(p): (p, entry) for p, entry in dict.items(self.optimizer.state)
                if entry and id(p) not in trained}  # fmt: skip
        writes = {}
        for s in prog.slots:
            for k, v in s.state.items():
                if s.name in by_name:
                    value = by_name[s.name][k]
                else:  # not stepped yet (Note [parameters stepped fewer times])
                    value = self._initial_state(s.name, s.spec)[k]
                if (s.name, k) in prog.state_t:
                    prog.state_t[(s.name, k)].copy_(value)
                else:
                    writes[v] = torch_to_numpy(value, v.dtype)
        if prog.step_var.id in prog.bound:
            prog.step_t.fill_(float(step))
        else:
            writes[prog.step_var] = np.array(step, dtype=np.float32)
        if prog.fresh and not by_name and step == 0:
            writes = {}  # a new program already holds zeros
        prog.fresh = False
        if writes:
            # write_variables_data re-uploads every variable from its host copy: bring the
            # host copies up to date first (bound tensors may have changed since).
            prog.session.weights_to_host()
            prog.session.write_variables_data(writes)
        self._step_count = step
        self._lags = lags
        self._kept_state = kept
        self._live = None
        self._eager_stepped = False
        self._publish_optimizer_state()

    def _from_torch_state(self, state) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
        """``optimizer.state`` (torch's layout) -> ({param name: {state: tensor}}, {param name:
        step}), validated: every parameter's entry complete and of the parameter's shape. The
        steps are those of the entries that keep one (Note [parameters stepped fewer times])."""
        if isinstance(state, _LiveState):
            state._sync()
        raw = {id(k): v for k, v in dict.items(state)}
        specs = {n: spec for spec in self._specs() for n in spec.names}
        by_name, steps = {}, {}
        for name, p in self._params.items():
            if name not in specs:  # frozen (Note [frozen parameters])
                continue
            entry = raw.get(id(p))
            want = specs[name].state_of(name)
            if not entry or not want:
                continue
            missing = [k for k in want if k not in entry]
            if missing:
                raise ValueError(
                    f"optimizer state for {name!r} lacks {missing} (has {sorted(entry)}); a "
                    f"{type(self.optimizer).__name__} checkpoint of this model is expected."
                )
            for k in want:
                v = entry[k]
                shape = specs[name].state_shape(name, k, tuple(p.shape))
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape:
                    raise ValueError(
                        f"optimizer state {k!r} of {name!r} has shape "
                        f"{tuple(getattr(v, 'shape', ()))}; {shape} is expected."
                    )
            by_name[name] = {k: entry[k] for k in want}
            if "step" in entry:
                steps[name] = int(float(entry["step"]))
        return by_name, steps

    # Note [parameters stepped fewer times]
    #     torch keeps a step count per parameter: a layer unfrozen (or added with
    #     ``add_param_group``) after some steps starts from step 0 while the others go on, and
    #     its bias corrections are its own. The program keeps one count, the leading one
    #     (``step_var``); a parameter stepped fewer times has a *lag* behind it, part of the
    #     program's structure (``_Program.lags``): its update reads ``step - lag``, and the
    #     group's scalars are computed once per distinct lag. Lags change only when torch's
    #     state is imported (a checkpoint, an eager step) or the trained set changes
    #     (unfreezing), which rebuild the program anyway. torch's SGD keeps no count: a
    #     parameter without a momentum buffer among others with one lags by the whole count,
    #     so that its first update starts the buffer from its gradient as torch does.
    def _counts(self, by_name: dict, steps: dict[str, int]) -> tuple[int, dict[str, int]]:
        """The leading step count of a torch state and every trained parameter's nonzero lag
        behind it (Note [parameters stepped fewer times])."""
        specs = {n: spec for spec in self._specs() for n in spec.names}
        stateful = [n for n in self._params if n in specs and specs[n].state_of(n)]
        loaded = self._loaded_step  # Trainer.load_state_dict's count, until applied
        if self._has_step():
            counts = {n: steps.get(n, 0) for n in stateful}
            lead = max(counts.values(), default=0) if loaded is None else loaded
        else:  # torch's SGD keeps no count: ours goes on (step 0 starts momentum buffers)
            if loaded is not None:
                lead = loaded
            elif by_name:
                lead = max(self._step_count, 1)
            else:
                lead = self._step_count if not any(s.momentum for s in specs.values()) else 0
            counts = {n: lead if n in by_name else 0 for n in stateful}
        return lead, {n: lead - c for n, c in counts.items() if c != lead}

    # ---- state ----------------------------------------------------------------------------

    def _has_step(self) -> bool:
        return any(s.has_step for s in self._specs())

    def _initial_state(self, name: str, spec: _GroupSpec) -> dict[str, torch.Tensor]:
        """A parameter's optimizer state before its first step, as torch initialises it:
        zeros, or what a captured optimizer's probe found (Note [captured optimizer steps])."""
        p = self._params[name]
        if spec.kind != "torch":
            return {k: torch.zeros_like(p.detach()) for k in spec.state_of(name)}
        group = next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
        return _optim.cached_probe(self.optimizer, group, p)[1]

    def sync_weights(self) -> None:
        """Kept for compatibility: the module's tensors are always current after a step."""

    def state_dict(self) -> dict[str, Any]:
        """Torch-style state: ``{"model": ..., "optimizer": {"state": {name: {...}}, "step": n}}``.

        Sharded and off-chip state is returned unsharded (full tensors); a checkpoint loaded
        before the first step is returned as loaded.
        """
        out = {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()}}
        by_name, steps = self._from_torch_state(self.optimizer.state)
        step, lags = self._counts(by_name, steps)
        if not self._has_step() and self._loaded_step is None:
            step = self._step_count  # torch's SGD keeps no count: ours
        out["optimizer"] = {
            "state": {
                n: {k: v.detach().clone() for k, v in st.items()} for n, st in by_name.items()
            },
            "step": step,
        }
        if lags:  # Note [parameters stepped fewer times]; a parameter stepped 0 times has no state
            out["optimizer"]["steps"] = {n: step - lags.get(n, 0) for n in by_name}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint made by ``state_dict`` (sharded or not), all-or-nothing: every
        key, shape and dtype is checked before anything changes. Applied at the next step."""
        if not isinstance(state, dict) or "model" not in state or "optimizer" not in state:
            raise ValueError("load_state_dict expects the dict returned by Trainer.state_dict().")
        _check_tensors("model", state["model"], self.model.state_dict())
        opt = state["optimizer"]
        keys = set(opt) if isinstance(opt, dict) else set()
        if not {"state", "step"} <= keys <= {"state", "step", "steps"}:
            raise ValueError(
                "load_state_dict: state['optimizer'] must be {'state': {...}, 'step': n} "
                "(and 'steps': {name: n} where parameters were stepped fewer times) as "
                "returned by Trainer.state_dict()."
            )
        step = opt["step"]
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"load_state_dict: optimizer step must be an int >= 0; got {step!r}.")
        counts = opt.get("steps", {})
        if not isinstance(counts, dict) or any(
            isinstance(c, bool) or not isinstance(c, int | np.integer) or not 0 < c <= step
            for c in counts.values()
        ):
            raise ValueError(
                f"load_state_dict: optimizer 'steps' must map parameter names to ints in 1.."
                f"{step} (the steps each was stepped); got {counts!r}."
            )
        specs = {n: spec for spec in self._specs() for n in spec.names}
        if opt["state"]:
            if "steps" in opt and set(counts) != set(opt["state"]):
                raise ValueError(
                    "load_state_dict: optimizer 'steps' must name the parameters in 'state'; "
                    f"got {sorted(counts)} for {sorted(opt['state'])}."
                )
            expected = {
                f"{n}.{k}": self._initial_state(n, specs[n])[k]
                for n in self._params
                if n in specs and ("steps" not in opt or n in counts)
                for k in specs[n].state_of(n)
            }
            given = {}
            for n, st in opt["state"].items():
                if not isinstance(st, dict):
                    raise ValueError(f"load_state_dict: optimizer state of {n!r} must be a dict.")
                given.update({f"{n}.{k}": v for k, v in st.items()})
            _check_tensors("optimizer state", given, expected)
            if step == 0:
                raise ValueError("load_state_dict: optimizer state is given but step is 0.")
        # Everything checked: apply.
        self.model.load_state_dict(state["model"])
        torch_state: collections.defaultdict[Any, dict] = collections.defaultdict(dict)
        for n, st in opt["state"].items():
            entry = {"step": torch.tensor(float(counts.get(n, step)))} if self._has_step() else {}
            entry.update({k: v.detach().clone() for k, v in st.items()})
            torch_state[self._params[n]] = entry
        self._loaded_step = int(step)
        self.optimizer.state = torch_state  # imported before the next step

    def memory_report(self, cost_model=None):
        """The active program's memory report (after ``plan`` or the first ``step``)."""
        if self.session is None:
            raise ValueError(
                "memory_report() needs a built program: call trainer.plan(inputs, targets) "
                "(or run a step) first."
            )
        return (
            self.session.memory_report(cost_model)
            if cost_model is not None
            else self.session.memory_report()
        )


# Note [optimizers that take a closure]
#     ``LBFGS.step(closure)`` evaluates the loss and gradients several times per step (its
#     line search and inner iterations, ``max_iter`` of them), deciding from their values
#     when to stop: host control flow a captured step cannot hold. So such an optimizer (one
#     whose ``step`` requires a ``closure``) runs its own step in eager torch, as in the eager
#     loop, and the compiled program is its closure: a step of the same trainer with an SGD
#     of learning rate 0 over the optimizer's parameters computes the loss and the gradients
#     of the global batch on the replicas (accumulation, clipping and sharding as for any
#     optimizer), leaves the parameters as they are (``p - 0 * g``) and writes ``p.grad``;
#     the optimizer then updates the module's parameters in place, which the next run reads
#     (Note [live torch tensors]). ``step`` returns the closure's first loss, as
#     ``optimizer.step(closure)`` does; LR schedulers and ``optimizer.state`` are the
#     optimizer's own.


# Note [data-parallel wrappers]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Scripts written for GPUs wrap their model in ``nn.DataParallel`` (one process, the batch
# split over the devices, outputs gathered, gradients summed) or ``DistributedDataParallel``
# (a process per replica, gradients averaged by all-reduce, buffers broadcast from rank 0 at
# every forward). A compiled step does that itself: its replicas take the wrapper's devices
# or processes, with the same split of the batch, the same reduction of the gradients, and
# every step starting all replicas from the module's buffers (DDP's ``broadcast_buffers``).
# So ``popxl.compile`` looks through the wrappers and compiles the module they hold (torch's
# own functional API refuses them). What the wrapper itself would change is refused, since
# the compiled step would silently drop it: a DDP communication hook (fp16 / PowerSGD
# compression changes the summed gradients) and hooks registered on the wrapper module.


def _without_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DataParallel / DistributedDataParallel wrapper holds (Note
    [data-parallel wrappers]); ``model`` itself otherwise."""
    wrappers = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while isinstance(model, wrappers):
        kind = type(model).__name__
        comm_hooks: Any = getattr(model, "_comm_hooks", None)  # ([(hook, state)], untyped)
        if comm_hooks:
            raise ValueError(
                f"popxl.compile: the {kind} wrapper has a communication hook "
                f"({comm_hooks[0][0].__name__}); the compiled step sums the replicas' "
                "gradients itself and would not run it. Pass the module without the hook "
                "(popxl.compile(model.module, ...)), or train it eagerly."
            )
        hooks = [n for n in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                             "_backward_pre_hooks") if getattr(model, n, None)]  # fmt: skip
        if hooks:
            raise ValueError(
                f"popxl.compile: the {kind} wrapper has its own hooks ({', '.join(hooks)}); "
                "the compiled step compiles the module it holds and would not run them. "
                "Register them on model.module instead."
            )
        model = model.module
    return model


def _takes_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (Note [optimizers that take a closure])."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return False  # (the Trainer says what it expects)
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


class _ClosureTrainer(Trainer):
    """A :class:`Trainer` for an optimizer whose ``step`` takes a closure (LBFGS): the
    compiled program computes the loss and gradients, torch's optimizer steps (Note
    [optimizers that take a closure])."""

    def __init__(self, model, loss_fn, optimizer, *args, **kwargs):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        gradients = torch.optim.SGD(params, lr=0.0)  # the program's own update: none
        super().__init__(model, loss_fn, gradients, *args, **kwargs)
        self.keep_grads = True  # the optimizer reads p.grad (read when a program is built)
        self.closure_optimizer = optimizer

    def step(self, inputs, targets=None) -> float | tuple[float, Any]:
        """One step of the optimizer, whose closure runs the program on this batch."""
        results: list = []

        def closure():
            out = Trainer.step(self, inputs, targets)
            results.append(out)
            loss = out[0] if self.return_outputs else out
            return torch.tensor(loss, dtype=torch.float64)

        self.closure_optimizer.step(closure)
        return results[0]


def compile(model: torch.nn.Module, loss_fn: Callable | None = None, optimizer: torch.optim.Optimizer | None = None,
            *, replication_factor: int = 1, gradient_accumulation: int = 1, rts_threshold: int | None = None,
            optimizer_state: str = "on_chip", device: str | torch.device | None = None,
            executor: str = "fast", max_grad_norm: float | None = None, loss_scaling=None, backend: str = "default",
            keep_grads: bool = True, return_outputs: bool = False):  # fmt: skip
    """Compile ``model`` into a PopXL program.

    With an ``optimizer`` the result is a :class:`Trainer`: ``step(inputs, targets)`` trains
    on ``loss_fn(model(inputs), targets)``, or with ``loss_fn=None`` on the loss the model
    returns (a scalar tensor, or an output with ``.loss`` / ``["loss"]``; targets optional).
    Without ``loss_fn`` and ``optimizer``: an :class:`InferenceProgram`. After a step every
    trained parameter's ``.grad`` holds its gradient (``keep_grads=False``: not kept, less
    memory); ``return_outputs=True`` makes ``step`` return ``(loss, outputs)``, the model's
    outputs of the global batch. ``max_grad_norm`` clips the global gradient norm as
    ``torch.nn.utils.clip_grad_norm_`` does (``Trainer.last_grad_norm``: the total norm
    before clipping, as it returns). ``loss_scaling`` scales the loss for float16
    training: a number (static), ``"dynamic"`` or a ``torch.amp.GradScaler`` (dynamic, with
    its settings: inf/nan steps are skipped and the scale backs off, as GradScaler does).
    ``backend="inductor"`` runs the generated step functions through ``torch.compile`` (CPU;
    seconds of compilation at the first step, see README "Benchmarks"); ``"default"`` runs
    them as generated. ``device`` holds the replicas: ``"cpu"`` or ``"cuda"``; left out,
    ``$TORCH_POPXL_DEVICE`` or the CPU. See docs/compile.md and the README section
    "popxl.compile".
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"popxl.compile expects a torch.nn.Module; got {type(model).__name__}.")
    model = _without_data_parallel(model)  # Note [data-parallel wrappers]
    if optimizer is None and loss_fn is not None:
        raise ValueError(
            "popxl.compile: a loss_fn without an optimizer; give an optimizer for training "
            "(loss_fn=None: the model returns its loss), or neither for inference."
        )
    if optimizer is None:
        if (gradient_accumulation != 1 or rts_threshold is not None or optimizer_state != "on_chip"
                or max_grad_norm is not None or loss_scaling is not None):  # fmt: skip
            raise ValueError(
                "gradient_accumulation, rts_threshold, optimizer_state, max_grad_norm and "
                "loss_scaling only apply to training (give an optimizer)."
            )
        return InferenceProgram(model, replication_factor, device, executor, backend)
    kind = _ClosureTrainer if _takes_closure(optimizer) else Trainer
    return kind(model, loss_fn if loss_fn is not None else model_loss, optimizer,
                   replication_factor, gradient_accumulation, rts_threshold, optimizer_state,
                   device, executor, max_grad_norm, loss_scaling, backend, keep_grads,
                   return_outputs)  # fmt: skip
