"""Reference semantics of the collectives and remote-buffer ops, one replica at a time.

This module is the specification that the C++ kernels in ``csrc/`` are tested against. It is
written straight from popxl.md §2.1 (groupings), §4 (remote buffers) and §5 (collectives)
with explicit loops over groups and members, and favours being obviously right over being
fast.

Every function takes a Python list with one tensor per replica, indexed by the global replica
number r, and returns a new list in the same layout.
"""

from __future__ import annotations

import math

import torch

VALID_OPS = ("add", "mean", "mul", "min", "max", "and", "or", "square_add")


def groups(num_replicas: int, group_size: int, stride: int) -> list[list[int]]:
    """The replicas of every group, members in ascending replica order (popxl.md §2.1).

    Group g holds ``rep(g, i) = (g // S) * (S*G) + (g % S) + i*S`` for ``i = 0..G-1``.
    """
    if group_size < 1 or stride < 1:
        raise ValueError(f"group_size and stride must be >= 1, got {group_size=}, {stride=}")
    if group_size == 1:
        stride = 1  # PopXL forces the stride to 1 for singleton groups
    if num_replicas < 1 or num_replicas % (group_size * stride) != 0:
        raise ValueError(
            f"the grouping (group_size={group_size}, stride={stride}) does not tile "
            f"R={num_replicas} replicas; R must be a multiple of group_size*stride"
        )
    result = []
    for g in range(num_replicas // group_size):
        first = (g // stride) * (stride * group_size) + (g % stride)
        result.append([first + i * stride for i in range(group_size)])
    return result


def index_in_group(replica: int, group_size: int, stride: int) -> int:
    """i(r) = (r % (S*G)) // S: the member index of replica r inside its group."""
    if group_size == 1:
        return 0
    return (replica % (stride * group_size)) // stride


def _reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
    """Elementwise reduction of the members' values, in x's dtype."""
    if op not in VALID_OPS:
        raise ValueError(f"unknown op {op!r}; valid ops are {VALID_OPS}")
    dtype = values[0].dtype
    if dtype == torch.bool and op in ("add", "mean", "mul", "square_add"):
        raise TypeError(f"op {op!r} needs a numeric dtype, got bool")
    count = len(values)

    # Floating-point sums are accumulated in float64 and rounded to x's dtype once, so the
    # reference is the ideal result. Integer sums stay in x's dtype and wrap on overflow, as
    # integer hardware does.
    wide = torch.float64 if dtype.is_floating_point else dtype
    if op == "add":
        total = values[0].to(wide)
        for v in values[1:]:
            total = total + v.to(wide)
        return total.to(dtype)
    if op == "square_add":
        total = values[0].to(wide) * values[0].to(wide)
        for v in values[1:]:
            total = total + v.to(wide) * v.to(wide)
        return total.to(dtype)
    if op in ("mean", "mul"):  # PopXL maps 'mul' to MEAN (popxl.md §5)
        if dtype.is_floating_point:
            total = values[0].to(wide)
            for v in values[1:]:
                total = total + v.to(wide)
            return (total / count).to(dtype)
        # Integer mean: exact int64 sum, then division truncating toward zero.
        total = values[0].to(torch.int64)
        for v in values[1:]:
            total = total + v.to(torch.int64)
        return torch.div(total, count, rounding_mode="trunc").to(dtype)
    if op == "min":
        result = values[0].clone()
        for v in values[1:]:
            result = torch.minimum(result, v)
        return result
    if op == "max":
        result = values[0].clone()
        for v in values[1:]:
            result = torch.maximum(result, v)
        return result
    if op == "and":
        result = values[0] != 0
        for v in values[1:]:
            result = result & (v != 0)
        return result.to(dtype)
    # op == "or"
    result = values[0] != 0
    for v in values[1:]:
        result = result | (v != 0)
    return result.to(dtype)


def _filled(out: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``out`` once every replica's entry is set (the groups partition the replicas)."""
    filled = [t for t in out if t is not None]
    assert len(filled) == len(out), "the groups do not cover every replica"
    return filled


def all_reduce(xs: list[torch.Tensor], op: str, group_size: int, stride: int) -> list[torch.Tensor]:
    """Every member of a group receives the reduction of all members' values."""
    out: list[torch.Tensor | None] = [None] * len(xs)
    for members in groups(len(xs), group_size, stride):
        reduced = _reduce([xs[m] for m in members], op)
        for m in members:
            out[m] = reduced.clone()
    return _filled(out)


def all_gather(xs: list[torch.Tensor], group_size: int, stride: int) -> list[torch.Tensor]:
    """Every member receives ``[G, *shape]``: row i is member i's value."""
    out: list[torch.Tensor | None] = [None] * len(xs)
    for members in groups(len(xs), group_size, stride):
        gathered = torch.stack([xs[m] for m in members])
        for m in members:
            out[m] = gathered.clone()
    return _filled(out)


def _flat_padded(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """x flattened and zero-padded at the end to G * ceil(n / G) elements, and the chunk size."""
    flat = x.reshape(-1)
    chunk = -(-flat.numel() // group_size)  # ceil(n / G)
    padding = torch.zeros(group_size * chunk - flat.numel(), dtype=x.dtype, device=x.device)
    return torch.cat([flat, padding]), chunk


def reduce_scatter(
    xs: list[torch.Tensor], op: str, group_size: int, stride: int
) -> list[torch.Tensor]:
    """Flatten, zero-pad, reduce over the group, and give member i chunk i (popxl.md §5.2).

    ``op == "local"`` does no reduction: each replica takes chunk i of its *own* padded input
    (popxl.md §5.3).
    """
    out: list[torch.Tensor | None] = [None] * len(xs)
    for members in groups(len(xs), group_size, stride):
        padded = []
        for m in members:
            p, chunk = _flat_padded(xs[m], group_size)
            padded.append(p)
        if op == "local":
            for i, m in enumerate(members):
                out[m] = padded[i][i * chunk : (i + 1) * chunk].clone()
        else:
            reduced = _reduce(padded, op)
            for i, m in enumerate(members):
                out[m] = reduced[i * chunk : (i + 1) * chunk].clone()
    return _filled(out)


def take_own(xs: list[torch.Tensor], group_size: int, stride: int) -> list[torch.Tensor]:
    """Each replica keeps row i(r) of its own ``[G, *shape]`` value (the grad of all_gather)."""
    groups(len(xs), group_size, stride)  # validates the grouping
    out = []
    for r, x in enumerate(xs):
        if x.shape[0] != group_size:
            raise ValueError(f"replica {r}: expected {group_size} rows, got shape {tuple(x.shape)}")
        out.append(x[index_in_group(r, group_size, stride)].clone())
    return out


def _offset_index(buffer: torch.Tensor, offset, replica: int, buffer_id: int | None = None) -> int:
    """``offset`` (an int or a 0-d tensor) as a range-checked Python int.

    The value is read at full width (a Python int has no overflow), so 2**32 is out of range
    rather than wrapping to slot 0; a float offset is a type error that names NaN when it is one.
    """
    which = "a buffer" if buffer_id is None else f"RemoteBuffer[id={buffer_id}]"
    if isinstance(offset, torch.Tensor):
        if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
            nan = " holding NaN" if bool(torch.isnan(offset).any()) else ""
            raise TypeError(
                f"replica {replica}: offsets must be integers, got dtype {offset.dtype}{nan} "
                f"for {which}."
            )
        offset = offset.item()
    if isinstance(offset, float):
        what = "NaN" if math.isnan(offset) else repr(offset)
        raise TypeError(f"replica {replica}: offsets must be integers, got {what} for {which}.")
    offset = int(offset)
    entries = buffer.shape[0]
    if not 0 <= offset < entries:
        raise ValueError(
            f"replica {replica}: offset {offset} is out of range for {which} with {entries} "
            f"entries; offsets must be in [0, {entries})"
        )
    return offset


def remote_load(
    buffers: list[torch.Tensor], offsets: list[int], buffer_id: int | None = None
) -> list[torch.Tensor]:
    """Replica r reads slot ``offsets[r]`` of its own buffer copy ``buffers[r]`` (popxl.md §4.1)."""
    out = []
    for r, (buffer, offset) in enumerate(zip(buffers, offsets, strict=True)):
        out.append(buffer[_offset_index(buffer, offset, r, buffer_id)].clone())
    return out


def remote_store(
    buffers: list[torch.Tensor],
    offsets: list[int],
    values: list[torch.Tensor],
    buffer_id: int | None = None,
) -> None:
    """Replica r writes ``values[r]`` into slot ``offsets[r]`` of its own buffer copy, in place.

    All offsets are checked first, so nothing is written if any is out of range.
    """
    slots = [
        _offset_index(buffer, offset, r, buffer_id)
        for r, (buffer, offset) in enumerate(zip(buffers, offsets, strict=True))
    ]
    for buffer, slot, value in zip(buffers, slots, values, strict=True):
        buffer[slot].copy_(value)
