"""Batching rules for the aten ops torch's vmap has none for.

Note [aten batching rules]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A fragment with an op the project has no stacked rule for is traced once under
``torch.func.vmap`` (Note [vmap traced once], runtime/executor.py), so torch's own batching
rules write its stacked program. For an op torch has no rule for, vmap's fallback calls the op
once per replica and stacks the results: correct, but R calls at every step (``explain()``
lists them). This table gives those ops a rule: one formulation over the leading replica
dimension, registered as the op's ``FuncTorchBatched`` kernel, which is where torch's own
C++ rules sit, so vmap (and the trace of it) picks it up like any other.

A rule sees every tensor argument stacked, ``[R, *per-replica shape]`` (a replica-invariant
argument expanded, no copy), and returns its outputs stacked the same way. The formulations:

* ops whose kernels take a batch dimension already (pooling, unpooling, interpolation, margin
  losses, CPU flash attention, ``linalg``): the replicas are folded into it,
  ``[R, N, ...] -> [R * N, ...]``;
* indexing and scatter ops over flattened values (``take``, ``put``, ``index_reduce``,
  ``masked_scatter``, ``histc``): each replica's indices shifted by ``r * n`` so that one call
  of the op, or of ``gather``/``scatter_add``, covers every replica and rows never mix; an index
  out of its replica's range is sent out of the whole range, so the op raises as eager does;
* ops with a dimension argument where the replica dimension is one more (``segment_reduce``,
  ``_trilinear``, ``unfold_backward``, ``_chunk_cat``);
* the rest by their definition on stacked rows (``isin`` a broadcast compare, ``renorm`` a
  norm over the per-replica dimensions, ``pdist`` the norms of row pairs, weight norm's
  gradient).

A rule that meets arguments it does not cover (``_NotCovered``) calls the op once per replica,
as vmap's fallback would; runtime/executor.py's ``_per_replica_loops`` still finds such loops
(``COVERED`` names the table's ops), so ``explain()`` stays honest. The rules are checked by
the OpInfo sweep (tests/test_opinfo_sweep.py) against eager torch per replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C import _functorch

__all__ = ["COVERED"]

aten = torch.ops.aten


class _NotCovered(Exception):
    """The rule does not cover these arguments: the op runs once per replica."""


def _call(op, values: list) -> Any:
    """``op`` on its schema's arguments in order (keyword-only ones passed by name)."""
    schema = op._schema.arguments
    args = [v for a, v in zip(schema, values, strict=True) if not a.kwarg_only]
    kwargs = {a.name: v for a, v in zip(schema, values, strict=True) if a.kwarg_only}
    return op(*args, **kwargs)


