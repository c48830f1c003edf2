"""ReplicaGrouping against spec/popxl.md §2, §11.17 and seed 001 (the replication docs)."""

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from torch_popxl.ir.replica_grouping import ReplicaGrouping


class _Ir:
    def __init__(self, replication_factor):
        self.replication_factor = replication_factor


def rg(num_replicas, stride=1, group_size=None, ir=None):
    return ReplicaGrouping._from_params(ir or _Ir(num_replicas), stride, group_size)


def from_assignments(assignment, ir=None):
    return ReplicaGrouping._from_assignments(ir or _Ir(len(assignment)), assignment)


def groups(grouping):
    return [grouping._members(g) for g in range(grouping.num_groups)]


# ----------------------------------------------------------------------------------------
# Construction
# ----------------------------------------------------------------------------------------


def test_direct_construction_raises():
    with pytest.raises(RuntimeError, match="ir.replica_grouping"):
        ReplicaGrouping()


def test_default_is_one_group_of_all_replicas():
    g = rg(8)
    assert (g.stride, g.group_size, g.num_groups) == (1, 8, 1)
    assert g.assignment == [0] * 8


def test_default_group_size_is_replicas_over_stride():
    g = rg(8, stride=2)
    assert (g.stride, g.group_size, g.num_groups) == (2, 4, 2)


@pytest.mark.parametrize(
    "stride, group_size, assignment",
    [
        (1, 2, [0, 0, 1, 1, 2, 2, 3, 3]),
        (2, 4, [0, 1, 0, 1, 0, 1, 0, 1]),
        (4, 2, [0, 1, 2, 3, 0, 1, 2, 3]),
        (2, 2, [0, 1, 0, 1, 2, 3, 2, 3]),  # accepted although S*G != R (docs say otherwise)
        (1, 8, [0] * 8),
        (1, 1, list(range(8))),
    ],
)
def test_spec_assignments_for_8_replicas(stride, group_size, assignment):
    g = rg(8, stride, group_size)
    assert g.assignment == assignment
    assert g.is_const
    assert (g.stride, g.group_size) == (stride, group_size)
    assert g.num_groups == 8 // group_size


def test_group_size_one_forces_stride_one():
    g = rg(8, stride=4, group_size=1)
    assert g.stride == 1
    assert g.assignment == list(range(8))


@pytest.mark.parametrize(
    "stride, group_size, message",
    [
        (0, None, "0 < stride <= 8"),
        (-2, 2, "0 < stride <= 8"),
        (16, 1, "0 < stride <= 8"),
        (3, 1, "does not divide"),  # checked before group_size, so G=1 does not rescue it
        (1, 0, "0 < group_size <= 8"),
        (2, 9, "0 < group_size <= 8"),
        (2, 3, "does not tile"),  # PopXL accepts this and fails later; we fail eagerly
        (4, 4, "does not tile"),
    ],
)
def test_from_params_validation(stride, group_size, message):
    with pytest.raises(ValueError, match=message):
        rg(8, stride, group_size)


def test_from_params_rejects_non_int():
    with pytest.raises(TypeError, match="stride must be an int"):
        rg(8, 2.0)
    with pytest.raises(TypeError, match="group_size must be an int"):
        rg(8, 1, "2")


def test_stride_error_comes_before_group_size_error():
    with pytest.raises(ValueError, match="stride"):
        rg(8, 0, 0)


# ----------------------------------------------------------------------------------------
# Seed 001: the three tables of the replication user guide (R=16)
# ----------------------------------------------------------------------------------------


def test_seed_table_consecutive_group_size_4_stride_1():
    assert groups(rg(16, 1, 4)) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]


def test_seed_table_orthogonal_group_size_4_stride_4():
    assert groups(rg(16, 4, 4)) == [
        [0, 4, 8, 12],
        [1, 5, 9, 13],
        [2, 6, 10, 14],
        [3, 7, 11, 15],
    ]


def test_seed_table_ungrouped_group_size_1():
    assert groups(rg(16, 1, 1)) == [[r] for r in range(16)]


# ----------------------------------------------------------------------------------------
# from_assignments
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "assignment, message",
    [
        ([0, 0, 1, 1, 1, 2], "same size"),
        ([0, 0, 2, 2], "exactly 0..k-1"),
        ([1, 1, 2, 2], "exactly 0..k-1"),
        ([1, 1, 0, 0], "first appear in increasing order"),
        ([0, 2, 1, 1, 0, 2], "first appear in increasing order"),
    ],
)
def test_from_assignments_validation(assignment, message):
    with pytest.raises(ValueError, match=message):
        from_assignments(assignment)


def test_from_assignments_length_must_equal_replicas():
    with pytest.raises(ValueError, match="has 4 entries, but the replication factor is 8"):
        ReplicaGrouping._from_assignments(_Ir(8), [0, 0, 1, 1])


