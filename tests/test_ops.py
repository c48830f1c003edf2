"""Every ``popxl.ops`` family and the Tensor operators, run through a Session with both
executors and compared with torch eager / numpy / the worked numbers of spec/popxl.md §9, §11.

Each case builds a fresh Ir (an Ir gets one Session): inputs arrive through h2d streams,
outputs leave through d2h streams, so the values and dtypes checked are what a PopXL program
sees on the host. Float32 results must match eager torch to 1e-6 (1e-5 for matmul-like ops);
integer and boolean results must match exactly.
"""

import math

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.errors import PopXLError

EXECUTORS = ("reference", "fast")
RNG = np.random.default_rng(0)


@pytest.fixture(params=EXECUTORS)
def executor(request):
    return request.param


def run_graph(fn, *arrays, executor="fast"):
    """Host-load ``arrays``, apply ``fn`` in the main graph, run once; returns host outputs."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        streams = [
            popxl.h2d_stream(a.shape, popxl.dtypes.dtype.as_dtype(a.dtype), f"in{i}")
            for i, a in enumerate(arrays)
        ]
        outs = fn(*[ops.host_load(s) for s in streams])
        single = not isinstance(outs, tuple | list)
        outs = [outs] if single else list(outs)
        d2h = [popxl.d2h_stream(t.shape, t.dtype, f"out{i}") for i, t in enumerate(outs)]
        for s, t in zip(d2h, outs, strict=True):
            ops.host_store(s, t)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        result = session.run(dict(zip(streams, arrays, strict=True)))
    values = [result[s] for s in d2h]
    return values[0] if single else values


def expect(got, want, rtol=1e-6, atol=1e-6):
    """``got`` (host array) equals ``want`` (torch or numpy) in value, shape and dtype."""
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    assert got.dtype == want.dtype, f"dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"shape {got.shape}, expected {want.shape}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def f32(*shape, low=-2.0, high=2.0):
    return RNG.uniform(low, high, shape).astype(np.float32)


def i32(*shape, low=-5, high=6):
    return RNG.integers(low, high, shape).astype(np.int32)


def torch_args(arrays):
    return [torch.from_numpy(a.copy()) for a in arrays]


X = f32(2, 3)
Y = f32(2, 3)
POS = f32(2, 3, low=0.1, high=3.0)
ROW = f32(3)
XI = i32(2, 3)
YI = np.array([[3, -2, 4], [1, 5, -3]], np.int32)  # no zeros: a divisor
B = RNG.random((2, 3)) > 0.5
B2 = RNG.random((2, 3)) > 0.5
X3 = f32(2, 3, 4)


# ----------------------------------------------------------------------------------------
# Elementwise ops (popxl op, eager torch, inputs)
# ----------------------------------------------------------------------------------------

ELEMENTWISE = {
    "add": (ops.add, torch.add, (X, Y)),
    "add_broadcast_row": (ops.add, torch.add, (X, ROW)),
    "add_python_scalar": (lambda a: ops.add(a, 2.5), lambda a: a + 2.5, (X,)),
    "add_scalar_lhs": (lambda a: ops.add(3.0, a), lambda a: 3.0 + a, (X,)),
    "sub": (ops.sub, torch.sub, (X, Y)),
    "mul": (ops.mul, torch.mul, (X, Y)),
    "div": (ops.div, torch.div, (X, POS)),
    "fmod": (ops.fmod, torch.fmod, (X, POS)),
    "pow": (ops.pow, torch.pow, (POS, Y)),
    "neg": (ops.neg, torch.neg, (X,)),
    "negate": (ops.negate, torch.neg, (X,)),
    "abs": (ops.abs, torch.abs, (X,)),
    "exp": (ops.exp, torch.exp, (X,)),
    "log": (ops.log, torch.log, (POS,)),
    "sqrt": (ops.sqrt, torch.sqrt, (POS,)),
    "cos": (ops.cos, torch.cos, (X,)),
    "sin": (ops.sin, torch.sin, (X,)),
    "relu": (ops.relu, torch.relu, (X,)),
    # PopLibs GELU is the tanh approximation.
    "gelu": (ops.gelu, lambda a: torch.nn.functional.gelu(a, approximate="tanh"), (X,)),
    "tanh": (ops.tanh, torch.tanh, (X,)),
    "sigmoid": (ops.sigmoid, torch.sigmoid, (X,)),
    "swish": (ops.swish, torch.nn.functional.silu, (X,)),
    "maximum": (ops.maximum, torch.maximum, (X, Y)),
    "minimum": (ops.minimum, torch.minimum, (X, Y)),
    "max_of_list": (
        lambda a, b: ops.max([a, b, a * 0.5]),
        lambda a, b: torch.maximum(torch.maximum(a, b), a * 0.5),
        (X, Y),
    ),
    "min_of_list": (lambda a, b: ops.min([a, b]), torch.minimum, (X, Y)),
    "clip": (lambda a: ops.clip(a, -0.5, 0.75), lambda a: torch.clamp(a, -0.5, 0.75), (X,)),
    "increment_mod": (
        lambda a: ops.increment_mod(a, 1.5, 2.0),
        lambda a: torch.fmod(a + 1.5, 2.0),
        (X,),
    ),
    "int_add": (ops.add, torch.add, (XI, YI)),
    "int_mul": (ops.mul, torch.mul, (XI, YI)),
    # Integer division truncates towards zero (C++), unlike Python's floor division.
    "int_div": (ops.div, lambda a, b: torch.div(a, b, rounding_mode="trunc"), (XI, YI)),
    "int_fmod": (ops.fmod, torch.fmod, (XI, YI)),
    # The scalar is coerced to the tensor's dtype: 2.7 becomes int32 2.
    "int_add_float_scalar": (lambda a: ops.add(a, 2.7), lambda a: a + 2, (XI,)),
    "logical_and": (ops.logical_and, torch.logical_and, (B, B2)),
    "logical_or": (ops.logical_or, torch.logical_or, (B, B2)),
    "logical_not": (ops.logical_not, torch.logical_not, (B,)),
    "equal": (ops.equal, torch.eq, (XI, YI * 0 + XI[0])),
    "greater": (ops.greater, torch.gt, (X, Y)),
    "less": (ops.less, torch.lt, (X, Y)),
    "greater_scalar": (lambda a: ops.greater(a, 0.0), lambda a: a > 0, (X,)),
    "where": (ops.where, torch.where, (B, X, Y)),
    "where_scalar_rhs": (
        lambda c, a: ops.where(c, a, 0.5),
        lambda c, a: torch.where(c, a, 0.5),
        (B, X),
    ),
    "where_scalar_lhs": (
        lambda c, a: ops.where(c, -1.0, a),
        lambda c, a: torch.where(c, -1.0, a),
        (B, X),
    ),
}


@pytest.mark.parametrize("case", ELEMENTWISE)
def test_elementwise_op_matches_torch_eager(case, executor):
    pop_fn, torch_fn, arrays = ELEMENTWISE[case]
    got = run_graph(pop_fn, *arrays, executor=executor)
    expect(got, torch_fn(*torch_args(arrays)), rtol=2e-6)


# ----------------------------------------------------------------------------------------
# Linear algebra, shapes, casts, gather, softmax
# ----------------------------------------------------------------------------------------

IDX = np.array([[2, 0], [1, 1]], np.int32)

SHAPE_OPS = {
    "matmul": (ops.matmul, torch.matmul, (f32(2, 3), f32(3, 4))),
    "matmul_batched": (ops.matmul, torch.matmul, (f32(5, 2, 3), f32(3, 4))),
    "matmul_int": (ops.matmul, torch.matmul, (i32(2, 3), i32(3, 2))),
    "matmul_output_type": (
        lambda a, b: ops.matmul(a, b, output_type=popxl.float16),
        lambda a, b: torch.matmul(a, b).half(),
        (f32(2, 3), f32(3, 4)),
    ),
    "reshape": (lambda a: ops.reshape(a, (4, -1)), lambda a: a.reshape(4, -1), (X3,)),
    "transpose_default_reverses": (ops.transpose, lambda a: a.permute(2, 1, 0), (X3,)),
    "transpose_perm": (lambda a: ops.transpose(a, (2, 0, 1)), lambda a: a.permute(2, 0, 1), (X3,)),
    "flatten": (ops.flatten, lambda a: a.reshape(-1), (X3,)),
    "slice": (
        lambda a: ops.slice(a, start=[1, 0], stop=[3, 3], axis=[1, 2]),
        lambda a: a[:, 1:3, 0:3],
        (X3,),
    ),
    "slice_step": (
        lambda a: ops.slice(a, start=0, stop=4, step=2, axis=2),
        lambda a: a[:, :, 0:4:2],
        (X3,),
    ),
    # numpy semantics for a negative step: [4, 0) with step -2 picks 3, 1 (spec §3.2).
    "slice_negative_step": (
        lambda a: ops.slice(a, start=3, stop=0, step=-2, axis=2),
        lambda a: a[:, :, [3, 1]],
        (X3,),
    ),
    "subsample": (lambda a: ops.subsample(a, [1, 2, 3]), lambda a: a[:, ::2, ::3], (X3,)),
    "concat": (
        lambda a, b: ops.concat([a, b, a], axis=1),
        lambda a, b: torch.cat([a, b, a], 1),
        (X, Y),
    ),
    "split_equal": (lambda a: ops.split(a, 2, axis=2), lambda a: list(torch.split(a, 2, 2)), (X3,)),
    "split_sizes": (
        lambda a: ops.split(a, [1, 3], axis=2),
        lambda a: list(torch.split(a, [1, 3], 2)),
        (X3,),
    ),
    "squeeze_axes": (
        lambda a: ops.squeeze(a, [0, 2]),
        lambda a: a.squeeze(2).squeeze(0),
        (f32(1, 3, 1, 2),),
    ),
    "squeeze_all": (ops.squeeze, torch.squeeze, (f32(1, 3, 1, 2),)),
    "unsqueeze": (lambda a: ops.unsqueeze(a, [0, 2]), lambda a: a.unsqueeze(0).unsqueeze(2), (X,)),
    "cast_float_to_int_truncates": (
        lambda a: ops.cast(a, popxl.int32),
        lambda a: a.to(torch.int32),
        (X * 3,),
    ),
    "cast_to_float16": (lambda a: ops.cast(a, popxl.float16), lambda a: a.half(), (X,)),
    "cast_int_to_float": (lambda a: ops.cast(a, popxl.float32), lambda a: a.float(), (XI,)),
    "cast_to_bool": (lambda a: ops.cast(a, popxl.bool), lambda a: a.bool(), (XI,)),
    "gather_axis0": (
        lambda a: ops.gather(a, popxl.constant(np.array([2, 0, 2], np.int32))),
        None,
        (f32(3, 4),),
    ),
    "gather_2d_indices_axis2": (lambda a: ops.gather(a, popxl.constant(IDX), axis=2), None, (X3,)),
    "gather_loaded_indices": (
        lambda a, i: ops.gather(a, i, axis=1),
        None,
        (f32(3, 4), np.array([3, 1], np.int32)),
    ),
    "softmax": (lambda a: ops.softmax(a, 1), lambda a: torch.softmax(a, 1), (X3,)),
    "softmax_last": (lambda a: ops.softmax(a, -1), lambda a: torch.softmax(a, -1), (X3,)),
    "log_softmax": (lambda a: ops.log_softmax(a, 2), lambda a: torch.log_softmax(a, 2), (X3,)),
    "argmax_is_int32": (lambda a: ops.argmax(a, 1), lambda a: a.argmax(1).int(), (X3,)),
    "argmin_keepdim": (lambda a: ops.argmin(a, 2, True), lambda a: a.argmin(2, True).int(), (X3,)),
    "topk": (
        lambda a: ops.topk(a, 2, axis=2),
        lambda a: [a.topk(2, 2)[0], a.topk(2, 2)[1].int()],
        (X3,),
    ),
    "onehot": (
        lambda i, v: ops.onehot(i, 4, v),
        lambda i, v: torch.where(torch.nn.functional.one_hot(i.long(), 4).bool(), v[1], v[0]),
        (np.array([3, 0, 1], np.int32), np.array([-1.0, 2.0], np.float32)),
    ),
    "layer_norm": (
        lambda a, w, b: ops.layer_norm(a, w, b),
        lambda a, w, b: torch.nn.functional.layer_norm(a, (4,), w, b),
        (X3, f32(4), f32(4)),
    ),
}


def _gather_reference(case, arrays):
    if case == "gather_axis0":
        return np.take(arrays[0], [2, 0, 2], axis=0)
    if case == "gather_2d_indices_axis2":
        return np.take(arrays[0], IDX, axis=2)
    return np.take(arrays[0], arrays[1], axis=1)


@pytest.mark.parametrize("case", SHAPE_OPS)
def test_shape_and_linear_algebra_op_matches_torch_eager(case, executor):
    pop_fn, torch_fn, arrays = SHAPE_OPS[case]
    got = run_graph(pop_fn, *arrays, executor=executor)
    want = _gather_reference(case, arrays) if torch_fn is None else torch_fn(*torch_args(arrays))
    if isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            expect(g, w)
    else:
        expect(got, want, rtol=1e-5, atol=1e-5)


def test_reshape_and_transpose_reject_bad_shapes_naming_the_tensor():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.zeros((2, 3), np.float32), name="x")
        with pytest.raises(ValueError, match=r"'x'.*\(2, 3\).*\(4, 2\)"):
            ops.reshape(x, (4, 2))
        with pytest.raises(ValueError, match="at most one -1"):
            ops.reshape(x, (-1, -1))
        with pytest.raises(ValueError, match=r"\(0, 0\) is not a permutation.*'x'"):
            ops.transpose(x, (0, 0))
        with pytest.raises(ValueError, match="not divisible by 4"):
            ops.split(x, 4, axis=1)
        with pytest.raises(ValueError, match=r"\[1, 1\] do not add up"):
            ops.split(x, [1, 1], axis=1)


# ----------------------------------------------------------------------------------------
# Reductions: PopXL keeps the input dtype (torch would promote integer sums to int64)
# ----------------------------------------------------------------------------------------

REDUCTIONS = {
    "reduce_sum": (ops.reduce_sum, lambda a, axes, k: a.sum(axes, keepdim=k, dtype=a.dtype)),
    "reduce_mean": (ops.reduce_mean, lambda a, axes, k: a.mean(axes, keepdim=k)),
    "reduce_max": (ops.reduce_max, lambda a, axes, k: a.amax(axes, keepdim=k)),
    "reduce_min": (ops.reduce_min, lambda a, axes, k: a.amin(axes, keepdim=k)),
    "reduce_prod": (
        ops.reduce_prod,
        lambda a, axes, k: np.prod(a.numpy(), tuple(axes), keepdims=k, dtype=a.numpy().dtype),
    ),
    "reduce_sum_square": (
        ops.reduce_sum_square,
        lambda a, axes, k: (a * a).sum(axes, keepdim=k, dtype=a.dtype),
    ),
}
AXES = {"all": None, "int": 1, "list": [0, 2], "negative": -1}


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("case", REDUCTIONS)
def test_reduction_matches_torch_eager(case, axes, keepdims, executor):
    pop_fn, torch_fn = REDUCTIONS[case]
    axis = AXES[axes]
    torch_axes = list(range(3)) if axis is None else ([axis] if isinstance(axis, int) else axis)
    got = run_graph(lambda a: pop_fn(a, axis, keepdims), X3, executor=executor)
    expect(got, torch_fn(torch.from_numpy(X3), torch_axes, keepdims), rtol=1e-5)


@pytest.mark.parametrize(
    "case", ["reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_sum_square"]
)
def test_integer_reduction_keeps_int32(case, executor):
    pop_fn, torch_fn = REDUCTIONS[case]
    xi = i32(2, 3, 4, low=-3, high=4)
    got = run_graph(lambda a: pop_fn(a, [1, 2]), xi, executor=executor)
    expect(got, torch_fn(torch.from_numpy(xi), [1, 2], False))


def test_reduce_median_matches_torch_lower_median(executor):
    x = f32(3, 4)
    got = run_graph(lambda a: ops.reduce_median(a, 1), x, executor=executor)
    expect(got, torch.from_numpy(x).median(1).values)


# ----------------------------------------------------------------------------------------
# Losses (spec §9 formulas, §11.20 numbers)
# ----------------------------------------------------------------------------------------

PROBS = np.array([[0.25, 0.75], [0.5, 0.5]], np.float32)
LABELS = np.array([1, 0], np.int32)

# (reduction, ignore_index) -> (loss, dx), spec §11.20.
NLL_SOFTMAX_GRAD = {
    ("mean", None): (0.4904144, [[0.125, -0.125], [-0.25, 0.25]]),
    ("sum", None): (0.9808289, [[0.25, -0.25], [-0.5, 0.5]]),
    ("none", None): ([0.2876819, 0.6931469], [[0.25, -0.25], [-0.5, 0.5]]),
    ("mean", 0): (0.2876819, [[0.25, -0.25], [0.0, 0.0]]),
}


@pytest.mark.parametrize("reduction,ignore_index", NLL_SOFTMAX_GRAD)
def test_nll_loss_with_softmax_grad_matches_spec_numbers(reduction, ignore_index, executor):
    want_loss, want_dx = NLL_SOFTMAX_GRAD[reduction, ignore_index]
    loss, dx = run_graph(
        lambda p, lab: ops.nll_loss_with_softmax_grad(
            p, lab, ignore_index=ignore_index, reduction=reduction
        ),
        PROBS,
        LABELS,
        executor=executor,
    )
    expect(loss, np.asarray(want_loss, np.float32), rtol=1e-6)
    expect(dx, np.asarray(want_dx, np.float32))


def test_nll_loss_with_softmax_grad_scales_by_a_loss_grad_tensor(executor):
    loss, dx = run_graph(
        lambda p, lab, g: ops.nll_loss_with_softmax_grad(p, lab, loss_grad=g, reduction="sum"),
        PROBS,
        LABELS,
        np.array(2.0, np.float32),
        executor=executor,
    )
    expect(loss, np.float32(0.9808289))
    expect(dx, 2 * np.array([[0.25, -0.25], [-0.5, 0.5]], np.float32))


def test_nll_loss_with_softmax_grad_mean_dx_is_the_cross_entropy_gradient(executor):
    # dx of 'mean' is d/dlogits of torch's cross entropy when probs = softmax(logits).
    logits = torch.from_numpy(f32(5, 4)).requires_grad_()
    labels = np.array([0, 3, 1, 1, 2], np.int32)
    torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels).long()).backward()
    probs = torch.softmax(logits, 1).detach().numpy()
    loss, dx = run_graph(ops.nll_loss_with_softmax_grad, probs, labels, executor=executor)
    np.testing.assert_allclose(dx, logits.grad.numpy(), rtol=1e-5, atol=1e-6)
    want = torch.nn.functional.nll_loss(
        torch.log(torch.from_numpy(probs) + 1e-7), torch.from_numpy(labels).long()
    )
    np.testing.assert_allclose(loss, want.numpy(), rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, 2])
def test_nll_loss_matches_torch_nll_of_clamped_log(reduction, ignore_index, executor):
    probs = np.array(
        [[0.1, 0.2, 0.7], [0.0, 0.5, 0.5], [0.3, 0.3, 0.4], [0.6, 0.2, 0.2]], np.float32
    )
    labels = np.array([2, 0, 1, 2], np.int32)  # row 1 picks p = 0: the loss uses max(p, 1e-7)
    got = run_graph(
        lambda p, lab: ops.nll_loss(p, lab, ignore_index=ignore_index, reduction=reduction),
        probs,
        labels,
        executor=executor,
    )
    logp = torch.log(torch.clamp(torch.from_numpy(probs), min=1e-7))
    want = torch.nn.functional.nll_loss(
        logp, torch.from_numpy(labels).long(), reduction=reduction,
        ignore_index=-100 if ignore_index is None else ignore_index,
    )  # fmt: skip
    expect(got, want, rtol=1e-6)


def test_nll_loss_with_log_probs_is_minus_the_picked_value(executor):
    logp = np.log(PROBS)
    got = run_graph(
        lambda p, lab: ops.nll_loss(p, lab, reduction="sum", log_prob=True),
        logp,
        LABELS,
        executor=executor,
    )
    expect(got, np.float32(-(logp[0, 1] + logp[1, 0])))


def test_loss_rejects_an_unknown_reduction():
    ir = popxl.Ir()
    with ir.main_graph:
        p, lab = popxl.constant(PROBS), popxl.constant(LABELS)
        for fn in (ops.nll_loss, ops.nll_loss_with_softmax_grad):
            with pytest.raises(ValueError, match="'avg'"):
                fn(p, lab, reduction="avg")


# ----------------------------------------------------------------------------------------
# Variable updates (spec §9; numbers from §11.18, §11.19, §11.21)
# ----------------------------------------------------------------------------------------


def run_update(fn, *initial, executor="fast", runs=1):
    """Variables from ``initial``; ``fn(*vars)`` in sequence; ``runs`` runs. Returns
    (the stored result of ``fn`` from the last run, the variables' final host values)."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        vs = [popxl.variable(np.asarray(a), name=f"v{i}") for i, a in enumerate(initial)]
        out = fn(*vs)
        d2h = popxl.d2h_stream(out.shape, out.dtype, "out")
        ops.host_store(d2h, out)
    with popxl.Session(ir, executor=executor) as session:
        for _ in range(runs):
            result = session.run()[d2h]
        values = session.get_tensors_data(vs)
    return result, [values[v] for v in vs]


def f(x):
    return np.asarray(x, np.float32)


# name -> (update, initial values, expected returned value, expected variable values)
VAR_UPDATES = {
    "accumulate_": (lambda t, x: ops.accumulate_(t, x), (f([1, 2]), f([3, 5])), f([4, 7]), None),
    "accumulate_factor": (
        lambda t, x: ops.accumulate_(t, x, 0.5),
        (f([1, 2]), f([3, 5])),
        f([2.5, 4.5]),
        None,
    ),
    "accumulate_tensor_factor": (
        lambda t, x, s: ops.accumulate_(t, x, s),
        (f([1, 2]), f([3, 5]), f(-2)),
        f([-5, -8]),
        None,
    ),
    "accumulate_mixed_precision_keeps_t_dtype": (
        lambda t, x: ops.accumulate_(t, x),
        (f([1, 2]), np.array([0.5, 0.25], np.float16)),
        f([1.5, 2.25]),
        None,
    ),
    "accumulate_square_": (
        lambda t, x: ops.accumulate_square_(t, x, 2.0),
        (f([1, 2]), f([3, -1])),
        f([19, 4]),
        None,
    ),
    "accumulate_square_tensor_factor": (
        lambda t, x, s: ops.accumulate_square_(t, x, s),
        (f([1, 2]), f([3, -1]), f(0.5)),
        f([5.5, 2.5]),
        None,
    ),
    # §11.18: 0 -> mean-accumulate 1 with step 0 gives 1, then 2 with step 1 gives 1.5.
    "accumulate_mean_": (
        lambda t, x1, x2: (ops.accumulate_mean_(t, x1, 0.0), ops.accumulate_mean_(t, x2, 1))[1],
        (f(0), f(1), f(2)),
        f(1.5),
        None,
    ),
    "accumulate_mean_tensor_step": (
        lambda t, x, s: ops.accumulate_mean_(t, x, s),
        (f(1.5), f(3), f(2)),
        f(2.0),
        None,
    ),
    # §11.21: t=1, X=3, f=0.9.
    "accumulate_moving_average_": (
        lambda t, x: ops.accumulate_moving_average_(t, x, 0.9),
        (f(1), f(3)),
        f(1.2),
        None,
    ),
    "accumulate_moving_average_square_": (
        lambda t, x: ops.accumulate_moving_average_square_(t, x, 0.9),
        (f(1), f(3)),
        f(1.8),
        None,
    ),
    "accumulate_moving_average_tensor_factor": (
        lambda t, x, s: ops.accumulate_moving_average_(t, x, s),
        (f(1), f(3), f(0.9)),
        f(1.2),
        None,
    ),
    "accumulator_scale_": (
        lambda t: ops.accumulator_scale_(t, 0.5),
        (f([2, -4]),),
        f([1, -2]),
        None,
    ),
    "accumulator_scale_tensor": (
        lambda t, s: ops.accumulator_scale_(t, s),
        (f([2, -4]), f(3)),
        f([6, -12]),
        None,
    ),
    # A constant 0 zeroes t, so NaN and Inf become 0 (a multiply would keep NaN).
    "accumulator_scale_zero_clears_nan": (
        lambda t: ops.accumulator_scale_(t, 0.0),
        (f([np.nan, np.inf, 3]),),
        f([0, 0, 0]),
        None,
    ),
    "accumulator_zero_": (lambda t: ops.accumulator_zero_(t), (f([np.nan, -1]),), f([0, 0]), None),
    "copy_var_update_": (
        lambda t, x: ops.copy_var_update_(t, x),
        (f([1, 2]), f([7, 8])),
        f([7, 8]),
        None,
    ),
    "copy_var_update_scalar": (lambda t: ops.copy_var_update_(t, 5.0), (f(1),), f(5), None),
    "scaled_add": (
        lambda x, y: ops.scaled_add(x, y, 2.0, -1.0),
        (f([1, 2]), f([3, 5])),
        f([-1, -1]),
        [f([1, 2]), f([3, 5])],
    ),
    "scaled_add_tensor_scales": (
        lambda x, y, a, b: ops.scaled_add(x, y, a, b),
        (f([1, 2]), f([3, 5]), f(0.5), f(2)),
        f([6.5, 11]),
        [f([1, 2]), f([3, 5]), f(0.5), f(2)],
    ),
    "scaled_add_": (
        lambda x, y: ops.scaled_add_(x, y, 3.0, 0.5),
        (f([1, 2]), f([4, 6])),
        f([5, 9]),
        None,
    ),
    "scaled_add_float_a_one_tensor_b": (
        lambda x, y, b: ops.scaled_add_(x, y, 1.0, b),
        (f([1, 2]), f([4, 6]), f(-1)),
        f([-3, -4]),
        None,
    ),
    "sparse_accumulate_": (
        lambda t, x, i: ops.sparse_accumulate_(t, x, i, axis=0, f=2.0),
        (f([[0, 0], [1, 1], [2, 2]]), f([[1, 2], [3, 4]]), np.array([2, 0], np.int32)),
        f([[6, 8], [1, 1], [4, 6]]),
        None,
    ),
    "tensor_iadd_is_in_place_add": (
        lambda t, x: t.__iadd__(x),
        (f([1, 2]), f([3, 4])),
        f([4, 6]),
        None,
    ),
    "tensor_iadd_scalar": (lambda t: t.__iadd__(1.5), (f([1, 2]),), f([2.5, 3.5]), None),
}


@pytest.mark.parametrize("case", VAR_UPDATES)
def test_var_update_matches_spec_formula(case, executor):
    fn, initial, want, want_vars = VAR_UPDATES[case]
    result, values = run_update(fn, *initial, executor=executor)
    expect(result, want)
    # In-place updates return an alias of t: t's own final value is the returned value.
    want_vars = want_vars or [want, *initial[1:]]
    for got, w in zip(values, want_vars, strict=True):
        expect(np.asarray(got), np.asarray(w))


def test_in_place_update_is_seen_by_later_readers_of_the_variable(executor):
    # §11.10: copy_var_update_(x, 5.0) then host_store(x) inside in_sequence gives 5.0.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(1.0, name="x")
        ops.copy_var_update_(x, popxl.constant(5.0))
        d2h = popxl.d2h_stream(x.shape, x.dtype, "x_out")
        ops.host_store(d2h, x)
    with popxl.Session(ir, executor=executor) as session:
        expect(session.run()[d2h], f(5.0))


ADAM_M, ADAM_V = 0.1, 0.01


def _adam_reference(t, decay=0.0, w=2.0, b1=0.9, b2=0.999, eps=1e-7):
    mc, vc = ADAM_M / (1 - b1**t), ADAM_V / (1 - b2**t)
    return mc / (math.sqrt(vc) + eps) + decay * w


@pytest.mark.parametrize("runs", [1, 2])
def test_adam_updater_increments_time_step_before_use(runs, executor):
    # §11.19: m=0.1, v=0.01, time_step 0 -> 1 on the first call: x = 1/(sqrt(10)+1e-7).
    result, (m, v, step) = run_update(
        lambda m, v, s: ops.adam_updater(m, v, time_step=s, beta1=0.9, beta2=0.999),
        f(ADAM_M), f(ADAM_V), f(0), executor=executor, runs=runs,
    )  # fmt: skip
    expect(np.asarray(step), f(runs))
    # float32 1 - b2**t loses ~5 digits to cancellation, hence rtol 5e-5 against float64.
    np.testing.assert_allclose(result, _adam_reference(runs), rtol=5e-5)
    if runs == 1:
        np.testing.assert_allclose(result, 0.3162278, rtol=1e-5)
    expect(np.asarray(m), f(ADAM_M))
    expect(np.asarray(v), f(ADAM_V))


def test_adam_updater_with_weight_decay_matches_spec(executor):
    result, _ = run_update(
        lambda m, v, s, w: ops.adam_updater(m, v, w, s, weight_decay=0.1, beta1=0.9, beta2=0.999),
        f(ADAM_M), f(ADAM_V), f(0), f(2.0), executor=executor,
    )  # fmt: skip
    np.testing.assert_allclose(result, 0.5162278, rtol=1e-5)
    assert result.dtype == np.float32


def test_adam_updater_without_time_step_has_no_bias_correction(executor):
    result, _ = run_update(lambda m, v: ops.adam_updater(m, v, beta1=0.9, beta2=0.999), f(ADAM_M), f(ADAM_V),
                           executor=executor)  # fmt: skip
    np.testing.assert_allclose(result, 0.1 / (0.1 + 1e-7), rtol=1e-6)  # ≈ 0.999999


def test_adam_var_update_applies_the_lamb_trust_ratio(executor):
    # w -= lr * min(sqrt r1, mwn) / sqrt r2 * x = 1 - 0.1 * min(2, 1.5) / 3 * 6
    result, _ = run_update(
        lambda w, x, r1, r2: ops.adam_var_update(w, x, r1, r2, learning_rate=0.1, max_weight_norm=1.5),
        f(1.0), f(6.0), f(4.0), f(9.0), executor=executor,
    )  # fmt: skip
    np.testing.assert_allclose(result, 1 - 0.1 * 1.5 / 3 * 6, rtol=1e-6)


def test_var_update_argument_errors():
    ir = popxl.Ir()
    with ir.main_graph:
        m, v = popxl.variable(f(0.1)), popxl.variable(f(0.01))
        step = popxl.variable(f(0))
        with pytest.raises(ValueError, match="beta1 and beta2"):
            ops.adam_updater(m, v, time_step=step, beta1=0.9)
        with pytest.raises(ValueError, match=r"^Weight decay requires weight to be not None\."):
            ops.adam_updater(m, v, weight_decay=0.1)
        with pytest.raises(PopXLError, match="factor of 0"):
            ops.accumulate_(m, v, 0.0)
        with pytest.raises(PopXLError, match="scale0 with non-tensor scale1"):
            ops.scaled_add(m, v, a=step, b=2.0)
        with pytest.raises(PopXLError, match="must be 1.0"):
            ops.scaled_add(m, v, a=2.0, b=step)
        with pytest.raises(ValueError, match=r"\(2,\).*\(\).*do not broadcast"):
            ops.accumulate_(popxl.variable(f([1, 2]), name="two"), m)


# ----------------------------------------------------------------------------------------
# Tensor operators and indexing
# ----------------------------------------------------------------------------------------

OPERATORS = {
    "add": (lambda a, b: a + b, (X, Y)),
    "radd_scalar": (lambda a: 2.0 + a, (X,)),
    "sub": (lambda a, b: a - b, (X, Y)),
    "rsub_scalar": (lambda a: 1.0 - a, (X,)),
    "mul": (lambda a, b: a * b, (X, Y)),
    "rmul_numpy": (lambda a: ROW * a, (X,)),
    "truediv": (lambda a, b: a / b, (X, POS)),
    "rtruediv_scalar": (lambda a: 3.0 / a, (POS,)),
    "mod_is_fmod": (lambda a: a % 0.7, (X,)),
    "rmod_scalar": (lambda a: 2.5 % a, (POS,)),
    "matmul": (lambda a, b: a @ b.T, (X, Y)),
    "pow": (lambda a: a**2, (X,)),
    "rpow": (lambda a: 2.0**a, (X,)),
    "neg": (lambda a: -a, (X,)),
    "int_truediv_truncates": (lambda a, b: a / b, (XI, YI)),
    "int_mod": (lambda a, b: a % b, (XI, YI)),
    "int_neg": (lambda a: -a, (XI,)),
    "and": (lambda a, b: a & b, (B, B2)),
    "or": (lambda a, b: a | b, (B, B2)),
    "invert": (lambda a: ~a, (B,)),
    "greater_than": (lambda a, b: a > b, (X, Y)),
    "less_equal_scalar": (lambda a: a <= 0.25, (X,)),
}


def _operator_reference(case, arrays):
    ts = torch_args(arrays)
    if case == "rmul_numpy":
        return torch.from_numpy(ROW) * ts[0]
    if case == "mod_is_fmod":
        return torch.fmod(ts[0], 0.7)
    if case == "rmod_scalar":
        return torch.fmod(torch.full_like(ts[0], 2.5), ts[0])
    if case == "int_truediv_truncates":
        return torch.div(ts[0], ts[1], rounding_mode="trunc")
    if case == "int_mod":
        return torch.fmod(ts[0], ts[1])
    if case == "and":
        return ts[0] & ts[1]
    if case == "or":
        return ts[0] | ts[1]
    if case == "invert":
        return ~ts[0]
    return None


@pytest.mark.parametrize("case", OPERATORS)
def test_tensor_operator_matches_torch_eager(case, executor):
    fn, arrays = OPERATORS[case]
    got = run_graph(fn, *arrays, executor=executor)
    want = _operator_reference(case, arrays)
    if want is None:
        want = fn(*torch_args(arrays))
    expect(got, want, rtol=1e-5, atol=1e-6)


def test_rmatmul_with_a_numpy_lhs_dispatches_to_the_tensor(executor):
    lhs = f32(4, 2)
    got = run_graph(lambda a: lhs @ a, X, executor=executor)
    expect(got, torch.from_numpy(lhs) @ torch.from_numpy(X), rtol=1e-5)


def test_operator_coerces_the_scalar_to_the_tensor_dtype(executor):
    # int32 tensor + 2.9: the constant becomes int32 2, the result stays int32 (spec §3.2).
    got = run_graph(lambda a: a + 2.9, XI, executor=executor)
    expect(got, XI + np.int32(2))


def test_operator_with_an_empty_value_raises():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X, name="x")
        with pytest.raises(ValueError, match="'x'.*empty"):
            _ = x + []


