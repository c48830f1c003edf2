"""Tests for the torch_popxl._C kernels and their Python registrations (the op stanzas in
opdefs/).

The readable reference, each stanza's ``reference`` function, is the specification; the stacked
C++ kernels and the per-replica ops under vmap must agree with it and with the worked numbers
of popxl.md §11.5.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from torch_popxl.opdefs import backends
from torch_popxl.opdefs import reference as ref
from torch_popxl.opdefs._common import VALID_OPS, check_grouping
from torch_popxl.opdefs.all_gather import per_replica as replicated_all_gather
from torch_popxl.opdefs.all_gather import reference as ref_all_gather
from torch_popxl.opdefs.all_reduce import per_replica as replicated_all_reduce
from torch_popxl.opdefs.all_reduce import reference as ref_all_reduce
from torch_popxl.opdefs.reduce_scatter import per_replica as replicated_reduce_scatter
from torch_popxl.opdefs.reduce_scatter import reference as ref_reduce_scatter
from torch_popxl.opdefs.remote import load_per_replica as remote_load
from torch_popxl.opdefs.remote import reference_load as ref_remote_load
from torch_popxl.opdefs.remote import reference_store as ref_remote_store
from torch_popxl.opdefs.remote import store_per_replica as remote_store_
from torch_popxl.opdefs.take_own import per_replica as replicated_take_own
from torch_popxl.opdefs.take_own import reference as ref_take_own

_ops = torch.ops.torch_popxl

ops = torch.ops.torch_popxl

# --------------------------------------------------------------------------------------------
# Worked numbers, popxl.md §11.5: R = 8 replicas, x_r = [r].

GROUPINGS = [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2), (1, 1)]  # (stride, group_size)

ALL_REDUCE_ADD = {
    (1, 2): [1, 1, 5, 5, 9, 9, 13, 13],
    (1, 4): [6, 6, 6, 6, 22, 22, 22, 22],
    (1, 8): [28] * 8,
    (2, 2): [2, 4, 2, 4, 10, 12, 10, 12],
    (2, 4): [12, 16, 12, 16, 12, 16, 12, 16],
    (4, 2): [4, 6, 8, 10, 4, 6, 8, 10],
    (1, 1): list(range(8)),
}

REDUCE_SCATTER_ADD = {
    (1, 2): [1, 0, 5, 0, 9, 0, 13, 0],
    (1, 4): [6, 0, 0, 0, 22, 0, 0, 0],
    (1, 8): [28, 0, 0, 0, 0, 0, 0, 0],
    (2, 2): [2, 4, 0, 0, 10, 12, 0, 0],
    (2, 4): [12, 16, 0, 0, 0, 0, 0, 0],
    (4, 2): [4, 6, 8, 10, 0, 0, 0, 0],
    (1, 1): list(range(8)),
}

# all_gather 'new_axis' values per replica (the spec lists some replicas; the rest follow the
# same pattern), as [G] lists of the gathered x values.
ALL_GATHER = {
    (1, 2): [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]],
    (2, 2): [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]],
    (2, 4): [[0, 2, 4, 6], [1, 3, 5, 7]] * 4,
    (4, 2): [[r % 4, r % 4 + 4] for r in range(8)],
}

# Assignments from popxl.md §2.1 (R = 8).
ASSIGNMENTS = {
    (1, 2): [0, 0, 1, 1, 2, 2, 3, 3],
    (2, 4): [0, 1, 0, 1, 0, 1, 0, 1],
    (4, 2): [0, 1, 2, 3, 0, 1, 2, 3],
    (2, 2): [0, 1, 0, 1, 2, 3, 2, 3],
    (1, 8): [0] * 8,
    (1, 1): list(range(8)),
}


def replica_ids() -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32)[:, None]


def per_replica(fn, *static):
    """vmap a per-replica op over dim 0 of its first argument."""
    return torch.func.vmap(lambda x: fn(x, *static))


@pytest.mark.parametrize(("stride", "group_size"), list(ASSIGNMENTS))
def test_reference_groups_match_spec_assignments(stride, group_size):
    assignment = [None] * 8
    for g, members in enumerate(ref.groups(8, group_size, stride)):
        for i, r in enumerate(members):
            assignment[r] = g
            assert ref.index_in_group(r, group_size, stride) == i
    assert assignment == ASSIGNMENTS[(stride, group_size)]


@pytest.mark.parametrize(("stride", "group_size"), GROUPINGS)
def test_worked_all_reduce_add(stride, group_size):
    x = replica_ids()
    expected = torch.tensor(ALL_REDUCE_ADD[(stride, group_size)], dtype=torch.float32)[:, None]
    stacked = ops.all_reduce_stacked(x, "add", group_size, stride)
    vmapped = per_replica(replicated_all_reduce, "add", group_size, stride)(x)
    reference = torch.stack(ref_all_reduce(list(x), "add", group_size, stride))
    for result in (stacked, vmapped, reference):
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("stride", "group_size"), GROUPINGS)
def test_worked_reduce_scatter_add(stride, group_size):
    x = replica_ids()
    expected = torch.tensor(REDUCE_SCATTER_ADD[(stride, group_size)], dtype=torch.float32)
    expected = expected[:, None]  # output shape (1,) per replica
    stacked = ops.reduce_scatter_stacked(x, "add", group_size, stride)
    vmapped = per_replica(replicated_reduce_scatter, "add", group_size, stride)(x)
    reference = torch.stack(ref_reduce_scatter(list(x), "add", group_size, stride))
    for result in (stacked, vmapped, reference):
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("stride", "group_size"), list(ALL_GATHER))
def test_worked_all_gather_new_axis(stride, group_size):
    x = replica_ids()
    expected = torch.tensor(ALL_GATHER[(stride, group_size)], dtype=torch.float32)[..., None]
    stacked = ops.all_gather_stacked(x, group_size, stride)
    vmapped = per_replica(replicated_all_gather, group_size, stride)(x)
    reference = torch.stack(ref_all_gather(list(x), group_size, stride))
    for result in (stacked, vmapped, reference):
        assert result.shape == (8, group_size, 1)
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Property test: stacked C++ kernels == reference, for random groupings, shapes, dtypes, ops.
#
# Tolerances: int32 must match exactly. float32 uses torch's defaults (rtol 1.3e-6, atol 1e-5);
# the kernels sum in float32 while the reference sums in float64 and rounds once. float16 uses
# rtol 2e-3, atol 1e-2: 'square_add' squares in float16 on the kernel side (one float16
# rounding per term, about 1 ulp = 1e-3 relative on the result) against exact squares in the
# reference; sums of <= 8 terms agree to within that.

TOLERANCES = {
    torch.float32: {"rtol": 1.3e-6, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 1e-2},
    torch.int32: {"rtol": 0, "atol": 0},
}


@st.composite
def grouped_cases(draw):
    replicas = draw(st.sampled_from([1, 2, 4, 8]))
    valid = [(g, s) for g in (1, 2, 4, 8) for s in (1, 2, 4, 8) if replicas % (g * s) == 0]
    group_size, stride = draw(st.sampled_from(valid))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=2)))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.int32]))
    seed = draw(st.integers(0, 2**31 - 1))
    contiguous = draw(st.booleans())
    return replicas, group_size, stride, shape, dtype, seed, contiguous


def make_stacked(replicas, shape, dtype, seed, contiguous):
    generator = torch.Generator().manual_seed(seed)
    # Two interleaved copies along a trailing dim; taking one gives a non-contiguous view.
    full = (replicas, *shape, 1 if contiguous else 2)
    if dtype.is_floating_point:
        data = torch.randn(full, generator=generator) * 4
    else:
        data = torch.randint(-50, 50, full, generator=generator)
    return data.to(dtype)[..., 0]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=grouped_cases(), op=st.sampled_from(VALID_OPS + ("local",)))
def test_stacked_kernels_match_reference(case, op):
    replicas, group_size, stride, shape, dtype, seed, contiguous = case
    x = make_stacked(replicas, shape, dtype, seed, contiguous)
    xs = list(x)
    tol = TOLERANCES[dtype]

    if op != "local":
        expected = torch.stack(ref_all_reduce(xs, op, group_size, stride))
        torch.testing.assert_close(
            ops.all_reduce_stacked(x, op, group_size, stride), expected, **tol
        )

    flat = x.reshape(replicas, math.prod(shape))
    expected = torch.stack(ref_reduce_scatter(xs, op, group_size, stride))
    result = ops.reduce_scatter_stacked(flat, op, group_size, stride)
    assert result.shape == (replicas, -(-math.prod(shape) // group_size))
    torch.testing.assert_close(result, expected, **tol)

    gathered = ops.all_gather_stacked(x, group_size, stride)
    torch.testing.assert_close(gathered, torch.stack(ref_all_gather(xs, group_size, stride)))

    rows = make_stacked(replicas, (group_size, *shape), dtype, seed + 1, contiguous)
    torch.testing.assert_close(
        ops.take_own_stacked(rows, group_size, stride),
        torch.stack(ref_take_own(list(rows), group_size, stride)),
    )


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool]
)
@pytest.mark.parametrize("op", VALID_OPS)
def test_other_dtypes_match_reference(dtype, op):
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (8, 3, 2), generator=generator).to(dtype)
    if dtype == torch.bool and op in ("add", "mean", "mul", "square_add"):
        with pytest.raises(TypeError, match="needs a numeric dtype, got bool"):
            ops.all_reduce_stacked(x, op, 2, 2)
        return
    # bfloat16 keeps 8 mantissa bits: the kernel's float32 accumulation and the reference's
    # float64 one can round differently by one ulp (<= 2**-7 relative).
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(
        ops.all_reduce_stacked(x, op, 2, 2), torch.stack(ref_all_reduce(list(x), op, 2, 2)), **tol
    )
    torch.testing.assert_close(
        ops.reduce_scatter_stacked(x.reshape(8, 6), op, 4, 1),
        torch.stack(ref_reduce_scatter(list(x), op, 4, 1)),
        **tol,
    )


def test_integer_mean_truncates_toward_zero():
    x = torch.tensor([[-3], [0], [5], [0]], dtype=torch.int32)
    result = ops.all_reduce_stacked(x, "mean", 2, 1)
    assert result.flatten().tolist() == [-1, -1, 2, 2]  # -3/2 -> -1, 5/2 -> 2
    assert ops.all_reduce_stacked(x, "mul", 2, 1).tolist() == result.tolist()  # PopXL quirk


def test_logical_ops_return_zero_one_in_input_dtype():
    x = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    assert ops.all_reduce_stacked(x, "and", 2, 1).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert ops.all_reduce_stacked(x, "or", 2, 1).tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_expanded_input_and_outputs_never_alias():
    x = torch.arange(3.0).expand(4, 3)  # stride 0 on the replica dim
    out = ops.all_reduce_stacked(x, "add", 1, 1)
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(ops.all_reduce_stacked(x, "add", 4, 1), 4 * x)
    solo = torch.randn(2, 5)
    for result in (
        ops.all_reduce_stacked(solo, "add", 1, 1),
        ops.reduce_scatter_stacked(solo, "local", 1, 1),
        ops.take_own_stacked(solo[:, None], 1, 1),
    ):
        assert result.untyped_storage().data_ptr() != solo.untyped_storage().data_ptr()
        assert result.is_contiguous()


# --------------------------------------------------------------------------------------------
# Per-replica ops under vmap agree with the stacked kernels.


@pytest.mark.parametrize(("stride", "group_size"), [(1, 4), (2, 2), (4, 2), (1, 1)])
def test_per_replica_ops_under_vmap(stride, group_size):
    x = torch.randn(8, 3, 5)
    torch.testing.assert_close(
        per_replica(replicated_all_reduce, "max", group_size, stride)(x),
        ops.all_reduce_stacked(x, "max", group_size, stride),
    )
    torch.testing.assert_close(
        per_replica(replicated_reduce_scatter, "mean", group_size, stride)(x),
        ops.reduce_scatter_stacked(x.reshape(8, 15), "mean", group_size, stride),
    )
    # A non-zero batch dim is moved to the front before the stacked kernel sees it.
    moved = x.movedim(0, 1)
    gathered = torch.func.vmap(lambda t: replicated_all_gather(t, group_size, stride), in_dims=1)(
        moved
    )
    torch.testing.assert_close(gathered, ops.all_gather_stacked(x, group_size, stride))
    torch.testing.assert_close(per_replica(replicated_take_own, group_size, stride)(gathered), x)


def test_unbatched_value_is_replicated_across_vmap():
    # A value with no replica dim is the same on every replica; an op that also gets a batched
    # input broadcasts it to all R replicas.
    buffer = torch.arange(12.0).reshape(3, 4)  # shared, unbatched
    offsets = torch.tensor([2, 0, 1, 2])
    loaded = torch.func.vmap(lambda o: remote_load(buffer, o, 5))(offsets)
    torch.testing.assert_close(loaded, buffer[offsets])


def test_single_replica_ops_outside_vmap():
    x = torch.randn(2, 3)
    torch.testing.assert_close(replicated_all_reduce(x, "add", 1, 1), x)
    torch.testing.assert_close(replicated_all_reduce(x, "square_add", 1, 4), x * x)
    torch.testing.assert_close(replicated_all_gather(x, 1, 1), x[None])
    torch.testing.assert_close(replicated_take_own(x[None], 1, 1), x)
    torch.testing.assert_close(replicated_reduce_scatter(x, "add", 1, 1), x.reshape(-1))
    buffer = torch.zeros(3, 2)
    remote_store_(buffer, torch.tensor(1), torch.tensor([4.0, 5.0]), 9)
    assert buffer.tolist() == [[0, 0], [4, 5], [0, 0]]
    loaded = remote_load(buffer, torch.tensor(1, dtype=torch.int16), 9)
    loaded.add_(1)  # a load is a copy: the buffer is unchanged
    assert buffer.tolist() == [[0, 0], [4, 5], [0, 0]]


@pytest.mark.parametrize(
    "call",
    [
        lambda: replicated_all_reduce(torch.ones(2), "add", 2, 1),
        lambda: replicated_all_gather(torch.ones(2), 4, 1),
        lambda: replicated_reduce_scatter(torch.ones(2), "local", 2, 1),
        lambda: replicated_take_own(torch.ones(2, 2), 2, 1),
    ],
)
def test_collective_outside_vmap_needs_group_size_one(call):
    with pytest.raises(RuntimeError, match=r"single replica.*torch\.func\.vmap"):
        call()


# --------------------------------------------------------------------------------------------
# Remote buffers


def test_remote_store_inside_vmap_writes_through():
    buffer = torch.zeros(4, 3, 2)
    offsets = torch.tensor([0, 1, 2, 1])
    values = torch.arange(8.0).reshape(4, 2)

    def step(b, o, v):
        remote_store_(b, o, v, 7)
        return remote_load(b, o, 7)

    loaded = torch.func.vmap(step)(buffer, offsets, values)
    torch.testing.assert_close(loaded, values)
    expected = torch.zeros(4, 3, 2)
    ref_remote_store(list(expected), offsets.tolist(), list(values))
    torch.testing.assert_close(buffer, expected)

    # Replica dim not first, and an unbatched offset and value shared by every replica.
    other = torch.zeros(3, 4, 2)  # [entries, R, slot]
    torch.func.vmap(
        lambda b: (remote_store_(b, torch.tensor(2), torch.ones(2), 7), b.sum())[1], in_dims=1
    )(other)
    assert other[2].eq(1).all() and other[:2].eq(0).all()


def test_remote_store_inside_vmap_needs_a_batched_buffer():
    shared = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"private copy.*in_dims=0"):
        torch.func.vmap(lambda v: (remote_store_(shared, torch.tensor(0), v, 1), v)[1])(
            torch.ones(4, 2)
        )
    assert shared.eq(0).all()


def test_remote_load_matches_reference_and_copies():
    buffer = torch.randn(4, 5, 2, 3)[:, ::2]  # non-contiguous: [R=4, entries=3, 2, 3]
    offsets = torch.tensor([2, 0, 1, 2], dtype=torch.uint8)
    loaded = ops.remote_load_stacked(buffer, offsets, 3)
    torch.testing.assert_close(loaded, torch.stack(ref_remote_load(list(buffer), offsets.tolist())))
    loaded.zero_()
    assert buffer.abs().sum() > 0


@pytest.mark.parametrize(
    ("offsets", "bad", "replica"), [([0, 5], 5, 1), ([-1, 0], -1, 0), ([0, 2], 2, 1)]
)
def test_remote_offset_out_of_range(offsets, bad, replica):
    buffer = torch.randn(2, 2, 3)
    message = (
        f"remote_load: offset {bad} is out of range for RemoteBuffer[id=3] with 2 entries "
        f"(replica {replica}); offsets must be in [0, 2)"
    )
    with pytest.raises(ValueError) as info:
        ops.remote_load_stacked(buffer, torch.tensor(offsets), 3)
    assert message in str(info.value)

    before = buffer.clone()
    with pytest.raises(ValueError, match=r"remote_store: offset .* is out of range"):
        ops.remote_store_stacked_(buffer, torch.tensor(offsets), torch.ones(2, 3), 3)
    torch.testing.assert_close(buffer, before, rtol=0, atol=0)  # nothing written


def test_remote_store_rejects_mismatched_value_and_leaves_buffer_unchanged():
    buffer = torch.randn(2, 3, 4)
    before = buffer.clone()
    offsets = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"value of shape \[2, 5\] does not match.*\[2, 4\]"):
        ops.remote_store_stacked_(buffer, offsets, torch.ones(2, 5), 1)
    with pytest.raises(ValueError, match=r"dtype Double.*holds Float"):
        ops.remote_store_stacked_(buffer, offsets, torch.ones(2, 4, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match=r"one offset per replica.*shape \[2\]"):
        ops.remote_store_stacked_(buffer, torch.tensor([0, 1, 0]), torch.ones(2, 4), 1)
    with pytest.raises(TypeError, match="integer tensor"):
        ops.remote_load_stacked(buffer, torch.tensor([0.0, 1.0]), 1)
    with pytest.raises(ValueError, match=r"\[R, entries, \*slot_shape\]"):
        ops.remote_load_stacked(torch.ones(4), torch.tensor([0, 0, 0, 0]), 1)
    torch.testing.assert_close(buffer, before, rtol=0, atol=0)


def test_remote_store_value_aliasing_the_buffer():
    buffer = torch.arange(12.0).reshape(2, 3, 2)
    ops.remote_store_stacked_(buffer, torch.tensor([2, 2]), buffer[:, 0], 1)
    torch.testing.assert_close(buffer[:, 2], buffer[:, 0])


# --------------------------------------------------------------------------------------------
# Collective argument errors


def test_invalid_grouping_message():
    with pytest.raises(ValueError) as info:
        ops.all_reduce_stacked(torch.ones(8, 2), "add", 3, 2)
    message = str(info.value)
    assert "group_size=3" in message and "stride=2" in message and "R=8" in message
    with pytest.raises(ValueError, match="must be >= 1"):
        ops.all_gather_stacked(torch.ones(8, 2), 0, 1)
    with pytest.raises(ValueError, match="R=6"):
        ops.reduce_scatter_stacked(torch.ones(6, 2), "add", 4, 1)


def test_unknown_op_lists_valid_ops():
    with pytest.raises(ValueError, match=r"unknown op 'prod'.*'add'.*'square_add'"):
        ops.all_reduce_stacked(torch.ones(4, 2), "prod", 2, 1)
    with pytest.raises(ValueError, match=r"unknown op 'local'"):
        ops.all_reduce_stacked(torch.ones(4, 2), "local", 2, 1)
    with pytest.raises(ValueError, match=r"'local' \(no reduction\)"):
        ops.reduce_scatter_stacked(torch.ones(4, 2), "sum", 2, 1)


def test_bool_arithmetic_is_rejected():
    with pytest.raises(TypeError, match="needs a numeric dtype, got bool"):
        ops.all_reduce_stacked(torch.ones(4, 2, dtype=torch.bool), "add", 2, 1)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\[R, n\]"):
        ops.reduce_scatter_stacked(torch.ones(4, 2, 2), "add", 2, 1)
    with pytest.raises(ValueError, match="group_size=2"):
        ops.take_own_stacked(torch.ones(4, 3, 2), 2, 1)
    with pytest.raises(ValueError, match="replica dim first"):
        ops.all_gather_stacked(torch.tensor(1.0), 1, 1)


def test_fake_impls_validate_while_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, 5)
        assert ops.reduce_scatter_stacked(x, "add", 4, 2).shape == (8, 2)
        assert replicated_all_gather(torch.empty(3), 4, 2).shape == (4, 3)
        with pytest.raises(ValueError, match="unknown op"):
            ops.all_reduce_stacked(x, "prod", 2, 1)
        with pytest.raises(ValueError, match="R=8"):
            ops.all_gather_stacked(x, 3, 1)


def test_capture_once_then_simulate():
    # A per-replica program traced with fake tensors records the custom ops (group_size > 1 is
    # fine at trace time); vmap over the captured graph then simulates all replicas.
    def program(x):
        shard = replicated_reduce_scatter(x * 2, "add", 4, 1)
        return replicated_all_gather(shard, 4, 1).reshape(-1)[: x.numel()].reshape(x.shape)

    graph = make_fx(program, tracing_mode="fake")(torch.randn(3, 2))
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert "torch_popxl.replicated_reduce_scatter.default" in targets
    x = torch.randn(8, 3, 2)
    torch.testing.assert_close(torch.func.vmap(graph)(x), torch.func.vmap(program)(x))
    # all_gather(reduce_scatter(x)) == all_reduce(x)
    torch.testing.assert_close(
        torch.func.vmap(program)(x), ops.all_reduce_stacked(2 * x, "add", 4, 1)
    )


# --------------------------------------------------------------------------------------------
# Autograd (Note [collective gradients] in opdefs/_common.py)


@pytest.mark.parametrize(("stride", "group_size"), [(1, 4), (2, 2), (2, 4)])
def test_all_gather_grad_is_own_row(stride, group_size):
    x = torch.randn(8, 3, requires_grad=True)
    y = per_replica(replicated_all_gather, group_size, stride)(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.testing.assert_close(x.grad, torch.stack(ref_take_own(list(grad), group_size, stride)))


@pytest.mark.parametrize(("stride", "group_size"), [(1, 4), (2, 2), (1, 8)])
def test_reduce_scatter_local_grad_is_all_gather(stride, group_size):
    x = torch.randn(8, 3, 2, requires_grad=True)  # n = 6, not a multiple of G = 4 or 8
    y = per_replica(replicated_reduce_scatter, "local", group_size, stride)(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    gathered = ref_all_gather(list(grad), group_size, stride)
    expected = torch.stack([g.reshape(-1)[:6].reshape(3, 2) for g in gathered])
    torch.testing.assert_close(x.grad, expected)


def test_reduce_scatter_local_grad_of_empty_input():
    x = torch.randn(4, 0, requires_grad=True)
    y = per_replica(replicated_reduce_scatter, "local", 2, 1)(x)
    assert y.shape == (4, 0)
    y.sum().backward()
    assert x.grad.shape == (4, 0)


def test_take_own_grad_is_all_gather():
    x = torch.randn(8, 2, 3, requires_grad=True)
    y = per_replica(replicated_take_own, 2, 2)(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.testing.assert_close(x.grad, torch.stack(ref_all_gather(list(grad), 2, 2)))


def test_single_replica_autograd():
    x = torch.randn(2, 3, requires_grad=True)
    replicated_reduce_scatter(x, "local", 1, 1).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2, 3))
    x.grad = None
    (replicated_all_gather(x, 1, 1) * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 3), 3.0))


@pytest.mark.parametrize(
    "forward",
    [
        lambda x: per_replica(replicated_reduce_scatter, "add", 2, 1)(x),
        lambda x: per_replica(replicated_all_reduce, "add", 2, 1)(x),
        lambda x: replicated_reduce_scatter(x[0], "max", 1, 1),
        lambda x: replicated_all_reduce(x[0], "add", 1, 1),
    ],
)
def test_no_popxl_gradient_raises(forward):
    x = torch.randn(4, 3, requires_grad=True)
    y = forward(x)
    with pytest.raises(RuntimeError, match="has no gradient: PopXL defines no grad op"):
        y.sum().backward()


# --------------------------------------------------------------------------------------------
# Traffic counters (Note [traffic accounting] in csrc/traffic.cpp)


def test_traffic_counters_follow_ring_formulas():
    backends.reset_traffic_counters()
    assert set(backends.traffic_counters().values()) == {0}
    R, G, S = 8, 4, 2
    x = torch.randn(R, 5)  # float32: n = 20 bytes per replica
    n = 20
    ops.all_reduce_stacked(x, "add", G, S)
    ops.all_gather_stacked(x, G, S)
    ops.reduce_scatter_stacked(x, "add", G, S)  # chunk = ceil(5 / 4) = 2 elements
    ops.reduce_scatter_stacked(x, "local", G, S)
    ops.all_reduce_stacked(x, "max", 1, 1)  # one replica per group: 0 bytes
    buffer = torch.zeros(R, 3, 2, 3, dtype=torch.float16)  # slot = 6 * 2 = 12 bytes
    ops.remote_load_stacked(buffer, torch.zeros(R, dtype=torch.int64), 1)
    ops.remote_store_stacked_(
        buffer, torch.ones(R, dtype=torch.int64), torch.ones(R, 2, 3, dtype=torch.float16), 1
    )
    ops.remote_store_stacked_(
        buffer, torch.ones(R, dtype=torch.int64), torch.ones(R, 2, 3, dtype=torch.float16), 1
    )
    backends.add_host_bytes(100)

    all_reduce = (R // G) * 2 * (G - 1) * n  # sum over replicas of 2(G-1)/G * n
    all_gather = R * (G - 1) * n
    reduce_scatter = R * (G - 1) * 2 * 4  # (G-1)/G * padded bytes (G * 2 * 4) per replica
    assert backends.traffic_counters() == {
        "collective_bytes": all_reduce + all_gather + reduce_scatter,
        "remote_load_bytes": R * 12,
        "remote_store_bytes": 2 * R * 12,
        "host_bytes": 100,
        "num_collectives": 5,
        "num_remote_loads": 1,
        "num_remote_stores": 2,
    }

    # A failed call moves nothing.
    with pytest.raises(ValueError):
        ops.remote_load_stacked(buffer, torch.full((R,), 3), 1)
    assert backends.traffic_counters()["num_remote_loads"] == 1

    backends.reset_traffic_counters()
    assert set(backends.traffic_counters().values()) == {0}
    with pytest.raises(ValueError, match=">= 0"):
        backends.add_host_bytes(-1)


def test_traffic_counters_are_thread_safe():
    backends.reset_traffic_counters()

    def work():
        for _ in range(2000):
            backends.add_host_bytes(3)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backends.traffic_counters()["host_bytes"] == 4 * 2000 * 3
    backends.reset_traffic_counters()


# --------------------------------------------------------------------------------------------
# torch.library.opcheck (schema, fake impl, autograd registration, AOT dispatch)

OPCHECK_CASES = [
    (ops.all_reduce_stacked.default, lambda: (torch.randn(8, 3), "mean", 2, 2)),
    (ops.all_gather_stacked.default, lambda: (torch.randn(8, 3, requires_grad=True), 4, 2)),
    (
        ops.reduce_scatter_stacked.default,
        lambda: (torch.randn(8, 5, requires_grad=True), "local", 4, 2),
    ),
    (ops.reduce_scatter_stacked.default, lambda: (torch.randn(8, 5), "add", 4, 1)),
    (ops.take_own_stacked.default, lambda: (torch.randn(8, 2, 3, requires_grad=True), 2, 2)),
    (
        ops.remote_load_stacked.default,
        lambda: (torch.randn(4, 3, 2), torch.tensor([0, 2, 1, 0]), 1),
    ),
    (
        ops.remote_store_stacked_.default,
        lambda: (torch.randn(4, 3, 2), torch.tensor([0, 2, 1, 0]), torch.randn(4, 2), 1),
    ),
    (replicated_all_reduce, lambda: (torch.randn(3), "square_add", 1, 1)),
    (replicated_all_gather, lambda: (torch.randn(3, requires_grad=True), 1, 1)),
    (replicated_take_own, lambda: (torch.randn(1, 3, requires_grad=True), 1, 1)),
    (replicated_reduce_scatter, lambda: (torch.randn(2, 3, requires_grad=True), "local", 1, 1)),
    (replicated_reduce_scatter, lambda: (torch.randn(2, 3), "add", 1, 1)),
    (remote_load, lambda: (torch.randn(3, 2), torch.tensor(2), 1)),
    (remote_store_, lambda: (torch.randn(3, 2), torch.tensor(2), torch.randn(2), 1)),
]


def _opcheck_id(case) -> str:
    op, make_args = case
    name = getattr(op, "_name", None) or op._qualname  # OpOverload or CustomOpDef
    strings = [a for a in make_args() if isinstance(a, str)]
    return "-".join([name.split("::")[-1], *strings])


@pytest.mark.parametrize(
    ("op", "make_args"), OPCHECK_CASES, ids=[_opcheck_id(c) for c in OPCHECK_CASES]
)
def test_opcheck(op, make_args):
    with warnings.catch_warnings():
        # torch's own fake-tensor conversion reads .grad of non-leaf inputs and warns about
        # it; pytest turns warnings into errors here.
        warnings.filterwarnings("ignore", message=".*not a leaf Tensor.*")
        torch.library.opcheck(op, make_args())


# --------------------------------------------------------------------------------------------
# Argument validation before arithmetic (issue 12 item 5). Each call runs in a subprocess: on
# a kernel that divides by an overflowed group_size*stride the interpreter dies with SIGFPE,
# which must fail the test rather than kill pytest.

_HUGE = 2**32  # G = S = 2**32: G*S wraps to 0 in 64 bits

_OVERFLOW_CALLS = {
    "all_gather_stacked": f"ops.all_gather_stacked(x, {_HUGE}, {_HUGE})",
    "all_reduce_stacked": f"ops.all_reduce_stacked(x, 'add', {_HUGE}, {_HUGE})",
    "reduce_scatter_stacked": f"ops.reduce_scatter_stacked(x.reshape(1, 1), 'add', {_HUGE}, {_HUGE})",
    "take_own_stacked": f"ops.take_own_stacked(x.reshape(1, 1), {_HUGE}, {_HUGE})",
    "replicated_all_gather_vmap": (
        f"torch.func.vmap(lambda t: K.replicated_all_gather(t, {_HUGE}, {_HUGE}))(x.reshape(1, 1))"
    ),
    "replicated_all_reduce_vmap": (
        f"torch.func.vmap(lambda t: K.replicated_all_reduce(t, 'add', {_HUGE}, {_HUGE}))(x)"
    ),
    "replicated_reduce_scatter_vmap": (
        f"torch.func.vmap(lambda t: K.replicated_reduce_scatter(t, 'add', {_HUGE}, {_HUGE}))(x)"
    ),
    "replicated_take_own_vmap": (
        f"torch.func.vmap(lambda t: K.replicated_take_own(t, {_HUGE}, {_HUGE}))(x.reshape(1, 1, 1))"
    ),
}

_SUBPROCESS_TEMPLATE = """
import torch
import torch_popxl.opdefs  # registers the ops
K = ops = torch.ops.torch_popxl
x = torch.zeros([1], dtype=torch.int8)
try:
    {call}
