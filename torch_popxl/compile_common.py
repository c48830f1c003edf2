"""Helpers shared by ``popxl.compile``'s trainer and inference programs: input checks and
splitting, model outputs and losses, attributes restored after capture."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from .capture import call_torch
from .dtypes import dtype as _dtype
from .dtypes import to_numpy
from .ir.streams import h2d_stream

_MAX_PROGRAMS = 8  # programs kept per Trainer / InferenceProgram (input signatures x modes)


# ---- helpers ------------------------------------------------------------------------------


def model_loss(output, targets=None):
    """The loss a model returns from ``forward`` (``loss_fn=None``): the output itself when it
    is a scalar tensor, else its ``.loss`` attribute or ``"loss"`` entry (Hugging Face
    ``ModelOutput``, PopTorch-style models)."""
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, tuple | list) and output:
        loss = output[0]  # (loss, logits, ...) as PopTorch's models return
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "popxl.compile(loss_fn=None): the model must return its loss (a scalar tensor, an "
            f"output with .loss, or a tuple whose first element is the loss); got "
            f"{type(output).__name__}. Pass the targets the model needs in the inputs (for "
            "example inputs={'input_ids': x, 'labels': y}), or give a loss_fn."
        )
    return loss


def _without_caches(out):
    """The model's outputs with Hugging Face key/value caches replaced by None.

    ``use_cache=True`` (the default of most Hugging Face configs) makes a forward return a
    ``Cache`` object (``past_key_values``) holding each layer's keys and values. It is state for
    incremental generation, not an output of a training or batch-inference step, and it is no
    pytree (its tensors would come back as the capture's fake tensors): it is dropped, as
    ``use_cache=False`` would, and the output's ``past_key_values`` is None."""
    transformers = sys.modules.get("transformers")
    cache_type = getattr(getattr(transformers, "cache_utils", None), "Cache", None)
    if cache_type is None:
        return out
    return pytree.tree_map(lambda v: None if isinstance(v, cache_type) else v, out)


@contextlib.contextmanager
def _attributes_restored(model: torch.nn.Module):
    """Every submodule's attributes as they were before the capture inside (Note [attributes
    set during capture])."""
    saved = [(m, dict(m.__dict__)) for m in model.modules()]
    try:
        yield
    finally:
        for m, before in saved:
            for name in [n for n in m.__dict__ if n not in before]:
                del m.__dict__[name]
            for name, value in before.items():
                if m.__dict__.get(name, _MISSING) is not value:
                    m.__dict__[name] = value


# Note [attributes set during capture]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward may store on its module what it computed (`self.last_attention = attn`, a counter,
# a cache). During capture those values are the capture's fake tensors: left on the module they
# would be read by the user's code, by the next compile (as tensors of a graph that is gone) or
# by eager torch. Capture must leave the module as it found it, so each submodule's attribute
# dict is put back (attributes added are removed, replaced ones restored) after the forward is
# captured. The values an eager forward would have left there are not available: a compiled
# step does not run the Python forward, so such attributes keep their eager values (those of
# the last eager forward, or none).

_MISSING = object()


# Note [cumulative batch norm]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# BatchNorm with ``momentum=None`` keeps a cumulative moving average of the batch statistics:
# its forward counts the batch (``num_batches_tracked += 1``) and weights the batch's
# statistics by ``1.0 / float(num_batches_tracked)``, a Python number read from a tensor,
# which a program built once cannot follow. So while a forward is captured each such module
# (in training mode, tracking running statistics) runs with momentum 0, where torch's kernel
# leaves the running statistics as they are (``0 * batch + 1 * running``), and a forward hook
# then updates them as the kernel would have, with the weight a tensor of the program: ``f =
# 1 / num_batches_tracked`` and ``running = f * batch + (1 - f) * running`` in float64 (the
# kernel's accumulation type on a CPU), the batch's mean and unbiased variance over every dim
# but the channels. Each micro-batch counts and updates once, in order, as in eager torch
# (Note [per-replica batch statistics] in compile.py).
@contextlib.contextmanager
def cumulative_batch_norms(model: torch.nn.Module):
    """While inside, ``model``'s cumulative batch norms update their running statistics
    with the count as a tensor (Note [cumulative batch norm])."""
    found = [m for m in model.modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
             and m.track_running_stats and m.momentum is None]  # fmt: skip
    hooks = []
    try:
        for m in found:
            m.momentum = 0.0
            hooks.append(m.register_forward_hook(_cumulative_update))
        yield
    finally:
        for h in hooks:
            h.remove()
        for m in found:
            m.momentum = None


def _cumulative_update(bn, args, _out) -> None:
    x = args[0].detach()
    with torch.no_grad():
        var, mean = torch.var_mean(x.to(torch.float64), dim=[0, *range(2, x.ndim)], correction=1)
        f = 1.0 / bn.num_batches_tracked.to(torch.float64)
        for running, batch in ((bn.running_mean, mean), (bn.running_var, var)):
            running.copy_(f * batch + (1 - f) * running.to(torch.float64))


def _mark_eager_step(trainer_ref) -> None:
    trainer = trainer_ref()
    if trainer is not None:
        trainer._eager_stepped = True


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}.")