INDEXING = {
    "int": lambda a: a[1],
    "negative_int": lambda a: a[-1, 2],
    "slice": lambda a: a[:, 1:3],
    "ints_and_slices": lambda a: a[1, ::2, 1:3],
    "step": lambda a: a[:, ::2, 1::2],
    "negative_step": lambda a: a[::-1],
    "negative_steps_mixed": lambda a: a[:, ::-2, 3:0:-2],
    "negative_step_empty": lambda a: a[:, 0:2:-1],
    "ellipsis_negative_step": lambda a: a[..., ::-3],
    "newaxis": lambda a: a[None, 1],
}


@pytest.mark.parametrize("case", INDEXING)
def test_basic_indexing_matches_numpy(case, executor):
    got = run_graph(INDEXING[case], X3, executor=executor)
    expect(got, INDEXING[case](X3))


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_integer_array_index_gathers_on_axis_0(kind, executor):
    idx = np.array([[2, 0], [1, 2]], np.int32)
    x = f32(3, 4)
    got = run_graph(
        lambda a: a[popxl.constant(idx) if kind == "tensor" else idx], x, executor=executor
    )
    expect(got, x[idx])


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_bool_mask_index_keeps_the_shape_and_zeroes_false(kind, executor):
    # Unlike numpy, a bool mask is where(mask, x, 0) (spec §3.2).
    mask = X3 > 0
    got = run_graph(
        lambda a: a[popxl.constant(mask) if kind == "tensor" else mask], X3, executor=executor
    )
    expect(got, np.where(mask, X3, np.float32(0)))