def test_from_assignments_validation_order():
    ir = _Ir(8)
    # Each assignment breaks every rule from its own one onwards; the first rule must win.
    with pytest.raises(ValueError, match="same size"):
        ReplicaGrouping._from_assignments(ir, [2, 0, 0])
    with pytest.raises(ValueError, match="exactly 0..k-1"):
        ReplicaGrouping._from_assignments(ir, [2, 2, 0, 0])
    with pytest.raises(ValueError, match="increasing order"):
        ReplicaGrouping._from_assignments(ir, [1, 1, 0, 0])


def test_from_assignments_rejects_non_int_entries():
    with pytest.raises(TypeError, match="assignment entry must be an int"):
        from_assignments([0, 0.5])
    with pytest.raises(TypeError, match="sequence of group ids"):
        from_assignments("0011")


@pytest.mark.parametrize(
    "assignment, stride, group_size",
    [
        ([0, 0, 1, 1, 2, 2, 3, 3], 1, 2),
        ([0, 1, 0, 1, 2, 3, 2, 3], 2, 2),
        ([0, 1, 2, 3, 0, 1, 2, 3], 4, 2),
        ([0] * 8, 1, 8),
    ],
)
def test_from_assignments_detects_constant_groupings(assignment, stride, group_size):
    ir = _Ir(8)
    g = ReplicaGrouping._from_assignments(ir, assignment)
    assert g.is_const
    assert (g.stride, g.group_size) == (stride, group_size)
    assert g == rg(8, stride, group_size, ir=ir)


def test_from_assignments_all_singletons_gives_trivial_grouping():
    # PopXL crashes with "min() arg is an empty sequence" here; we return (1, 1).
    g = from_assignments([0, 1, 2, 3])
    assert g.is_const and (g.stride, g.group_size, g.num_groups) == (1, 1, 4)


def test_non_constant_grouping_properties():
    g = from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
    assert not g.is_const
    with pytest.raises(NotImplementedError, match="no stride"):
        _ = g.stride
    assert (g.group_size, g.num_groups) == (4, 2)
    assert groups(g) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(NotImplementedError, match="all_reduce"):
        g._require_const("all_reduce")
    rg(8)._require_const("all_reduce")


def test_const_rg_and_maps_of_block_grouping():
    g = from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
    assert g.const_rg.assignment == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (g.const_rg.stride, g.const_rg.group_size) == (1, 2)
    assert g.to_device_map == [0, 1, 0, 1]
    assert g.to_host_map == [0, 1]


def test_const_rg_and_maps_of_interleaved_grouping():
    assignment = [0, 1, 1, 0, 0, 1, 1, 0]
    g = from_assignments(assignment)
    assert g.const_rg.assignment == list(range(8))
    assert g.to_device_map == assignment
    assert g.to_host_map == [0, 1]


def test_constant_grouping_is_its_own_const_rg_and_has_no_maps():
    g = rg(8, 2, 2)
    assert g.const_rg is g
    assert g.to_device_map is None and g.to_host_map is None


# ----------------------------------------------------------------------------------------
# transpose (§2.3, §11.17)
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_replicas, before, after, assignment",
    [
        # stride 1
        (8, (1, 2), (2, 4), [0, 1, 0, 1, 0, 1, 0, 1]),
        (8, (1, 1), (1, 8), [0] * 8),
        (8, (1, 8), (1, 1), list(range(8))),
        # stride > 1 with S*G == R
        (8, (4, 2), (1, 4), [0, 0, 0, 0, 1, 1, 1, 1]),
        # §11.17, R=16
        (16, (1, 1), (1, 16), [0] * 16),
        (16, (1, 4), (4, 4), [0, 1, 2, 3] * 4),
        (16, (2, 8), (1, 2), [g for g in range(8) for _ in range(2)]),
        (16, (8, 2), (1, 8), [0] * 8 + [1] * 8),
    ],
)
def test_transpose_of_constant_grouping(num_replicas, before, after, assignment):
    t = rg(num_replicas, *before).transpose()
    assert t.is_const
    assert (t.stride, t.group_size) == after
    assert t.assignment == assignment


def test_transpose_of_partial_stride_grouping_is_non_constant():
    t = rg(8, 2, 2).transpose()
    assert not t.is_const
    assert t.assignment == [0, 0, 1, 1, 0, 0, 1, 1]


def test_transpose_of_non_constant_grouping_can_be_constant():
    t = from_assignments([0, 0, 1, 1, 0, 0, 1, 1]).transpose()
    assert t.is_const
    assert t.assignment == [0, 1, 0, 1, 2, 3, 2, 3]


def test_transpose_of_12_replica_grouping():
    t = from_assignments([0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]).transpose()
    assert t.assignment == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]


def test_transpose_keeps_the_ir():
    ir = _Ir(8)
    assert rg(8, 2, 2, ir=ir).transpose().ir is ir


