"""``addons.array_munging``: host-side numpy helpers that lay data out for replicas.

The convention (popxl-addons): a "sharded" array has a new leading axis, one entry per shard, in
the order replicas consume them; ``unshard`` undoes ``shard``. Host inputs of a replicated
session have shape ``(num_host_transfers, replication_factor, *shape)`` with size-1 leading axes
left out, which ``tensor_parallel_input`` / ``tensor_parallel_output`` produce and consume.
Pure numpy: nothing here touches an IR.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

__all__ = [
    "shard",
    "unshard_arrays",
    "unshard",
    "repeat",
    "repeat_axis",
    "split2D",
    "shard2D",
    "unshard2D",
    "repeat_shard",
    "tensor_parallel_input",
    "tensor_parallel_output",
    "pad_axis",
    "squeeze_safe",
    "handle_negative_axis",
]


def handle_negative_axis(x: np.ndarray, axis: int) -> int:
    """``axis`` as a non-negative index of ``x``; IndexError when out of range."""
    if x.ndim == 0:
        raise IndexError("handle_negative_axis: the array is 0-dimensional, it has no axes")
    if not -x.ndim <= axis < x.ndim:
        raise IndexError(f"axis {axis} is out of range for an array of rank {x.ndim}")
    return axis % x.ndim


def _check_divides(x: np.ndarray, n: int, axis: int, fn: str) -> None:
    if n < 1 or x.shape[axis] % n:
        raise ValueError(
            f"{fn}: cannot split axis {axis} of length {x.shape[axis]} (shape {x.shape}) into "
            f"{n} equal shards; choose n dividing {x.shape[axis]}"
        )


def shard(x: np.ndarray, n: int, axis: int) -> np.ndarray:
    """Split ``axis`` into ``n`` equal pieces stacked on a new leading axis.

    ``shard(np.arange(8).reshape(4, 2), 2, 0)`` has shape ``(2, 2, 2)``: rows 0-1, then rows 2-3.
    """
    x = np.asarray(x)
    axis = handle_negative_axis(x, axis)
    _check_divides(x, n, axis, "shard")
    return np.stack(np.split(x, n, axis=axis))


def unshard_arrays(xs: Sequence[np.ndarray], axis: int) -> np.ndarray:
    """Concatenate arrays that each carry a leading axis of length 1 along ``axis`` of the data
    (the leading axis not counted), then drop the leading axis."""
    xs = [np.asarray(x) for x in xs]
    if any(x.ndim != xs[0].ndim for x in xs[1:]):
        ranks = ", ".join(str(x.ndim) for x in xs)
        raise ValueError(f"unshard_arrays: all arrays must have the same rank, got ranks {ranks}")
    axis = axis + 1 if axis >= 0 else handle_negative_axis(xs[0], axis)
    return np.concatenate(xs, axis=axis).squeeze(0)


def unshard(x: np.ndarray, axis: int) -> np.ndarray:
    """Inverse of ``shard``: concatenate the leading-axis entries along ``axis`` (of one shard)."""
    x = np.asarray(x)
    return unshard_arrays(np.split(x, x.shape[0], axis=0), axis)


def repeat(x: np.ndarray, n: int, axis: int = 0) -> np.ndarray:
    """``n`` copies of ``x`` along a new axis inserted at ``axis``."""
    x = np.asarray(x)
    return np.repeat(np.expand_dims(x, axis), n, axis=axis)


def repeat_axis(x: np.ndarray, n: int, axis: int = 0) -> np.ndarray:
    """Tile ``x`` ``n`` times along the existing ``axis`` (``[a, b] -> [a, b, a, b]``)."""
    x = np.asarray(x)
    reps = [1] * x.ndim
    reps[handle_negative_axis(x, axis)] = n
    return np.tile(x, reps)


def split2D(x: np.ndarray, n_1: int, n_2: int, axis_1: int, axis_2: int) -> list[list[np.ndarray]]:
    """``x`` split into ``n_1`` pieces along ``axis_1``, each split into ``n_2`` along ``axis_2``."""
    x = np.asarray(x)
    _check_divides(x, n_1, handle_negative_axis(x, axis_1), "split2D")
    _check_divides(x, n_2, handle_negative_axis(x, axis_2), "split2D")
    return [np.split(a, n_2, axis=axis_2) for a in np.split(x, n_1, axis=axis_1)]


def shard2D(x: np.ndarray, n_1: int, n_2: int, axis_1: int, axis_2: int) -> np.ndarray:
    """Shard over two axes; ``axis_1`` is the outer (slowest varying) one on the new leading axis."""
    pieces = [p for row in split2D(x, n_1, n_2, axis_1, axis_2) for p in row]
    return np.stack(pieces)


def unshard2D(x: np.ndarray, n_1: int, n_2: int, axis_1: int, axis_2: int) -> np.ndarray:
    """Inverse of ``shard2D`` (axes counted without the leading shard axis)."""
    x = np.asarray(x)
    if x.shape[0] != n_1 * n_2:
        raise ValueError(
            f"unshard2D: the leading axis has {x.shape[0]} shards, expected n_1 * n_2 = {n_1 * n_2}"
        )
    pieces = np.split(x, x.shape[0], axis=0)
    rows = [unshard_arrays(pieces[i * n_2 : (i + 1) * n_2], axis_2) for i in range(n_1)]
    return np.concatenate(rows, axis=axis_1)


def repeat_shard(x: np.ndarray, n_repeats: int, n_shards: int, shard_axis: int,
                 sharded_tensor: Literal["contiguous", "strided"] = "contiguous") -> np.ndarray:  # fmt: skip
    """``n_shards`` shards of ``x`` repeated ``n_repeats`` times on the leading axis.

    ``"contiguous"`` cycles through the shards (``s0 s1 s0 s1``: the layout of replicas sharded
    over consecutive groups); ``"strided"`` repeats each shard in place (``s0 s0 s1 s1``).
    """
    if sharded_tensor not in ("contiguous", "strided"):
        raise ValueError(
            f"repeat_shard: sharded_tensor must be 'contiguous' or 'strided', got {sharded_tensor!r}"
        )
    y = shard(x, n_shards, shard_axis)
    if sharded_tensor == "contiguous":
        return repeat_axis(y, n_repeats, 0)
    return np.repeat(y, n_repeats, axis=0)


def _check_tp(tp: int, rf: int) -> None:
    if tp > rf or rf % tp:
        raise ValueError(
            f"the tensor-parallel factor tp={tp} must divide the replication factor rf={rf}"
        )


def tensor_parallel_input(input_data: np.ndarray, tp: int, rf: int,
                          repeat_fn: Callable[[np.ndarray, int], np.ndarray] | None = None) -> np.ndarray:  # fmt: skip
    """Host layout ``(num_host_transfers, rf, *shape)`` in which the ``tp`` consecutive replicas
    of a tensor-parallel group get the same sample (``repeat_fn(copy, i)`` may alter the i-th).

    ``input_data`` has shape ``(n, *shape)``; samples fill data-parallel replicas first, then host
    transfers. Size-1 host-transfer or replica axes are left out, as ``Session.run`` expects.
    """
    _check_tp(tp, rf)
    input_data = np.asarray(input_data)
    data = np.expand_dims(input_data, 1)
    copies = [repeat_fn(data.copy(), i) if repeat_fn else data for i in range(tp)]
    out = np.concatenate(copies, axis=1).reshape(-1, rf, *input_data.shape[1:])
    return squeeze_safe(out, [0, 1])


def tensor_parallel_output(output_data: np.ndarray, num_host_transfers: int, tp: int, rf: int,
                           data_shape: tuple[int, ...], tp_identical: bool = True,
                           true_num_host_transfers: int | None = None) -> np.ndarray:  # fmt: skip
    """Inverse of ``tensor_parallel_input`` for session outputs: ``(samples, *data_shape)``, or
    ``(samples, tp, *data_shape)`` when ``tp_identical`` is False. ``true_num_host_transfers``
    drops trailing transfers that a run did not fill."""
    _check_tp(tp, rf)
    out = np.asarray(output_data).reshape(num_host_transfers, rf // tp, tp, *data_shape)
    if true_num_host_transfers is not None:
        out = out[:true_num_host_transfers]
    out = out.reshape(-1, tp, *data_shape)
    return out[:, 0] if tp_identical else out


def pad_axis(x: np.ndarray, n: int, axis: int, value: int | float = 0) -> np.ndarray:
    """Pad the end of ``axis`` with ``value`` up to length ``n``."""
    x = np.asarray(x)
    axis = handle_negative_axis(x, axis)
    if x.shape[axis] > n:
        raise ValueError(f"pad_axis: axis {axis} already has length {x.shape[axis]} > n={n}")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return np.pad(x, widths, constant_values=value)


def squeeze_safe(x: np.ndarray, axis: int | Sequence[int] | None = None) -> np.ndarray:
    """``np.squeeze`` that leaves the listed axes whose length is not 1 alone instead of raising."""
    x = np.asarray(x)
    if axis is None:
        return np.squeeze(x)
    axes = [axis] if isinstance(axis, int) else list(axis)
    for ax in sorted({handle_negative_axis(x, a) for a in axes}, reverse=True):
        if x.shape[ax] == 1:
            x = np.squeeze(x, axis=ax)
    return x
