"""Helpers of the per-replica reference semantics that every op stanza writes.

Each stanza's ``reference`` function is the specification its C++ kernel is tested against,
written straight from popxl.md §2.1 (groupings), §4 (remote buffers) and §5 (collectives)
with explicit loops over groups and members; it favours being obviously right over being fast.
It takes a Python list with one tensor per replica, indexed by the global replica number r, and
returns a new list in the same layout. The helpers here are what those loops share.
"""

from __future__ import annotations

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


def reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
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


def filled(out: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``out`` once every replica's entry is set (the groups partition the replicas)."""
    done = [t for t in out if t is not None]
    assert len(done) == len(out), "the groups do not cover every replica"
    return done


def flat_padded(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """x flattened and zero-padded at the end to G * ceil(n / G) elements, and the chunk size."""
    flat = x.reshape(-1)
    chunk = -(-flat.numel() // group_size)  # ceil(n / G)
    padding = torch.zeros(group_size * chunk - flat.numel(), dtype=x.dtype, device=x.device)
    return torch.cat([flat, padding]), chunk
