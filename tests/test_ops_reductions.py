"""The one reduction implementation (ops/reductions.py, Note [one reduction]): every
reduction name, upstream's and this package's ``reduce_*``, compared by value with torch on
both executors over axis lists, negative axes, keepdims, integer dtypes and 0-d inputs; and
the axis errors name the op."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops

EXECUTORS = ["fast", "reference"]
rng = np.random.default_rng(0)


def run(build, executor):
    """Build one output under the main graph and return its host value."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        out = build()
        s = popxl.d2h_stream(out.shape, out.dtype, "out")
        ops.host_store(s, out)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        return session.run()[s]


def _median(x: torch.Tensor, axes, keepdim):
    # the lower median over several axes: move them last, flatten, median
    axes = sorted(a % x.dim() for a in axes)
    rest = [d for d in range(x.dim()) if d not in axes]
    y = x.permute(*rest, *axes).reshape(*[x.shape[d] for d in rest], -1).median(-1).values
    return y.reshape([1 if d in axes else x.shape[d] for d in range(x.dim())]) if keepdim else y


def _prod(x, axes, keepdim):
    for a in sorted((a % x.dim() for a in axes), reverse=True):
        x = x.prod(a, keepdim=keepdim)
    return x


# (reduce_* name or None, upstream name or None, torch reference over a non-empty axis list)
TABLE = [
    ("reduce_sum", "sum", lambda x, ax, kd: x.sum(ax, keepdim=kd)),
    ("reduce_mean", "mean", lambda x, ax, kd: x.mean(ax, keepdim=kd)),
    ("reduce_max", None, lambda x, ax, kd: x.amax(ax, keepdim=kd)),
    ("reduce_min", None, lambda x, ax, kd: x.amin(ax, keepdim=kd)),
    ("reduce_prod", "prod", _prod),
    ("reduce_sum_square", "sumsquare", lambda x, ax, kd: (x * x).sum(ax, keepdim=kd)),
    ("reduce_median", "median", _median),
    (None, "l1", lambda x, ax, kd: x.abs().sum(ax, keepdim=kd)),
    (None, "l2", lambda x, ax, kd: (x * x).sum(ax, keepdim=kd).sqrt()),
    (None, "logsum", lambda x, ax, kd: x.sum(ax, keepdim=kd).log()),
    (None, "logsumexp", lambda x, ax, kd: torch.logsumexp(x, ax, keepdim=kd)),
]
NAMES = [(n, ref) for a, b, ref in TABLE for n in (a, b) if n is not None]
X = np.abs(rng.standard_normal((2, 3, 4))).astype(np.float32) + 0.5


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize(("name", "ref"), NAMES, ids=[n for n, _ in NAMES])
@pytest.mark.parametrize(
    ("axis", "keepdims"),
    [(None, False), (None, True), (-1, False), ([0, 2], True), ([2, -3], False)],
)
def test_every_reduction_matches_torch_over_axes(name, ref, axis, keepdims, executor):
    got = run(lambda: getattr(ops, name)(popxl.variable(X), axis, keepdims), executor)
    axes = list(range(3)) if axis is None else [axis] if isinstance(axis, int) else axis
    want = ref(torch.from_numpy(X), axes, keepdims).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "upstream"), [(a, b) for a, b, _ in TABLE if a and b])
@pytest.mark.parametrize(("axis", "keepdims"), [(None, False), (1, True), ([0, -1], False)])
def test_each_reduce_name_is_its_upstream_reduction(name, upstream, axis, keepdims):
    a = run(lambda: getattr(ops, name)(popxl.variable(X), axis, keepdims), "fast")
    b = run(lambda: getattr(ops, upstream)(popxl.variable(X), axis, keepdims), "fast")
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", ["sum", "reduce_sum", "prod", "sumsquare", "l1", "reduce_max"])
@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_integer_reductions_keep_the_input_dtype(name, dtype, executor):
    data = rng.integers(0 if dtype == np.uint32 else -3, 4, (3, 4)).astype(dtype)
    got = run(lambda: getattr(ops, name)(popxl.variable(data), 1), executor)
    ref = dict(NAMES)[name]
    want = ref(torch.from_numpy(data.astype(np.int64)), [1], False).numpy().astype(dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize(
    ("name", "want"), [("sum", 2.0), ("reduce_median", 2.0), ("sumsquare", 4.0), ("l2", 2.0)]
)
@pytest.mark.parametrize("axis", [None, 0, -1, []])
def test_a_0d_input_reduces_over_no_axes_to_the_elementwise_part(name, want, axis, executor):
    x = np.array(-2.0 if name in ("sumsquare", "l2") else 2.0, np.float32)
    got = run(lambda: getattr(ops, name)(popxl.variable(x), axis), executor)
    assert got.shape == ()
    np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("name", [n for n, _ in NAMES])
def test_out_of_range_and_repeated_axes_raise_naming_the_op(name):
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(X)
        with pytest.raises(ValueError, match=rf"{name}: axis 3 is out of range .* rank 3"):
            getattr(ops, name)(t, 3)
        with pytest.raises(ValueError, match=rf"{name}: axis -4 is out of range"):
            getattr(ops, name)(t, [0, -4])
        with pytest.raises(ValueError, match=rf"{name}: axis \[2, -1\] names an axis .* twice"):
            getattr(ops, name)(t, [2, -1])
        with pytest.raises(TypeError, match=rf"ops\.{name} expects a popxl Tensor"):
            getattr(ops, name)(X, 0)
