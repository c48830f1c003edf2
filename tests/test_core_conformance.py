"""PopXL core behaviour found different from upstream by the conformance sweep, each compared
with an independent reference (eager torch, numpy or hand-computed values)."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.transforms import autodiff

EXECUTORS = ("fast", "reference")
rng = np.random.default_rng(0)


def run(build, executor="fast", replication=1):
    """Build ``build() -> {name: tensor}`` in the main graph and return the host values."""
    ir = popxl.Ir(replication=replication)
    with ir.main_graph, popxl.in_sequence():
        outs = build()
        streams = {}
        for k, t in outs.items():
            s = popxl.d2h_stream(t.shape, t.dtype, k)
            ops.host_store(s, t)
            streams[k] = s
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        out = session.run()
    return {k: out[s] for k, s in streams.items()}


# ---- C12: matmul over every rank combination numpy allows ---------------------------------

MATMUL_SHAPES = [
    ((4,), (4, 3)),
    ((4,), (2, 4, 3)),
    ((4,), (2, 1, 4, 3)),
    ((3, 4), (4,)),
    ((2, 3, 4), (4,)),
    ((4,), (4,)),
    ((3, 4), (4, 5)),
    ((2, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 2)),
]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize(("ls", "rs"), MATMUL_SHAPES, ids=[f"{a}@{b}" for a, b in MATMUL_SHAPES])
def test_matmul_every_rank_combo_matches_torch_matmul(ls, rs, executor):
    a = rng.standard_normal(ls).astype(np.float32)
    b = rng.standard_normal(rs).astype(np.float32)
    want = torch.matmul(torch.from_numpy(a), torch.from_numpy(b)).numpy()

    def build():
        x, w = popxl.variable(a, name="x"), popxl.variable(b, name="w")
        g = popxl.gcg().ir.create_graph(lambda x, w: x @ w, x, w)
        (y_sub,) = ops.call(g, x, w)
        return {"op": ops.matmul(x, w), "at": x @ w, "sub": y_sub}

    got = run(build, executor)
    for k, v in got.items():
        assert v.shape == want.shape, k
        np.testing.assert_allclose(v, want, rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.parametrize(("ls", "rs"), [((4,), (4, 3)), ((3, 4), (4,)), ((4,), (2, 4, 3))])
def test_vector_matmul_gradients_match_torch_autograd(ls, rs):
    a = rng.standard_normal(ls).astype(np.float32)
    b = rng.standard_normal(rs).astype(np.float32)
    ta = torch.tensor(a, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True)
    ty = ta @ tb
    seed = rng.standard_normal(tuple(ty.shape)).astype(np.float32)
    ty.backward(torch.from_numpy(seed))

    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x, w = popxl.variable(a, name="x"), popxl.variable(b, name="w")
        fwd = ir.create_graph(lambda x, w: x @ w, x.spec, w.spec)
        info = ops.call_with_info(fwd, x, w)
        bwd = autodiff(fwd)
        dx, dw = ops.call(bwd.graph, popxl.constant(seed), inputs_dict=bwd.inputs_dict(info))
        streams = []
        for t in (dx, dw):
            streams.append(popxl.d2h_stream(t.shape, t.dtype))
            ops.host_store(streams[-1], t)
    with popxl.Session(ir, "ipu_hw") as session:
        out = session.run()
    np.testing.assert_allclose(out[streams[0]], ta.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[streams[1]], tb.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_inplace_squeeze_in_captured_torch_code_keeps_the_producer_shape():
    # Torch decompositions reshape fresh results in place (squeeze_); the recorded producer
    # must keep its own shape, so the IR verifies and the value is torch's.
    a = rng.standard_normal((3, 1, 4)).astype(np.float32)

    def build():
        x = popxl.variable(a, name="x")
        y = popxl.gcg().ir.create_graph(lambda x: (x * 2).squeeze_(1).t_() + 1, x)
        return {"y": ops.call(y, x)[0]}

    got = run(build)["y"]
    np.testing.assert_allclose(got, (a * 2).squeeze(1).T + 1, rtol=1e-6)


# ---- C9: onehot(t, num_classes, values, axis) ---------------------------------------------


def _numpy_onehot(idx, n, off, on, axis):
    out = np.where(idx[..., None] == np.arange(n), on, off)
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
def test_onehot_inserts_class_axis_like_numpy(axis):
    idx = np.array([[1, 5, 0], [2, 7, -1]], np.int32)  # 7 and -1 are out of range: all off
    want = _numpy_onehot(idx, 6, -2.0, 3.5, axis)

    def build():
        t = popxl.variable(idx, name="idx")
        n = popxl.constant(np.array(6, np.int32))
        values = popxl.constant(np.array([-2.0, 3.5], np.float32))
        return {"y": ops.onehot(t, n, values, axis)}

    got = run(build)["y"]
    assert got.shape == want.shape
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_onehot_upstream_unit_test_call():
    # upstream tests/unittests/python/popxl/ops/test_onehot.py builds exactly this call
    def build():
        t = popxl.variable(np.array([[1, 5]], np.int32))
        y = ops.onehot(t, popxl.constant(np.array(6, np.int32)),
                       popxl.constant(np.array([0, 1], np.int32)), 1)  # fmt: skip
        assert y.shape == (1, 6, 2) and y.dtype == popxl.int32
        return {"y": y}

    got = run(build)["y"]
    np.testing.assert_array_equal(got, _numpy_onehot(np.array([[1, 5]]), 6, 0, 1, 1))


def test_onehot_rejects_bad_arguments():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.array([1, 2], np.int32))
        values = popxl.constant(np.array([0.0, 1.0], np.float32))
        with pytest.raises(TypeError, match="must be a popxl.constant"):
            ops.onehot(t, popxl.variable(np.array(3, np.int32)), values, 0)
        with pytest.raises(ValueError, match="scalar integer"):
            ops.onehot(t, popxl.constant(np.array([3, 4], np.int32)), values, 0)
        with pytest.raises(ValueError, match="axis 2 is out of range"):
            ops.onehot(t, 3, values, 2)
        with pytest.raises(ValueError, match=r"shape \(2,\)"):
            ops.onehot(t, 3, popxl.constant(np.zeros(3, np.float32)), 0)


# ---- C3/C4: interpolate --------------------------------------------------------------------

X4 = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
X3 = rng.standard_normal((2, 3, 10)).astype(np.float32)


def _interp(x, *args, **kwargs):
    return run(lambda: {"y": ops.interpolate(popxl.variable(x), *args, **kwargs)})["y"]


def test_interpolate_upstream_positional_order():
    # upstream: interpolate(t, scale_factor, mode, nearest_mode, coordinate_transformation_mode)
    got = _interp(X4, (1.0, 1.0, 2.0, 3.0), "nearest", "round_prefer_floor", "half_pixel")
    want = torch.nn.functional.interpolate(torch.from_numpy(X4), scale_factor=(2, 3))
    np.testing.assert_array_equal(got, want.numpy())


TORCH_RESIZE = [
    # (input, scale_factor, mode, ctm, torch kwargs)
    (X3, (1.0, 1.0, 0.3), "linear", "half_pixel", dict(scale_factor=0.3, mode="linear")),
    (X3, (1.0, 1.0, 2.5), "linear", "half_pixel", dict(scale_factor=2.5, mode="linear")),
    (X3, (1.0, 1.0, 2.5), "linear", "pytorch_half_pixel", dict(scale_factor=2.5, mode="linear")),
    (X4, (1.0, 1.0, 2.0, 2.0), "linear", "half_pixel",
     dict(scale_factor=2.0, mode="bilinear", align_corners=False)),
    (X4, (1.0, 1.0, 2.0, 2.0), "linear", "align_corners",
     dict(size=(10, 8), mode="bilinear", align_corners=True)),
    (X4, (1.0, 1.0, 0.5, 1.5), "linear", "half_pixel",
     dict(scale_factor=(0.5, 1.5), mode="bilinear", align_corners=False)),
    (X4, (1.0, 1.0, 2.0, 2.0), "cubic", "half_pixel",
     dict(scale_factor=2.0, mode="bicubic", align_corners=False)),
    (X4, (1.0, 1.0, 2.0, 3.0), "cubic", "align_corners",
     dict(size=(10, 12), mode="bicubic", align_corners=True)),
    (X4, (1.0, 1.0, 2.0, 2.0), "nearest", "asymmetric", dict(scale_factor=2.0, mode="nearest")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("x", "scale", "mode", "ctm", "torch_kwargs"),
    TORCH_RESIZE,
    ids=[f"{m}-{c}-{s}" for _, s, m, c, _ in TORCH_RESIZE],
)
def test_interpolate_modes_match_torch_functional_interpolate(x, scale, mode, ctm, torch_kwargs):
    # torch's nearest is ONNX's asymmetric + floor rounding
    nearest = "floor" if mode == "nearest" else "round_prefer_floor"
    got = _interp(x, scale, mode, nearest, ctm)
    want = torch.nn.functional.interpolate(torch.from_numpy(x), **torch_kwargs).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_interpolate_linear_hand_values():
    x = np.array([[[0.0, 10.0, 20.0]]], np.float32)
    # asymmetric, scale 2: sources 0, .5, 1, 1.5, 2, 2.5 (the last past the edge: clamped)
    got = _interp(x, (1.0, 1.0, 2.0), "linear", coordinate_transformation_mode="asymmetric")
    np.testing.assert_allclose(got, [[[0, 5, 10, 15, 20, 20]]])
    # half_pixel, scale 2: sources -.25 (edge), .25, .75, 1.25, 1.75, 2.25 (edge)
    got = _interp(x, (1.0, 1.0, 2.0), "linear")
    np.testing.assert_allclose(got, [[[0, 2.5, 7.5, 12.5, 17.5, 20]]])
    # nearest rounding modes at the half_pixel ties of scale 2 (sources -.25, .25, .75, ...)
    got = _interp(x, (1.0, 1.0, 2.0), "nearest", "round_prefer_ceil")
    np.testing.assert_allclose(got, [[[0, 0, 10, 10, 20, 20]]])
    got = _interp(x, (1.0, 1.0, 2.0), "nearest", "ceil")
    np.testing.assert_allclose(got, [[[0, 10, 10, 20, 20, 20]]])


def test_interpolate_output_size_is_keyword_only_and_errors_name_the_choices():
    got = _interp(X3, mode="linear", output_size=(2, 3, 3))
    want = torch.nn.functional.interpolate(torch.from_numpy(X3), size=3, mode="linear")
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X3)
        with pytest.raises(ValueError, match="must be nearest, linear or cubic"):
            ops.interpolate(x, (1.0, 1.0, 2.0), "bilinear")
        with pytest.raises(ValueError, match="must be half_pixel"):
            ops.interpolate(x, (1.0, 1.0, 2.0), "linear", "floor", "corners")
        with pytest.raises(ValueError, match="needs 3 values"):
            ops.interpolate(x, (2.0, 2.0))
        with pytest.raises(TypeError, match="floating-point"):
            ops.interpolate(popxl.variable(np.zeros((2, 2), np.int32)), (1.0, 2.0), "linear")


# ---- A1: truthiness ------------------------------------------------------------------------


def test_bool_of_variables_constants_and_graph_inputs_is_true_as_upstream():
    ir = popxl.Ir()
    with ir.main_graph:
        w = popxl.variable(np.zeros((10, 10), np.float32), name="w")
        c = popxl.constant(np.zeros(()), name="c")
        assert w and c  # upstream popxl Tensor has no __bool__: every tensor is truthy
        assert (w or None) is w
        seen = []

        def body(x):
            seen.append(bool(x))
            return x + 1

        ir.create_graph(body, w)
        assert seen == [True]
        # a value computed by an op is still a data-dependent test
        with pytest.raises(popxl.errors.DataDependentError, match="where"):
            bool(w.sum() > 0)


def test_data_dependent_branch_in_compiled_torch_code_is_specialised():
    """A popxl graph's Python test of a computed value raises (above); popxl.compile, which
    has the real batch, specialises the branch to its value and checks it at every step
    (Note [guarded specialisation] in compile_guards.py)."""

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x) if x.sum() > 0 else -self.lin(x)

    m = Branchy()
    trainer = popxl.compile(
        m, torch.nn.functional.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1)
    )
    y = torch.zeros(4, dtype=torch.long)
    for x in (torch.ones(4, 3), -torch.ones(4, 3)):
        with torch.no_grad():
            eager = torch.nn.functional.cross_entropy(m(x), y).item()
        assert abs(trainer.step(x, y) - eager) < 1e-6


# ---- AD2: adam/lamb updater dtype ---------------------------------------------------------


@pytest.mark.parametrize("name", ["adam_updater", "lamb_updater"])
def test_adam_updater_dtype_follows_upstream_connection_rule(name):
    # Upstream popxl connects `weight` only when weight decay is on (var_updates/adam_updater.py),
    # and AdamUpdaterOp::setup gives the updater the weight's dtype when it is connected, else
    # the first-order state's.
    updater = getattr(ops.var_updates, name)
    m16 = np.full((2,), 0.1, np.float16)
    v32 = np.full((2,), 0.01, np.float32)
    w32 = np.array([1.0, -2.0], np.float32)

    def build():
        m = popxl.variable(m16, popxl.float16)
        v, w = popxl.variable(v32), popxl.variable(w32)
        kw = dict(time_step=None, beta1=0.9, beta2=0.999, epsilon=1e-5)
        decayed = updater(m, v, weight=w, weight_decay=0.1, **kw)
        plain = updater(m, v, weight=w, weight_decay=0.0, **kw)
        assert decayed.dtype == popxl.float32 and plain.dtype == popxl.float16
        return {"decayed": decayed, "plain": plain}

    got = run(build)
    m = m16.astype(np.float32)
    np.testing.assert_allclose(got["decayed"], m / (np.sqrt(v32) + 1e-5) + 0.1 * w32, rtol=1e-6)
    np.testing.assert_allclose(got["plain"], (m / (np.sqrt(v32) + 1e-5)).astype(np.float16))


# ---- R1: shard_grouping (SDK 3.3 RTS API) -------------------------------------------------


def test_shard_grouping_rts_matches_unsharded_matmul():
    # ported from upstream tests/integration/popxl/test_replica_sharding.py
    ir = popxl.Ir(replication=8)
    w_rts = ir.replica_grouping(group_size=4)
    m_rts = ir.replica_grouping(group_size=2)
    xs = rng.standard_normal((8, 4, 4)).astype(np.float32)
    w_np = rng.standard_normal((4, 4)).astype(np.float32)
    m_np = rng.standard_normal((4, 4)).astype(np.float32)
    with ir.main_graph, popxl.in_sequence():
        h2d = popxl.h2d_stream((4, 4), popxl.float32)
        x = ops.host_load(h2d)
        w_v, w_shard = popxl.replica_sharded_variable(
            w_np, popxl.float32, "w", shard_grouping=w_rts
        )
        m_buffer = popxl.replica_sharded_buffer(m_np.shape, popxl.float32, shard_grouping=m_rts)
        m_v = popxl.remote_replica_sharded_variable(m_np, m_buffer, shard_grouping=m_rts)
        assert w_shard.shape == (4,) and m_buffer.tensor_shape == (8,)
        w = ops.collectives.replicated_all_gather(w_shard, group=w_rts)
        m = ops.collectives.replicated_all_gather(ops.remote_load(m_buffer, 0), group=m_rts)
        z = (x @ w) @ m
        d2h = popxl.d2h_stream(z.shape, z.dtype)
        ops.host_store(d2h, z)
    with popxl.Session(ir, "ipu_hw") as session:
        out = session.run({h2d: xs})[d2h]
        np.testing.assert_allclose(session.get_tensor_data(w_v), w_np)
        np.testing.assert_allclose(session.get_tensor_data(m_v), m_np)
    np.testing.assert_allclose(out, xs @ w_np @ m_np, rtol=1e-5, atol=1e-5)


def test_shard_grouping_with_strided_replica_grouping_matches_shard_over():
    ir = popxl.Ir(replication=8)
    rg = ir.replica_grouping(stride=2, group_size=4)  # groups {0,2,4,6}, {1,3,5,7}
    data = rng.standard_normal((2, 6)).astype(np.float32)
    with ir.main_graph:
        a = popxl.replica_sharded_buffer(
            data.shape,
            popxl.float32,
            rg,
            shard_grouping=ir.replica_grouping(stride=2, group_size=2),
        )
        b = popxl.replica_sharded_buffer(data.shape, popxl.float32, rg, shard_over=2)
        c = popxl.replica_sharded_buffer(data.shape, popxl.float32, rg, ir.replica_grouping(2, 2))
        assert a.tensor_shape == b.tensor_shape == c.tensor_shape == (3,)
        assert a._rts_shard_over == b._rts_shard_over == c._rts_shard_over == 2


def test_invalid_shard_grouping_raises_value_error():
    # upstream test_invalid_sharding_factor, plus the conflicts torch_popxl can detect
    ir = popxl.Ir(replication=8)
    with ir.main_graph:
        with pytest.raises(ValueError):
            popxl.replica_sharded_buffer(
                (4, 4), popxl.float32, shard_grouping=ir.replica_grouping(group_size=16)
            )
        with pytest.raises(ValueError, match="must have stride 1"):
            popxl.replica_sharded_buffer(
                (4, 4), popxl.float32, shard_grouping=ir.replica_grouping(stride=2)
            )
        with pytest.raises(ValueError, match="larger than the replica group size 4"):
            popxl.replica_sharded_buffer(
                (4, 4), popxl.float32, replica_grouping=ir.replica_grouping(group_size=4),
                shard_grouping=ir.replica_grouping(group_size=8),
            )  # fmt: skip
        with pytest.raises(ValueError, match="stride 4"):
            popxl.replica_sharded_buffer(
                (4, 4), popxl.float32, replica_grouping=ir.replica_grouping(stride=4),
                shard_grouping=ir.replica_grouping(stride=2),
            )  # fmt: skip
        with pytest.raises(ValueError, match="Pass only one"):
            popxl.replica_sharded_buffer(
                (4, 4),
                popxl.float32,
                shard_over=4,
                shard_grouping=ir.replica_grouping(group_size=4),
            )
        buf = popxl.replica_sharded_buffer((4, 4), popxl.float32, shard_over=4)
        with pytest.raises(ValueError, match="shards over 2 replicas"):
            popxl.remote_replica_sharded_variable(
                np.zeros((4, 4), np.float32), buf, shard_grouping=ir.replica_grouping(group_size=2)
            )
    assert len(ir.main_graph.variables) == 0  # the failed calls left no variable behind


# ---- C5 subsample, C13 concat dtypes, C7 float8 data movement ------------------------------


def test_subsample_int_stride_and_length_check():
    v_np = np.arange(10, dtype=np.int32)
    m_np = np.arange(50 * 24, dtype=np.int32).reshape(50, 24)

    def build():
        v, m = popxl.variable(v_np), popxl.variable(m_np)
        return {"v": ops.subsample(v, 2), "m": ops.subsample(m, [3, 5])}

    got = run(build)
    np.testing.assert_array_equal(got["v"], v_np[::2])
    np.testing.assert_array_equal(got["m"], m_np[::3, ::5])
    ir = popxl.Ir()
    with ir.main_graph:
        m = popxl.variable(m_np)
        with pytest.raises(ValueError, match="The length of subsample `strides` must match"):
            ops.subsample(m, [2])
        with pytest.raises(ValueError, match="positive"):
            ops.subsample(m, [0, 1])


@pytest.mark.parametrize("fn", ["concat", "concat_"])
def test_concat_mixed_dtypes_raise_type_error_as_upstream(fn):
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.zeros(2, np.float32))
        b = popxl.variable(np.zeros(2, np.float16))
        with pytest.raises(TypeError, match="All inputs to a concat operation must have the same"):
            getattr(ops, fn)([a, b], 0)
        f8a = popxl.variable(np.zeros(2, np.float32), dtype=popxl.float8_143)
        f8b = popxl.variable(np.zeros(2, np.float32), dtype=popxl.float8_152)
        with pytest.raises(TypeError, match="All inputs to a concat operation must have the same"):
            getattr(ops, fn)([f8a, f8b], 0)
        assert getattr(ops, fn)([a, a], 0).shape == (4,)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("dtype", ["float8_143", "float8_152"])
def test_float8_rts_variable_all_gather_and_slices_move_bytes_exactly(dtype, executor):
    from torch_popxl.utils import host_pow2scale_then_cast

    dt = getattr(popxl, dtype)
    data = np.array([1.0, 2.0, -0.5, 3.0], np.float32)
    want = host_pow2scale_then_cast(data, dt, 1, True)  # the host encoding of 2 * data
    ir = popxl.Ir(replication=2)
    with ir.main_graph, popxl.in_sequence():
        x, shard = popxl.replica_sharded_variable(
            data, dtype=dt, log2_scale=1, nan_on_overflow=True
        )
        full = ops.collectives.replicated_all_gather(shard)
        sliced = ops.collectives.replica_sharded_slice(full)
        again = ops.collectives.replicated_all_gather(sliced)
        halves = ops.collectives.replicated_slice(full)
        outs = {}
        for k, t in {"full": full, "again": again, "half": halves}.items():
            as_f32 = ops.cast(t, popxl.float32)  # float8 values are exact in float32
            outs[k] = popxl.d2h_stream(as_f32.shape, as_f32.dtype)
            ops.host_store(outs[k], as_f32)
        with pytest.raises(TypeError, match="float32, float16, int32, uint32"):
            ops.collectives.replicated_all_reduce(full)  # a reduction still needs arithmetic
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        out = session.run()
        np.testing.assert_array_equal(
            session.get_tensor_data(x).view(np.uint8), want.view(np.uint8)
        )
    for k in ("full", "again"):
        np.testing.assert_array_equal(out[outs[k]], np.stack([2 * data] * 2), err_msg=k)
    np.testing.assert_array_equal(out[outs["half"]], (2 * data).reshape(2, 2))


# ---- C8: print_tensor format ---------------------------------------------------------------


def _printed(build, capfd):
    capfd.readouterr()
    run(build)
    captured = capfd.readouterr()
    assert captured.out == ""  # upstream prints on stderr only
    return captured.err


def test_print_tensor_default_title_and_upstream_format_on_stderr(capfd):
    def build():
        x = popxl.variable([0.0, 1.0], name="x")
        return {"y": ops.print_tensor(x, print_gradient=True, open_bracket="|")}

    assert _printed(build, capfd) == "print_x: |0.0000000,1.0000000)\n"


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        (dict(float_format="fixed", digits=2), "t: (1.50,-0.25,1000.00)"),
        (dict(float_format="scientific", digits=3), "t: (1.500e+00,-2.500e-01,1.000e+03)"),
        (dict(float_format="none", digits=4), "t: (1.5,-0.25,1000)"),
        (dict(separator=" ", open_bracket="[", close_bracket="]", digits=3), "t: [1.50 -0.250 1.00e+03]"),
    ],
)  # fmt: skip
def test_print_tensor_format_options(kwargs, want, capfd):
    def build():
        t = popxl.variable(np.array([1.5, -0.25, 1000.0], np.float32), name="v")
        return {"y": ops.print_tensor(t, "t", **kwargs)}

    assert _printed(build, capfd) == want + "\n"


def test_print_tensor_summarises_large_tensors_and_prints_ints(capfd):
    def build():
        t = popxl.variable(np.arange(20, dtype=np.int32).reshape(4, 5), name="big")
        return {"y": ops.print_tensor(t, summarise_threshold=10, edge_items=1)}

    assert _printed(build, capfd) == "print_big: ((0,...,4),\n ...,\n (15,...,19))\n"


def test_print_tensor_rejects_unknown_float_format():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable([0.0, 1.0])
        with pytest.raises(ValueError, match="float_format must be one of auto, fixed"):
            ops.print_tensor(x, float_format="engineering")


@pytest.mark.parametrize("executor", EXECUTORS)
def test_print_gradient_prints_the_gradient_and_passes_it_on(executor, capfd):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(np.arange(4, dtype=np.float32), name="x")
        fwd = ir.create_graph(lambda x: ops.print_tensor(x, print_gradient=True) @ x, x)
        info = ops.call_with_info(fwd, x)
        bwd = autodiff(fwd)
        (dx,) = ops.call(
            bwd.graph, popxl.constant(np.float32(0.5)), inputs_dict=bwd.inputs_dict(info)
        )
        d = popxl.d2h_stream(dx.shape, dx.dtype)
        ops.host_store(d, dx)
    capfd.readouterr()
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        got = session.run()[d]
    err = capfd.readouterr().err
    # d(x.x)/dx = 2x, times the seed 0.5; the print sees the gradient of print's output (0.5 x)
    np.testing.assert_allclose(got, np.arange(4, dtype=np.float32))
    assert "print_x: (0.0000000,1.0000000,2.0000000,3.0000000)" in err
    assert "print_x_gradient: (0.0000000,0.50000000,1.0000000,1.5000000)" in err


# ---- C10: conditional ----------------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
def test_conditional_picks_the_branch_per_run(executor):
    a_np = np.array([23.0, 10.0, 22.0, 21.0], np.float32)
    w_np = np.array([10.0, 18.0, 32.0, 12.0], np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        a_s = popxl.h2d_stream([4], popxl.float32)
        w_s = popxl.h2d_stream([4], popxl.float32)
        c_s = popxl.h2d_stream([1], popxl.bool)
        a, w, cond = ops.host_load(a_s), ops.host_load(w_s), ops.host_load(c_s)

        def then_fn(x):
            wt = popxl.graph_input(x.shape, x.dtype, "w")
            return x * wt, x + 1.0

        def else_fn(x):
            wt = popxl.graph_input(x.shape, x.dtype, "w")
            return x / wt, x - 1.0

        g_then = ir.create_graph(then_fn, a)
        g_else = ir.create_graph(else_fn, a)
        info = ops.conditional_with_info(
            cond, g_then, g_else, then_inputs=[a], else_inputs=[w],
            then_inputs_dict={g_then.inputs[1]: w}, else_inputs_dict={g_else.inputs[1]: a},
        )  # fmt: skip
        outs = {}
        for i, t in enumerate(info.outputs):
            outs[i] = popxl.d2h_stream(t.shape, t.dtype)
            ops.host_store(outs[i], t)
    assert info.called_graph == (g_then, g_else)
    assert info.inputs == (cond, a, w, w, a)
    assert info.graph_to_parent(g_else.inputs[1]) == a
    assert info.parent_to_graph(w) == g_then.inputs[1]
    assert info.graph_to_parent_input_index(0, then_branch=False) == 3
    assert info.outputs[0].name == "mul_or_div"
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        for c in (True, False):
            got = session.run({a_s: a_np, w_s: w_np, c_s: np.array([c])})
            want = (a_np * w_np, a_np + 1) if c else (w_np / a_np, w_np - 1)
            np.testing.assert_allclose(got[outs[0]], want[0], rtol=1e-6)
            np.testing.assert_allclose(got[outs[1]], want[1], rtol=1e-6)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_conditional_condition_is_per_replica(executor):
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        x = popxl.variable(np.array([1.0, 2.0], np.float32))
        c_s = popxl.h2d_stream([], popxl.bool)
        cond = ops.host_load(c_s)
        g_then = ir.create_graph(lambda x: x * 10.0, x)
        g_else = ir.create_graph(lambda x: -x, x)
        (y,) = ops.conditional(cond, g_then, g_else, [x], [x])
        d = popxl.d2h_stream(y.shape, y.dtype)
        ops.host_store(d, y)
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        got = session.run({c_s: np.array([True, False])})[d]
    np.testing.assert_allclose(got, [[10.0, 20.0], [-1.0, -2.0]])


@pytest.mark.parametrize("cond_value", [True, False])
def test_conditional_gradient_flows_into_the_taken_branch_only(cond_value):
    # y = where(c, x * w, sin(x)); hand gradients: dy/dx = w or cos(x), dy/dw = x or 0
    x_np = np.array([0.5, -1.0, 2.0], np.float32)
    w_np = np.array([3.0, 4.0, -2.0], np.float32)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x, w = popxl.variable(x_np, name="x"), popxl.variable(w_np, name="w")
        c = popxl.constant(np.array(cond_value))

        def body(x, w, c):
            g_then = popxl.gcg().ir.create_graph(lambda x, w: x * w, x, w)
            g_else = popxl.gcg().ir.create_graph(lambda x: ops.sin(x), x)
            return ops.conditional(c, g_then, g_else, [x, w], [x])[0]

        fwd = ir.create_graph(body, x, w, c)
        info = ops.call_with_info(fwd, x, w, c)
        bwd = autodiff(fwd, grads_required=fwd.inputs[:2])
        seed = popxl.constant(np.ones(3, np.float32))
        dx, dw = ops.call(bwd.graph, seed, inputs_dict=bwd.inputs_dict(info))
        streams = [popxl.d2h_stream(t.shape, t.dtype) for t in (info.outputs[0], dx, dw)]
        for s, t in zip(streams, (info.outputs[0], dx, dw), strict=True):
            ops.host_store(s, t)
    with popxl.Session(ir, "ipu_hw") as session:
        y, gx, gw = _run_streams(session, streams)
    if cond_value:
        np.testing.assert_allclose(y, x_np * w_np, rtol=1e-6)
        np.testing.assert_allclose(gx, w_np, rtol=1e-6)
        np.testing.assert_allclose(gw, x_np, rtol=1e-6)
    else:
        np.testing.assert_allclose(y, np.sin(x_np), rtol=1e-6)
        np.testing.assert_allclose(gx, np.cos(x_np), rtol=1e-6)
        np.testing.assert_allclose(gw, np.zeros(3), atol=0)


def _run_streams(session, streams):
    out = session.run()
    return [out[s] for s in streams]


def test_conditional_rejects_what_upstream_rejects_and_effects_it_cannot_select():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros(2, np.float32))
        c = popxl.constant(np.array(True))
        g1 = ir.create_graph(lambda x: x + 1.0, x)
        g2 = ir.create_graph(lambda x: (x + 1.0, x), x)
        g3 = ir.create_graph(lambda x: ops.cast(x, popxl.int32), x)
        with pytest.raises(ValueError, match="must have the same number of outputs: 1 != 2"):
            ops.conditional(c, g1, g2, [x], [x])
        with pytest.raises(TypeError, match="same dtypes"):
            ops.conditional(c, g1, g3, [x], [x])
        with pytest.raises(TypeError, match="must be a popxl.bool"):
            ops.conditional(x, g1, g1, [x], [x])
        with pytest.raises(ValueError, match="single value"):
            ops.conditional(popxl.constant(np.array([True, False])), g1, g1, [x], [x])
        with pytest.raises(ValueError, match="Not enough inputs"):
            ops.conditional(c, g1, g1, [x], [])

        def by_ref(t: popxl.TensorByRef):
            ops.var_updates.accumulate_(t, popxl.constant(np.ones(2, np.float32)))
            return t + 0.0

        g_ref = ir.create_graph(by_ref, x)
        with pytest.raises(NotImplementedError, match="TensorByRef is not implemented"):
            ops.conditional(c, g_ref, g1, [x], [x])
        stream = popxl.d2h_stream((2,), popxl.float32)

        def storing(t):
            ops.host_store(stream, t)
            return t + 0.0

        g_store = ir.create_graph(storing, x)
        with pytest.raises(NotImplementedError, match="acts outside the graph"):
            ops.conditional(c, g1, g_store, [x], [x])
        n_ops = len(ir.main_graph._ops)
    assert n_ops == 0  # no failed call left a call site behind


def test_bool_of_loaded_and_called_values_is_true_but_computed_values_raise():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        s = popxl.h2d_stream((2,), popxl.float32)
        x = ops.host_load(s)
        _, shard = popxl.replica_sharded_variable(np.zeros(4, np.float32))
        (y,) = ops.call(ir.create_graph(lambda t: t + 1.0, x), x)
        assert x and shard and y  # no __bool__ upstream
        with pytest.raises(popxl.errors.DataDependentError):
            bool(x * 2.0)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_interpolate_gradient_matches_torch_autograd(mode):
    x_np = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    tx = torch.tensor(x_np, requires_grad=True)
    torch_mode = "bilinear" if mode == "linear" else "bicubic"
    ty = torch.nn.functional.interpolate(tx, scale_factor=2.0, mode=torch_mode)
    seed = rng.standard_normal(tuple(ty.shape)).astype(np.float32)
    ty.backward(torch.from_numpy(seed))
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(x_np, name="x")
        fwd = ir.create_graph(lambda t: ops.interpolate(t, (1.0, 1.0, 2.0, 2.0), mode), x)
        info = ops.call_with_info(fwd, x)
        bwd = autodiff(fwd)
        (dx,) = ops.call(bwd.graph, popxl.constant(seed), inputs_dict=bwd.inputs_dict(info))
        d = popxl.d2h_stream(dx.shape, dx.dtype)
        ops.host_store(d, dx)
    with popxl.Session(ir, "ipu_hw") as session:
        got = session.run()[d]
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-4, atol=1e-5)


# ---- popxl.fp8_utils -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float8_143", "float8_152"])
@pytest.mark.parametrize("src_dtype", [np.float16, np.float32, np.float64])
def test_fp8_utils_host_casts_match_the_utils_ones(dtype, src_dtype):
    from torch_popxl import fp8_utils, utils

    dt = getattr(popxl, dtype)
    data = np.array([[0.5, -1.25], [3.0, 0.0]], src_dtype)
    fp8 = fp8_utils.host_pow2scale_cast_to_fp8(data, dt, log2_scale=2)
    want = utils.host_pow2scale_then_cast(data.astype(np.float64), dt, 2)
    assert fp8.dtype == want.dtype and fp8.shape == (2, 2)
    np.testing.assert_array_equal(fp8.view(np.uint8), want.view(np.uint8))
    for out_dt, np_dt in ((popxl.float16, np.float16), (popxl.float32, np.float32)):
        back = fp8_utils.host_pow2scale_cast_from_fp8(fp8, out_dt, log2_scale=-2)
        assert back.dtype == np_dt
        np.testing.assert_array_equal(back, data.astype(np_dt))  # all exact in float8
    t = torch.tensor([1.0, 2.0])
    np.testing.assert_array_equal(
        fp8_utils.host_pow2scale_cast_to_fp8(t, dt).view(np.uint8),
        utils.host_pow2scale_then_cast(t.numpy(), dt).view(np.uint8),
    )
    with pytest.raises(RuntimeError, match="not currently supported"):
        fp8_utils.host_pow2scale_cast_from_fp8(fp8, popxl.int32)


def test_variable_memmap_arr_is_the_host_storage(tmp_path):
    mm = np.memmap(str(tmp_path / "w.npy"), dtype=np.float32, shape=(3,), mode="w+")
    mm[:] = [1.0, 2.0, 3.0]
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(mm, name="w")
        plain = popxl.variable(np.zeros(3, np.float32))
        ops.var_updates.accumulate_(v, popxl.constant(np.ones(3, np.float32)))
    assert v._memmap_arr is mm and plain._memmap_arr is None
    with popxl.Session(ir, "ipu_hw") as session:
        session.run()
        assert session.get_tensor_data(v) is v._memmap_arr
    np.testing.assert_array_equal(mm, [2.0, 3.0, 4.0])  # written back into the file's array