# ----------------------------------------------------------------------------------------
# repr, equality, immutability
# ----------------------------------------------------------------------------------------


def test_repr_constant():
    assert (
        repr(rg(8, 2, 4)) == "ReplicaGrouping(num_replicas=8, stride=2, group_size=4, num_groups=2)"
    )


def test_repr_non_constant():
    g = from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
    assert repr(g) == "ReplicaGrouping(assignment=[0, 0, 1, 1, 0, 0, 1, 1])"


def test_equality_needs_same_ir_and_assignment():
    ir = _Ir(8)
    assert rg(8, 2, 2, ir=ir) == ReplicaGrouping._from_assignments(ir, [0, 1, 0, 1, 2, 3, 2, 3])
    assert rg(8, 2, 2, ir=ir) != rg(8, 1, 2, ir=ir)
    assert rg(8, 2, 2, ir=ir) != rg(8, 2, 2, ir=_Ir(8))


@pytest.mark.parametrize("other", [None, 1, [0] * 8, "rg"])
def test_equality_with_non_grouping_raises(other):
    with pytest.raises(TypeError, match="only be compared with another ReplicaGrouping"):
        _ = rg(8) == other


def test_unhashable():
    with pytest.raises(TypeError):
        hash(rg(8))


def test_immutable():
    g = rg(8)
    with pytest.raises(AttributeError):
        g.ir = _Ir(4)
    g.assignment.append(99)  # a copy: the grouping is unchanged
    assert g.assignment == [0] * 8


def test_stores_ir():
    ir = _Ir(4)
    assert rg(4, ir=ir).ir is ir


def test_ir_without_replication_factor_raises():
    with pytest.raises(TypeError, match="replication_factor"):
        ReplicaGrouping._from_params(object())


# ----------------------------------------------------------------------------------------
# Runtime helpers
# ----------------------------------------------------------------------------------------


def test_helpers_out_of_range():
    g = rg(8, 2, 2)
    for call in (
        lambda: g._group_of(8),
        lambda: g._index_in_group(-1),
        lambda: g._members(4),
        lambda: g._replica(0, 2),
    ):
        with pytest.raises(IndexError):
            call()


@st.composite
def constant_params(draw):
    """A valid (R, S, G): S*G divides R."""
    num_replicas = draw(st.integers(1, 64))
    divisors = [d for d in range(1, num_replicas + 1) if num_replicas % d == 0]
    stride = draw(st.sampled_from(divisors))
    group_size = draw(st.sampled_from([g for g in divisors if (num_replicas // stride) % g == 0]))
    return num_replicas, stride, group_size


@given(constant_params())
def test_index_formulas_agree_with_assignment_and_members(params):
    num_replicas, stride, group_size = params
    g = rg(num_replicas, stride, group_size)
    stride = g.stride  # group_size 1 forces stride 1
    span = stride * group_size
    assignment = g.assignment
    assert len(assignment) == num_replicas
    assert g.num_groups * g.group_size == num_replicas
    for r in range(num_replicas):
        group, index = g._group_of(r), g._index_in_group(r)
        assert group == assignment[r] == (r % stride) + stride * (r // span)
        assert index == (r % span) // stride
        assert g._replica(group, index) == r
        assert g._members(group)[index] == r
    for group in range(g.num_groups):
        members = g._members(group)
        assert members == sorted(members) and len(members) == group_size
        assert members == [
            (group // stride) * span + group % stride + i * stride for i in range(group_size)
        ]
        assert [g._replica(group, i) for i in range(group_size)] == members
    # Groups are numbered by first appearance.
    first = [g._members(k)[0] for k in range(g.num_groups)]
    assert first == sorted(first)
    assert ReplicaGrouping._from_assignments(g.ir, assignment) == g


@given(constant_params())
def test_transpose_swaps_group_size_and_num_groups(params):
    g = rg(*params)
    t = g.transpose()
    assert (t.group_size, t.num_groups) == (g.num_groups, g.group_size)
    # New group k holds the k-th member of every old group.
    for k in range(t.num_groups):
        assert t._members(k) == sorted(g._members(j)[k] for j in range(g.num_groups))


@given(st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_const_rg_refines_any_valid_assignment(raw):
    # Renumber by first appearance and keep only equal-size partitions.
    ids = {}
    assignment = [ids.setdefault(x, len(ids)) for x in raw]
    sizes = {assignment.count(k) for k in ids.values()}
    assume(len(sizes) == 1)
    g = from_assignments(assignment)
    assert g.assignment == assignment
    c = g.const_rg
    assert c.is_const
    device_map = g.to_device_map if not g.is_const else list(range(g.num_groups))
    for r in range(len(assignment)):
        assert device_map[c._group_of(r)] == assignment[r]
    if not g.is_const:
        assert [device_map[j] for j in g.to_host_map] == list(range(g.num_groups))
