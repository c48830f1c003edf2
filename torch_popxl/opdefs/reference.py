"""Helpers of the per-replica reference semantics that every op stanza writes.

Each stanza's ``reference`` function is the specification its C++ kernel is tested against,
written straight from popxl.md §2.1 (groupings), §4 (remote buffers) and §5 (collectives)
with explicit loops over groups and members; it favours being obviously right over being fast.
It takes a Python list with one tensor per replica, indexed by the global replica number r, and
returns a new list in the same layout. The helpers here are what those loops share.
"""

from __future__ import annotations

import torch

from .reduce_ops import reference_reduce as reduce

__all__ = ["filled", "flat_padded", "group_of", "groups", "index_in_group", "reduce"]


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


def index_in_group(replica, group_size: int, stride: int):
    """i(r) = (r % (S*G)) // S: the member index of replica r inside its group (an int or an
    integer tensor of replicas)."""
    if group_size == 1:
        stride = 1
    return (replica % (stride * group_size)) // stride


def group_of(replica, group_size: int, stride: int):
    """g(r) = (r // (S*G)) * S + r % S: the group of replica r (an int or an integer tensor
    of replicas), numbered as ``groups`` numbers them."""
    if group_size == 1:
        stride = 1
    return (replica // (stride * group_size)) * stride + replica % stride


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