def test_loaded_bool_mask_index(executor):
    got = run_graph(lambda a, m: a[m], X, B, executor=executor)
    expect(got, np.where(B, X, np.float32(0)))


def test_tensor_methods_T_transpose_reshape_flatten_diag(executor):
    sq = f32(3, 3)
    got = run_graph(
        lambda a, s: (
            a.T,
            a.transpose((1, 2, 0)),
            a.reshape((6, 4)),
            a.flatten(),
            s.diag(),
            a.detach(),
        ),
        X3,
        sq,
        executor=executor,
    )
    want = [
        X3.transpose(),
        X3.transpose(1, 2, 0),
        X3.reshape(6, 4),
        X3.reshape(-1),
        np.diag(sq),
        X3,
    ]
    for g, w in zip(got, want, strict=True):
        expect(g, w)


def test_diag_of_a_non_matrix_raises_naming_the_tensor():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X3, name="cube")
        with pytest.raises(ValueError, match=r"'cube'.*\(2, 3, 4\)"):
            x.diag()


def test_plus_equals_on_a_variable_updates_it_in_place(executor):
    # `+=` is add_: the variable itself holds the sum.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        w = original = popxl.variable(f([1, 2]), name="w")
        w += popxl.constant(f([3, 4]))
        w += 0.5
        d2h = popxl.d2h_stream(original.shape, original.dtype, "w_out")
        ops.host_store(d2h, original)
    assert w.dtype == original.dtype
    with popxl.Session(ir, executor=executor) as session:
        expect(session.run()[d2h], f([4.5, 6.5]))
        expect(session.get_tensor_data(original), f([4.5, 6.5]))
        expect(session.run()[d2h], f([8, 11]))  # the update persists across runs