def _check_tensors(what: str, given, expected: dict[str, torch.Tensor]) -> None:
    """Same keys, shapes and dtypes as ``expected``, or a ValueError listing every problem."""
    if not isinstance(given, dict):
        raise ValueError(f"load_state_dict: {what} must be a dict; got {type(given).__name__}.")
    problems = []
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    if missing:
        problems.append(f"missing keys {missing}")
    if extra:
        problems.append(f"unexpected keys {extra}")
    for k in sorted(set(given) & set(expected)):
        v, e = given[k], expected[k]
        if not isinstance(v, torch.Tensor):
            problems.append(f"{k!r} is a {type(v).__name__}, not a tensor")
        elif tuple(v.shape) != tuple(e.shape) or v.dtype != e.dtype:
            problems.append(
                f"{k!r} is {tuple(v.shape)} {v.dtype}, expected {tuple(e.shape)} {e.dtype}"
            )
    if problems:
        raise ValueError(
            f"load_state_dict: the {what} does not match this model ({'; '.join(problems)}). "
            "Nothing was changed."
        )


def _host(t: torch.Tensor) -> np.ndarray:
    # to_numpy: a copy, with bf16 as its bits (numpy has no bfloat16).
    return to_numpy(t, downcast=False)


# Note [float64 models]
#     numpy makes float64 arrays by default, so host data for a float32 model often comes as
#     float64: it is narrowed to float32, the dtype the model computes in. A model that holds
#     float64 parameters or buffers (``model.double()``) computes in float64, as eager torch
#     does: its float64 inputs and targets stay float64 (narrowing them made the first layer
#     see float32 images against float64 weights), and so does the loss's bookkeeping (each
#     micro-batch's part of the loss, the counts of a counted mean and their inverses), which
#     is float32 for every other model (16-bit losses are summed in float32).
def loss_dtype(model: torch.nn.Module | Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype of ``model``'s loss bookkeeping and of its float64 host data (Note [float64
    models]). ``model`` may also be its parameters and buffers, already listed (a compiled
    step asks every step, and walking the module was most of its batch check's time)."""
    tensors = (
        (*model.parameters(), *model.buffers()) if isinstance(model, torch.nn.Module) else model
    )
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def host_float(model: torch.nn.Module | Iterable[torch.Tensor]) -> type:
    """The numpy dtype float64 host data for ``model`` (or its listed parameters and buffers)
    becomes (Note [float64 models])."""
    return np.float64 if loss_dtype(model) == torch.float64 else np.float32


def _array(x, what: str, floats: type = np.float32) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = to_numpy(x, downcast=False)  # bf16 as its bits (numpy has no bfloat16)
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"{what} must have a batch dimension; got a scalar.")
    if x.dtype == np.float64:  # Note [float64 models]
        x = x.astype(floats, copy=False)
    return x


# Note [nested inputs]
# ~~~~~~~~~~~~~~~~~~~~
# A step's inputs are the arguments of ``forward``: a tensor, a tuple/list (positional) or a
# dict (keyword), and an argument may itself be a tuple, list or dict of tensors (an LSTM's
# ``(h, c)``, a cache). Each leaf is one host stream (keyword leaves named by their path,
# "name.0"); the structure (a pytree spec, part of the program's key) rebuilds the
# arguments from the streamed micro-batches, so the forward sees what eager torch passes. A
# list of numbers is one array, as before.
def _is_array_like(x) -> bool:
    """A leaf of a step's inputs: a tensor, an array, or a list of numbers."""
    if isinstance(x, tuple | list | dict):
        return bool(x) and not isinstance(x, dict) and isinstance(x[0], int | float | bool)
    return True


# Note [keyword options]
#     A dict of inputs may hold, beside its batched tensors, keyword options of the model's
#     forward given as plain Python values (``return_loss=True``, ``output_hidden_states=False``,
#     ``None``): they are not data but choices of the forward's code path. Each is passed to
#     the forward as given at capture time and is part of the program's key, so another value
#     builds (or reuses) another program, as another input shape does. A 0-d tensor or array
#     is data without a batch dimension and stays an error.
_OPTION_TYPES = (bool, int, float, str, type(None))


def options_key(options: tuple[tuple[str, Any], ...]) -> tuple:
    """``options`` as a program key: with each value's type (``True`` and ``1`` are
    different options though equal in Python)."""
    return tuple((k, type(v).__name__, v) for k, v in options)


# the structure of ``((x,), {})`` for one array ``x`` (what the tree walk below gives it)
_ONE_ARRAY = pytree.tree_structure(((0,), {}))