def _align(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A stacked ``[R, ...]`` value with size-1 dimensions after ``R`` up to ``rank``: the
    per-replica shapes then broadcast as they do per replica."""
    while t.dim() < rank:
        t = t.unsqueeze(1)
    return t


# --- folding the replicas into the op's own batch dimension --------------------------------


def _fold(t: torch.Tensor, unbatched_rank: int) -> tuple[torch.Tensor, bool]:
    """``[R, N, ...] -> [R * N, ...]``; a per-replica value without ``N`` (rank
    ``unbatched_rank``) gets ``N = 1``. Also says whether it had no ``N``."""
    no_n = t.dim() - 1 == unbatched_rank
    if no_n:
        t = t.unsqueeze(1)
    return t.flatten(0, 1), no_n


def _unfold(t: torch.Tensor, R: int, no_n: bool) -> torch.Tensor:
    t = t.unflatten(0, (R, -1))
    return t.squeeze(1) if no_n else t


def _folding(ranks: dict[int, int], sizes_arg: int | None = None) -> Callable:
    """A rule for ``op`` whose tensor arguments at ``ranks``' positions have a leading batch
    dimension (optional: ``ranks`` gives their rank without it; the first one's decides the
    outputs'); ``sizes_arg``: the position of an ``input_size`` list that names that batch
    dimension (backward kernels)."""

    def rule(op, R: int, args: list, batched: list[bool]) -> Any:
        if any(b and i not in ranks for i, b in enumerate(batched)):
            raise _NotCovered
        folded = {i: _fold(args[i], rank) for i, rank in ranks.items()}
        no_n = folded[next(iter(ranks))][1]
        values = [folded[i][0] if i in folded else a for i, a in enumerate(args)]
        if sizes_arg is not None:
            sizes = list(values[sizes_arg])
            values[sizes_arg] = [R * sizes[0], *sizes[1:]]
        out = _call(op, values)
        if isinstance(out, tuple):
            return tuple(_unfold(o, R, no_n) for o in out)
        return _unfold(out, R, no_n)

    return rule


def _leading_batch(core_ranks: dict[int, int]) -> Callable:
    """A rule for ``op`` whose tensor arguments take any leading batch dimensions (``linalg``):
    the replica dimension is one more, each argument's batch dimensions aligned to the others'
    (``core_ranks``: the rank of each argument without them)."""

    def rule(op, R: int, args: list, batched: list[bool]) -> Any:
        values = list(args)
        most = max(values[i].dim() - core for i, core in core_ranks.items())
        for i, core in core_ranks.items():
            values[i] = _align(values[i], most + core)
        return _call(op, values)

    return rule


def _flash_attention(n_tensors: int, mask_arg: int) -> Callable:
    """CPU flash attention (forward: q, k, v; backward: grad, q, k, v, out, logsumexp), whose
    tensors all lead with the batch ``B``: the replicas fold into it. The mask, per replica
    broadcast against ``[B, H, L, S]``, is expanded over ``B`` first so that each replica's
    rows keep their own mask."""

    def rule(op, R: int, args: list, batched: list[bool]) -> tuple:
        values = [t.flatten(0, 1) for t in args[:n_tensors]] + list(args[n_tensors:])
        mask = args[mask_arg]
        if mask is not None:
            mask = _align(mask, 5)
            mask = mask.expand(R, args[1].shape[1], *mask.shape[2:])
            values[mask_arg] = mask.flatten(0, 1)
        return tuple(o.unflatten(0, (R, -1)) for o in _call(op, values))

    return rule


def _class_weight(weight: torch.Tensor | None, batched: bool) -> torch.Tensor | None:
    if batched:
        raise _NotCovered  # a class weight per replica
    return None if weight is None else weight[0]


def _one_class(x: torch.Tensor, target: torch.Tensor, target_rank: int):
    """A 0-d input per replica, as eager reads it: one sample of one class."""
    return x.unsqueeze(1), (target.unsqueeze(1) if target_rank == 1 else target)


def _margin_loss(target_rank: int) -> Callable:
    """``multi_margin_loss`` / ``multilabel_margin_loss_forward``: per sample with the
    reduction left out, folded, then reduced per replica as eager reduces."""

    def rule(op, R: int, args: list, batched: list[bool]) -> Any:
        values = list(args)
        if values[0].dim() == 1:  # a 0-d input per replica: one class
            values[0], values[1] = _one_class(values[0], values[1], target_rank)
            out = rule(op, R, values, batched)
            return (out[0], out[1].reshape(R)) if isinstance(out, tuple) else out
        if op is aten.multi_margin_loss.default:
            values[4] = _class_weight(values[4], batched[4])
        x, no_n = _fold(values[0], 1)
        y, _ = _fold(values[1], target_rank)
        reduction = values[-1]
        out = op(x, y, *values[2:-1], 0)
        loss, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        loss = loss.unflatten(0, (R, -1))
        if reduction == 1:
            loss = loss.mean(1)
        elif reduction == 2:
            loss = loss.sum(1)
        elif no_n:
            loss = loss.squeeze(1)
        rest = tuple(_unfold(t, R, no_n) for t in rest)
        return (loss, *rest) if rest else loss

    return rule


def _margin_loss_backward(target_rank: int, reduction_arg: int) -> Callable:
    """The margin losses' gradients: each replica's seed spread over its samples as the
    reduction did, then the unreduced gradient folded."""

    def rule(op, R: int, args: list, batched: list[bool]) -> Any:
        values = list(args)
        if values[1].dim() == 1:  # a 0-d input per replica: one class
            values[1], values[2] = _one_class(values[1], values[2], target_rank)
            values[4:] = [v.unsqueeze(1) if i > reduction_arg else v
                          for i, v in enumerate(values[4:], 4)]  # fmt: skip
            return rule(op, R, values, batched).reshape(R)
        if op is aten.multi_margin_loss_backward.default:
            values[5] = _class_weight(values[5], batched[5])
        grad, reduction = values[0], values[reduction_arg]
        x, no_n = _fold(values[1], 1)
        y, _ = _fold(values[2], target_rank)
        n = x.shape[0] // R
        if reduction == 0:
            g = grad.reshape(R * n)
        else:
            g = (grad.reshape(R, 1).expand(R, n) / (n if reduction == 1 else 1)).reshape(R * n)
        values[:3] = [g, x, y]
        values[reduction_arg] = 0
        for i in range(reduction_arg + 1, len(values)):  # multilabel's is_target, as the input
            values[i] = _fold(values[i], 1)[0]
        return _unfold(op(*values), R, no_n)

    return rule


def _soft_margin_loss(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    x, y, reduction = args
    loss = aten.soft_margin_loss.default(x, y, 0)
    if reduction == 0:
        return loss
    loss = loss.reshape(R, -1)
    return loss.mean(1) if reduction == 1 else loss.sum(1)


# --- indices shifted by each replica's row -------------------------------------------------


def _row_offsets(index: torch.Tensor, n: int, wrap: bool) -> torch.Tensor:
    """``index`` ([R, ...], into rows of ``n``) as indices into the ``[R * n]`` concatenation:
    negative ones wrapped where the op allows them; out-of-range ones sent past the end, so
    the op raises as it does per replica."""
    R = index.shape[0]
    if wrap:
        index = torch.where(index < 0, index + n, index)
    ok = (index >= 0) & (index < n)
    rows = torch.arange(R, device=index.device).reshape(R, *([1] * (index.dim() - 1)))
    return torch.where(ok, index + rows * n, R * n)


def _take(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    x, index = args
    return x.reshape(-1)[_row_offsets(index, x[0].numel(), wrap=True)]


def _put(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    x, index, source, accumulate = args
    rows = _row_offsets(index.reshape(R, -1), x[0].numel(), wrap=True).reshape(-1)
    out = aten.put.default(x.reshape(-1), rows, source.reshape(-1), accumulate)
    return out.reshape(x.shape)


def _index_reduce(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    x, dim, index, source, reduce, include_self = args
    if x.dim() == 1:  # a 0-d value per replica: as one of one element
        one = [x.unsqueeze(1), dim, index, _align(source, 2), reduce, include_self]
        return _index_reduce(op, R, one, batched).squeeze(1)
    d = dim % (x.dim() - 1) + 1
    n, k = x.shape[d], source.shape[d]
    flat_x = x.movedim(d, 1).flatten(0, 1)
    flat_source = source.movedim(d, 1).flatten(0, 1)
    rows = _row_offsets(index.reshape(R, k), n, wrap=False).reshape(-1)
    out = aten.index_reduce.default(flat_x, 0, rows, flat_source, reduce,
                                    include_self=include_self)  # fmt: skip
    return out.unflatten(0, (R, n)).movedim(1, d)


def _masked_positions(mask: torch.Tensor) -> torch.Tensor:
    """For each True of ``mask`` ([R, n]), its rank among its row's Trues."""
    return mask.to(torch.int64).cumsum(1) - 1


def _broadcast(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two stacked values broadcast as their per-replica values do."""
    rank = max(a.dim(), b.dim())
    a, b = torch.broadcast_tensors(_align(a, rank), _align(b, rank))
    return a, b


def _masked_scatter(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    x, mask, source = args
    x, mask = _broadcast(x, mask)
    flat_mask = mask.reshape(R, -1)
    src = source.reshape(R, -1)
    picked = _row_offsets(_masked_positions(flat_mask), src.shape[1], wrap=False)
    picked = torch.where(flat_mask, picked, 0)  # unmasked positions read any valid element
    values = src.reshape(-1)[picked]
    return torch.where(flat_mask, values, x.reshape(R, -1)).reshape(x.shape)


def _masked_scatter_backward(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    grad, mask, sizes = args
    grad, mask = _broadcast(grad, mask)
    flat_mask, flat_grad = mask.reshape(R, -1), grad.reshape(R, -1)
    numel = 1
    for s in sizes:
        numel *= s
    # masked elements past the source's size (eager refuses them) go to a dropped column
    slot = torch.where(flat_mask, _masked_positions(flat_mask).clamp(max=numel), numel)
    out = flat_grad.new_zeros(R, numel + 1).scatter(1, slot, flat_grad)
    return out[:, :numel].reshape(R, *sizes)


def _histc(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    x, bins, lo, hi = args
    flat = x.reshape(R, -1)
    if lo == hi:  # eager's range: the values' own, widened by 1 each side when one value
        low, high = flat.amin(1, keepdim=True), flat.amax(1, keepdim=True)
        same = low == high
        low, high = torch.where(same, low - 1, low), torch.where(same, high + 1, high)
    else:
        low = torch.full((R, 1), float(lo), dtype=x.dtype, device=x.device)
        high = torch.full((R, 1), float(hi), dtype=x.dtype, device=x.device)
    inside = (flat >= low) & (flat <= high)
    pos = ((flat - low) * bins / (high - low)).to(torch.int64).clamp(0, bins - 1)
    pos = torch.where(inside, pos, bins)  # outside the range: a dropped column
    counts = flat.new_zeros(R, bins + 1).scatter_add(1, pos, inside.to(x.dtype))
    return counts[:, :bins]


def _histogram(op, R: int, args: list, batched: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both overloads (a bin count, or given edges): each replica's edges, then its values'
    bins by a search of the edges (eager's local search gives the same bins)."""
    if op is aten.histogram.bin_ct:
        x, bins, limits, weight, density = args
        edges = _histogram_edges(x.reshape(R, -1), bins, limits)
    else:
        x, edges, weight, density = args
        bins = edges.shape[1] - 1
    flat = x.reshape(R, -1)
    pos = torch.searchsorted(edges.contiguous(), flat.contiguous(), right=True) - 1
    pos = torch.where(flat == edges[:, -1:], bins - 1, pos)  # the last bin holds its right edge
    inside = (flat >= edges[:, :1]) & (flat <= edges[:, -1:])
    pos = torch.where(inside, pos, bins)  # outside the range: a dropped column
    w = torch.ones_like(flat) if weight is None else weight.reshape(R, -1)
    hist = flat.new_zeros(R, bins + 1).scatter_add(1, pos, torch.where(inside, w, 0))[:, :bins]
    if density:
        hist = hist / (hist.sum(1, keepdim=True) * edges.diff(dim=1))
    return hist, edges


def _histogram_edges(flat: torch.Tensor, bins: int, limits) -> torch.Tensor:
    """``bins + 1`` edges per row over ``limits`` or the row's own range (widened by 0.5 each
    side where it is one value), spaced as eager's ``linspace`` spaces them."""
    R = flat.shape[0]
    if limits is None:
        low, high = flat.amin(1, keepdim=True), flat.amax(1, keepdim=True)
    else:
        low = torch.full((R, 1), float(limits[0]), dtype=flat.dtype, device=flat.device)
        high = torch.full((R, 1), float(limits[1]), dtype=flat.dtype, device=flat.device)
    same = low == high
    low, high = torch.where(same, low - 0.5, low), torch.where(same, high + 0.5, high)
    step = (high - low) / bins
    k = torch.arange(bins + 1, device=flat.device, dtype=flat.dtype)
    # linspace's two halves: from the start, then back from the end
    return torch.where(k < (bins + 1) // 2, low + step * k, high - step * (bins - k))


def _lead(t: torch.Tensor | None, data: torch.Tensor, axis: int) -> torch.Tensor | None:
    """Per-replica ``lengths``/``offsets`` ([R, ..., S]) with the data's dimensions before
    ``axis`` in front, as segment_reduce takes them for a reduction over ``axis``."""
    if t is None:
        return None
    lead = tuple(data.shape[:axis])
    return _align(t, len(lead) + 1).expand(*lead, t.shape[-1])


def _segment_reduce(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    data, reduce, lengths, indices, offsets, axis, unsafe, initial = args
    if indices is not None:
        raise _NotCovered
    a = axis % (data.dim() - 1) + 1
    return aten.segment_reduce.default(data, reduce, lengths=_lead(lengths, data, a),
                                       offsets=_lead(offsets, data, a), axis=a, unsafe=unsafe,
                                       initial=initial)  # fmt: skip


def _segment_reduce_backward(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    grad, output, data, reduce, lengths, offsets, axis, initial = args
    a = axis % (data.dim() - 1) + 1
    return aten._segment_reduce_backward.default(grad, output, data, reduce,
                                                 lengths=_lead(lengths, data, a),
                                                 offsets=_lead(offsets, data, a), axis=a,
                                                 initial=initial)  # fmt: skip


def _embedding_bag(op, R: int, args: list, batched: list[bool]) -> tuple:
    """``_embedding_bag`` (and its forward-only form): every replica's bags as bags of one call,
    its indices (into a table per replica: shifted by ``_row_offsets``) and offsets shifted by
    its row; the results that number bags or table rows get their shifts back. A last offset
    that closes the bags, or a padding index into tables per replica, is not covered."""
    weight, indices, offsets, scale, mode, sparse, psw, last, padding_idx = args
    if last or (batched[0] and padding_idx >= 0):
        raise _NotCovered
    rows, n, bags = weight.shape[1], indices.shape[1], offsets.shape[1]
    shift = torch.arange(R, device=indices.device).reshape(R, 1)
    if batched[0]:
        table, ids = weight.flatten(0, 1), _row_offsets(indices, rows, wrap=False)
    else:
        table, ids = weight[0], indices
    psw = None if psw is None else psw.reshape(-1)
    out, offset2bag, bag_size, max_indices = _call(op, [
        table, ids.reshape(-1), (offsets + shift * n).reshape(-1), scale, mode, sparse, psw,
        last, padding_idx,
    ])  # fmt: skip
    if offset2bag.numel():
        offset2bag = offset2bag.reshape(R, n) - shift * bags
    else:
        offset2bag = offset2bag.new_empty(R, 0)
    bag_size = bag_size.reshape(R, bags)
    max_indices = max_indices.reshape(R, bags, *max_indices.shape[1:])
    if mode == 2 and batched[0]:  # a max's table rows (an empty bag's 0 stays)
        filled = bag_size.unsqueeze(2) > 0
        max_indices = torch.where(filled, max_indices - shift.unsqueeze(2) * rows, max_indices)
    return out.reshape(R, bags, -1), offset2bag, bag_size, max_indices


# --- definitions on stacked rows ------------------------------------------------------------


def _isin(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    elements, test, _, invert = args  # assume_unique: a hint for eager's sorting kernel
    found = (elements.reshape(R, -1, 1) == test.reshape(R, 1, -1)).any(-1)
    found = found.reshape(elements.shape)
    return ~found if invert else found


def _renorm(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    x, p, dim, maxnorm = args
    if x.dim() == 1:
        raise _NotCovered
    d = dim % (x.dim() - 1) + 1
    dims = [i for i in range(1, x.dim()) if i != d]
    # eager's formula: each slice rescaled where its norm exceeds maxnorm
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    norm = torch.linalg.vector_norm(x, p, dims, keepdim=True, dtype=acc)
    factor = torch.where(norm > maxnorm, maxnorm / (norm + 1e-7), 1.0)
    return x * factor.to(x.dtype)


def _trilinear(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    i1, i2, i3, e1, e2, e3, sumdim, unroll = args
    shift = [[d + 1 for d in dims] for dims in (e1, e2, e3, sumdim)]
    return aten._trilinear.default(i1, i2, i3, *shift, unroll + 1)


def _unfold_backward(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    grad, sizes, dim, size, step = args
    if not sizes:  # a 0-d input per replica unfolds as one of one element
        one = aten.unfold_backward.default(grad.reshape(R, 1, 1), [R, 1], 1, size, step)
        return one.reshape(R)
    d = dim % len(sizes) + 1
    return aten.unfold_backward.default(grad, [R, *sizes], d, size, step)


def _chunk_cat(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    tensors, dim, num_chunks = args
    d = dim % (tensors[0].dim() - 1) + 1
    return aten._chunk_cat.default(tensors, d, num_chunks)


def _pdist(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    x, p = args
    n = x.shape[1]
    i, j = torch.triu_indices(n, n, 1, device=x.device)
    return torch.linalg.vector_norm(x[:, i] - x[:, j], p, dim=-1)


def _pdist_backward(op, R: int, args: list, batched: list[bool]) -> torch.Tensor:
    """The gradient of each pair's distance (eager's formula for each p), added to the
    pair's first row and taken from its second."""
    grad, x, p, dist = args
    n = x.shape[1]
    i, j = torch.triu_indices(n, n, 1, device=x.device)
    diff = x[:, i] - x[:, j]
    g, d = grad.unsqueeze(-1), dist.unsqueeze(-1)
    if p == 0:
        part = torch.zeros_like(diff)
    elif p == 1:
        part = g * diff.sign()
    elif p == 2:
        part = torch.where(d == 0, 0.0, g * diff / d)
    elif p == float("inf"):
        part = g * diff.sign() * (diff.abs() == d)
    elif p < 2:
        part = diff.sign() * diff.abs().pow(p - 1) * g / d.pow(p - 1)
        part = torch.where((d == 0) | ((diff == 0) & (p < 1)), 0.0, part)
    else:
        part = torch.where(d == 0, 0.0, diff * diff.abs().pow(p - 2) * g / d.pow(p - 1))
    return torch.zeros_like(x).index_add(1, i, part).index_add(1, j, -part)


def _weight_norm_backward(op, R: int, args: list, batched: list[bool]) -> tuple:
    """``_weight_norm_interface_backward`` (``w = g * v / ||v||``, the norm over every
    per-replica dimension but ``dim``; weight_norm's gradient, as in wav2vec2's positional
    convolution): eager's formula with the norms over each replica's own dimensions."""
    grad_w, v, g, norms, dim = args
    d = dim % (v.dim() - 1) + 1
    dims = [i for i in range(1, v.dim()) if i != d]
    acc = norms.dtype  # float32 for 16-bit weights, as eager accumulates
    grad_w, v32, g32 = grad_w.to(acc), v.to(acc), g.to(acc)
    grad_g = (grad_w * v32).sum(dims, keepdim=True) / norms
    grad_v = (g32 / norms) * (grad_w - v32 * (grad_g / norms))
    return grad_v.to(v.dtype), grad_g.to(g.dtype)


# --- the table --------------------------------------------------------------------------------

RULES: dict[Any, Callable[[Any, int, list, list[bool]], Any]] = {
    # folded into the op's batch dimension ({argument: its rank without one}); max pooling's
    # indices are positions within each image's plane, so folding keeps them
    aten.max_unpool2d.default: _folding({0: 3, 1: 3}),
    aten.max_unpool3d.default: _folding({0: 4, 1: 4}),
    aten.fractional_max_pool2d.default: _folding({0: 3, 3: 2}),
    aten.fractional_max_pool3d.default: _folding({0: 4, 3: 2}),
    aten.fractional_max_pool2d_backward.default: _folding({0: 3, 1: 3, 4: 3}),
    aten.fractional_max_pool3d_backward.default: _folding({0: 4, 1: 4, 4: 4}),
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention(3, 5),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_attention(6, 8),
    aten._upsample_nearest_exact1d.default: _folding({0: 2}),
    aten._upsample_nearest_exact2d.default: _folding({0: 3}),
    aten._upsample_nearest_exact3d.default: _folding({0: 4}),
    aten._upsample_nearest_exact1d_backward.default: _folding({0: 2}, sizes_arg=2),
    aten._upsample_nearest_exact2d_backward.default: _folding({0: 3}, sizes_arg=2),
    aten._upsample_nearest_exact3d_backward.default: _folding({0: 4}, sizes_arg=2),
    aten.multi_margin_loss.default: _margin_loss(0),
    aten.multi_margin_loss_backward.default: _margin_loss_backward(0, 6),
    aten.multilabel_margin_loss_forward.default: _margin_loss(1),
    aten.multilabel_margin_loss_backward.default: _margin_loss_backward(1, 3),
    aten.soft_margin_loss.default: _soft_margin_loss,
    aten.linalg_lu.default: _leading_batch({0: 2}),
    aten.linalg_ldl_solve.default: _leading_batch({0: 2, 1: 1, 2: 2}),
    aten.ormqr.default: _leading_batch({0: 2, 1: 1, 2: 2}),
    # indices shifted by each replica's row
    aten.take.default: _take,
    aten.put.default: _put,
    aten.index_reduce.default: _index_reduce,
    aten.masked_scatter.default: _masked_scatter,
    aten.masked_scatter_backward.default: _masked_scatter_backward,
    aten.histc.default: _histc,
    aten.histogram.bin_ct: _histogram,
    aten.histogram.bins_tensor: _histogram,
    aten.segment_reduce.default: _segment_reduce,
    aten._segment_reduce_backward.default: _segment_reduce_backward,
    # definitions on stacked rows
    aten.isin.Tensor_Tensor: _isin,
    aten.renorm.default: _renorm,
    aten._trilinear.default: _trilinear,
    aten.unfold_backward.default: _unfold_backward,
    aten._pdist_forward.default: _pdist,
    aten._pdist_backward.default: _pdist_backward,
    aten._weight_norm_interface_backward.default: _weight_norm_backward,
    aten._chunk_cat.default: _chunk_cat,
    aten._embedding_bag.default: _embedding_bag,
    aten._embedding_bag_forward_only.default: _embedding_bag,
}
COVERED = frozenset(RULES)


# --- registration ----------------------------------------------------------------------------

_BATCHED = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)


def _arguments(op, args: tuple, kwargs: dict) -> list:
    """Every argument of ``op``'s schema, in order, defaults filled in."""
    schema = op._schema.arguments
    return [args[i] if i < len(args) else kwargs[a.name] if a.name in kwargs else a.default_value
            for i, a in enumerate(schema)]  # fmt: skip


def _kernel(op, rule: Callable) -> Callable:
    """``rule`` as ``op``'s vmap kernel: arguments unwrapped at the current vmap level (the
    replica dimension moved to the front, replica-invariant tensors expanded), outputs
    wrapped back, as torch's C++ plumbing does for its own rules."""

    def kernel(*args, **kwargs):
        level = _functorch.maybe_current_level()
        values = _arguments(op, args, kwargs)
        rows = [_unwrap(v, level) for v in values]
        R = next((n for _, n in rows if n is not None), None)
        values = [v for v, _ in rows]
        batched = [n is not None for _, n in rows]
        with torch._C._ExcludeDispatchKeyGuard(_BATCHED):
            if R is None:  # nothing batched at this level
                return _call(op, values)
            stacked = [_expand(v, R) if not b else v for v, b in zip(values, batched, strict=True)]
            try:
                out = rule(op, R, stacked, batched)
            except _NotCovered:
                out = _per_replica(op, values, batched, R)
        if isinstance(out, tuple):
            return tuple(_functorch._add_batch_dim(o, 0, level) for o in out)
        return _functorch._add_batch_dim(out, 0, level)

    return kernel


def _unwrap(v: Any, level: int) -> tuple[Any, int | None]:
    """An argument's value with the replica dimension (if batched at ``level``) in front, and
    the number of replicas (None: not batched). A list with a batched tensor has every tensor
    stacked."""
    if isinstance(v, torch.Tensor):
        inner, bdim = _functorch._unwrap_batched(v, level)
        return (v, None) if bdim is None else (inner.movedim(bdim, 0), inner.shape[bdim])
    if isinstance(v, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in v):
        items = [_unwrap(e, level) for e in v]
        R = next((n for _, n in items if n is not None), None)
        if R is None:
            return v, None
        return [e if n is not None else _expand(e, R) for e, n in items], R
    return v, None


def _expand(v: Any, R: int) -> Any:
    return v.expand(R, *v.shape) if isinstance(v, torch.Tensor) else v


def _per_replica(op, values: list, batched: list[bool], R: int) -> Any:
    """vmap's fallback: the op on each replica's row, stacked."""

    def row(v: Any, r: int) -> Any:
        return [e[r] for e in v] if isinstance(v, list) else v[r]

    outs = [_call(op, [row(v, r) if b else v for v, b in zip(values, batched, strict=True)])
            for r in range(R)]  # fmt: skip
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(o) for o in zip(*outs, strict=True))
    return torch.stack(outs)


_lib = torch.library.Library("aten", "IMPL")
for _op, _rule in RULES.items():
    _lib.impl(_op, _kernel(_op, _rule), "FuncTorchBatched")