except (ValueError, RuntimeError) as e:
    print("RAISED", type(e).__name__, e)
else:
    print("NO ERROR")
"""


def _run_isolated(call: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_TEMPLATE.format(call=call)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("name", sorted(_OVERFLOW_CALLS))
def test_overflowing_grouping_raises_instead_of_crashing(name):
    proc = _run_isolated(_OVERFLOW_CALLS[name])
    assert proc.returncode == 0, (
        f"{name} killed the interpreter (exit code {proc.returncode}, "
        f"{'SIGFPE' if proc.returncode == -signal.SIGFPE else 'not SIGFPE'}): {proc.stderr[-2000:]}"
    )
    out = proc.stdout
    assert out.startswith("RAISED ValueError"), out + proc.stderr[-2000:]
    # The message says what was given and what is expected.
    assert f"group_size={_HUGE}, stride={_HUGE}" in out and "R=1" in out, out
    assert "multiple of group_size*stride" in out, out


@pytest.mark.parametrize(
    ("R", "group_size", "stride"),
    [(4, 5, 1), (4, 2, 3), (4, 4, 2), (6, 3, 2**62), (1, 2**63 - 1, 1)],
)
def test_grouping_bounds_are_checked_without_overflow(R, group_size, stride):
    """Stacked kernels, fakes and vmap rules all reject a grouping that does not tile R."""
    x = torch.arange(R, dtype=torch.float32)
    with pytest.raises(ValueError, match=rf"does not tile R={R} replicas"):
        ops.all_reduce_stacked(x, "add", group_size, stride)
    with pytest.raises(ValueError, match=rf"does not tile R={R} replicas"):
        check_grouping("all_reduce", R, group_size, stride)
    with pytest.raises(ValueError, match=rf"does not tile R={R} replicas"):
        torch.func.vmap(lambda t: replicated_all_reduce(t, "add", group_size, stride))(x)


@pytest.mark.parametrize("stride", [-1, 0, 2])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_full_group_shortcut_validates_stride(op, stride):
    """G = R takes the full-group fast path under vmap; an invalid stride must not."""
    x = torch.arange(3, dtype=torch.float32)
    if op == "all_reduce":
        fn = lambda t: replicated_all_reduce(t, "add", 3, stride)  # noqa: E731
    else:
        fn = lambda t: replicated_all_gather(t, 3, stride)  # noqa: E731
    match = "must be >= 1" if stride < 1 else "does not tile R=3"
    with pytest.raises(ValueError, match=match):
        torch.func.vmap(fn)(x)


def test_full_group_shortcut_matches_reference_for_valid_grouping():
    """The fast path still gives the reference numbers when the grouping is the full set."""
    x = torch.tensor([1.0, 2.0, 4.0])
    got = torch.func.vmap(lambda t: replicated_all_reduce(t, "add", 3, 1))(x)
    want = torch.stack(ref_all_reduce(list(x.unbind(0)), "add", 3, 1))
    torch.testing.assert_close(got.expand(3), want)
    gathered = torch.func.vmap(lambda t: replicated_all_gather(t, 3, 1))(x)
    want = torch.stack(ref_all_gather(list(x.unbind(0)), 3, 1))
    torch.testing.assert_close(gathered.expand(3, 3), want)


@pytest.mark.parametrize("call", ["all_reduce_full(x, 'add')", "all_gather_full(x)"])
def test_full_group_kernels_need_a_replica(call):
    x = torch.zeros(0, 2)
    with pytest.raises(ValueError, match="at least one replica"):
        eval(f"ops.{call}", {"ops": ops, "x": x})


@pytest.mark.parametrize("op", ["add", "mean", "mul"])
def test_fused_matmul_all_reduce_kernel_matches_the_reference(op):
    """``mm_all_reduce_stacked`` reads its op from the shared C++ table: the sum of the
    replicas' matmuls, divided by R for 'mean' and for 'mul' (PopXL's alias of 'mean'),
    exactly what the all-reduce reference gives on the per-replica products."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 5, generator=g), torch.randn(3, 5, 2, generator=g)
    want = ref_all_reduce([a[r] @ b[r] for r in range(3)], op, 3, 1)[0]
    torch.testing.assert_close(ops.mm_all_reduce_stacked(a, b, op), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, match", [("max", "must be 'add' or 'mean'"), ("sum", "unknown op")])
def test_fused_matmul_all_reduce_kernel_refuses_other_reductions(op, match):
    a, b = torch.ones(2, 3, 4), torch.ones(2, 4, 5)
    with pytest.raises(ValueError, match=match):
        ops.mm_all_reduce_stacked(a, b, op)


def test_remote_offsets_are_range_checked_as_64_bit():
    buffer = torch.arange(6, dtype=torch.float32).reshape(1, 3, 2)
    before = buffer.clone()
    with pytest.raises(ValueError, match=r"offset 4294967296 is out of range.*3 entries"):
        ops.remote_load_stacked(buffer, torch.tensor([2**32]), 7)
    with pytest.raises(ValueError, match=r"offset 4294967296 is out of range.*3 entries"):
        ops.remote_store_stacked_(buffer, torch.tensor([2**32]), torch.ones(1, 2), 7)
    with pytest.raises(
        ValueError, match=r"uint64 offset 9223372036854775808 is out of range.*3 entries"
    ):
        ops.remote_load_stacked(buffer, torch.tensor([2**63], dtype=torch.uint64), 7)
    torch.testing.assert_close(buffer, before)
    # The reference semantics agree: same check, same wording.
    with pytest.raises(ValueError, match=r"offset 4294967296 is out of range"):
        ref_remote_load([buffer[0]], [torch.tensor(2**32)], 7)


def test_nan_remote_offset_says_nan():
    buffer = torch.zeros(2, 3, 2)
    with pytest.raises(TypeError, match="NaN"):
        ops.remote_load_stacked(buffer, torch.tensor([0.0, float("nan")]), 7)
    with pytest.raises(TypeError, match="NaN"):
        ref_remote_load([buffer[0]], [torch.tensor(float("nan"))], 7)
    with pytest.raises(TypeError, match="NaN"):
        ref_remote_store([buffer[0]], [float("nan")], [torch.zeros(2)], 7)