def _structured(
    x, what: str, floats: type = np.float32
) -> tuple[list[np.ndarray], dict[str, np.ndarray], pytree.TreeSpec, tuple[tuple[str, Any], ...]]:
    """A tensor, a tuple/list (positional) or a dict (keyword) as arrays (float64 ones as
    ``floats``: Note [float64 models]): the positional leaves, the keyword leaves by their path,
    the structure that rebuilds ``(args, kwargs)`` from them and a dict's keyword options as
    sorted (name, value) pairs. An argument may be a tuple, list or dict of tensors (an LSTM's
    ``(h, c)`` state): Note [nested inputs]; a plain Python value in a dict is a keyword option
    of the forward: Note [keyword options]."""
    if isinstance(x, np.ndarray | torch.Tensor):  # one array: the common case, no tree walk
        return [_array(x, what, floats)], {}, _ONE_ARRAY, ()
    args: tuple
    options: tuple[tuple[str, Any], ...] = ()
    if isinstance(x, dict):
        if not x:
            raise ValueError(f"{what}: an empty dict.")
        options = tuple(sorted((k, v) for k, v in x.items() if isinstance(v, _OPTION_TYPES)))
        kwargs = {k: v for k, v in x.items() if not isinstance(v, _OPTION_TYPES)}
        if not kwargs:
            raise ValueError(
                f"{what}: a dict with keyword options only ({[k for k, _ in options]}); "
                "expected at least one batched tensor (dim 0: the samples) to run the model on."
            )
        args = ()
    elif isinstance(x, tuple | list) and x and not _is_array_like(x):
        args, kwargs = tuple(x), {}
    else:
        args, kwargs = (x,), {}
    # Note [nested inputs]
    flat, spec = pytree.tree_flatten_with_path((args, kwargs), is_leaf=_is_array_like)
    out_args, out_kwargs = [], {}
    for path, v in flat:
        where = what + (pytree.keystr(path[1:]) if not args or x is not args[0] else "")
        if path[0] == pytree.SequenceKey(0):
            out_args.append(_array(v, where, floats))
        else:  # a keyword argument's leaves as "name", "name.0", "name.key"
            name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path[1:])
            out_kwargs[name] = _array(v, where, floats)
    return out_args, out_kwargs, spec, options


def _structured_targets(x, floats: type = np.float32) -> tuple[list[np.ndarray], Any]:
    """Targets as arrays and the structure that rebuilds them for ``loss_fn``: a tensor, or a
    tuple, list or dict of them, nested (a multi-task loss's ``{"cls": y, "box": b}``); no
    arrays and None without targets."""
    if x is None:
        return [], None
    flat, spec = pytree.tree_flatten_with_path(x, is_leaf=_is_array_like)
    if not flat:
        raise ValueError(f"targets: an empty {type(x).__name__}; give None for no targets.")
    return [_array(v, "targets" + pytree.keystr(path), floats) for path, v in flat], spec


def _pad_rows(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` with copies of its last row up to ``n`` rows."""
    return np.concatenate([a, np.repeat(a[-1:], n - a.shape[0], axis=0)])


def _micro_batches(n: int, R: int, GA: int) -> int | None:
    """How many micro-batches per replica a global batch of ``n`` samples runs as (Note [a
    short last batch] in compile.py): ``GA`` where ``R * GA`` divides ``n``, else the largest
    count below ``GA`` that splits each replica's share equally; None where the replicas'
    shares cannot be equal."""
    if n == 0 or n % R:
        return None
    share = n // R
    return next(g for g in range(min(GA, share), 0, -1) if share % g == 0)


def _split_advice(n: int, R: int, GA: int) -> str:
    """Why ``n`` samples do not split over ``R`` replicas, and what would."""
    return (
        f"popxl.compile: a global batch of {n} samples does not split into equal shares for "
        f"the replication_factor = {R} replicas (each replica runs the same program on its own "
        f"micro-batches; gradient_accumulation = {GA} adapts to a short batch, the replicas "
        f"cannot). {_sizes_that_split(n, R)}"
    )


def _sizes_that_split(n: int, R: int) -> str:
    """What to give instead of ``n`` samples on ``R`` replicas."""
    lower, upper = n // R * R, (n // R + 1) * R
    sizes = f"{lower} or {upper}" if lower else f"{upper}"
    return (
        f"Give a multiple of {R} (such as {sizes}) or drop a short last batch "
        "(DataLoader(..., drop_last=True)). Nothing was changed."
    )


def _describe(key: tuple) -> str:
    args, kwargs, targets = key[:3]
    options = key[5]
    inputs = [f"{tuple(s)} {d}" for s, d in args] + [f"{k}={tuple(s)} {d}" for k, s, d in kwargs]
    inputs += [f"{k}={v!r}" for k, _, v in options]
    return f"([{', '.join(inputs)}], [{', '.join(f'{tuple(s)} {d}' for s, d in targets)}])"


def _h2d(shape, np_dtype, name):
    dt = _dtype.as_dtype(np.dtype(np_dtype))
    if dt.name == "int64":  # host data is downcast to int32 (as PopXL does)
        dt = _dtype.as_dtype("int32")
    return h2d_stream(shape, dt, name)


def as_host_dtype(loaded, np_dtype):
    """A tensor loaded from an ``_h2d`` stream in the dtype of the host array it carries
    (int64 travels as int32, as PopXL streams host data; a cross-entropy's targets and an
    embedding's ids are int64 in the model, as in eager torch)."""
    if np.dtype(np_dtype) != np.int64:
        return loaded
    return call_torch(torch.Tensor.long, (loaded,), {})
