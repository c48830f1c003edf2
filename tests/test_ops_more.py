"""The ops added with the public-name contract (ops/more.py, the in-place variants, the
collectives' all_reduce, the lamb/adamax updaters) and uint32 arithmetic, each compared by
value with eager torch or numpy on both executors."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.errors import PopXLError

EXECUTORS = ["fast", "reference"]
rng = np.random.default_rng(0)


@pytest.fixture(params=EXECUTORS)
def executor(request):
    return request.param


def run(build, executor, replication=1):
    """Build under the main graph; ``build`` returns {name: tensor}; returns host values and
    the session (for variables)."""
    ir = popxl.Ir(replication=replication)
    with ir.main_graph, popxl.in_sequence():
        outs = build()
        streams = {}
        for k, t in outs.items():
            s = popxl.d2h_stream(t.shape, t.dtype, k)
            ops.host_store(s, t)
            streams[k] = s
    session = popxl.Session(ir, "ipu_model", executor=executor)
    with session:
        out = session.run()
        values = {k: out[s] for k, s in streams.items()}
    return values


X = rng.standard_normal((2, 3, 4)).astype(np.float32)
tX = torch.from_numpy(X)

REDUCTIONS = [
    ("mean", lambda t, ax, kd: t.mean(ax, keepdim=kd)),
    ("sum", lambda t, ax, kd: t.sum(ax, keepdim=kd)),
    ("sumsquare", lambda t, ax, kd: (t * t).sum(ax, keepdim=kd)),
    ("l1", lambda t, ax, kd: t.abs().sum(ax, keepdim=kd)),
    ("l2", lambda t, ax, kd: (t * t).sum(ax, keepdim=kd).sqrt()),
    ("logsumexp", lambda t, ax, kd: torch.logsumexp(t, ax, keepdim=kd)),
    ("logsum", lambda t, ax, kd: (t.abs()).sum(ax, keepdim=kd).log()),
    ("prod", lambda t, ax, kd: t.prod(ax[0], keepdim=kd) if len(ax) == 1 else t.prod(2, keepdim=kd).prod(0, keepdim=kd)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "ref"), REDUCTIONS, ids=[n for n, _ in REDUCTIONS])
@pytest.mark.parametrize(("axis", "keepdims"), [([1], False), ([0, 2], True)])
def test_reductions_match_torch(name, ref, axis, keepdims, executor):
    data = np.abs(X) if name == "logsum" else X

    def build():
        return {"y": getattr(ops, name)(popxl.variable(data), axis, keepdims)}

    y = run(build, executor)["y"]
    expect = ref(torch.from_numpy(data), axis, keepdims).numpy()
    np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-6)


def test_median_is_the_lower_median_as_numpy_takes_it_for_odd_counts(executor):
    data = rng.standard_normal((3, 5)).astype(np.float32)
    y = run(lambda: {"y": ops.median(popxl.variable(data), 1, False)}, executor)["y"]
    np.testing.assert_array_equal(y, np.median(data, axis=1))


def test_integer_sum_keeps_the_input_dtype():
    ir = popxl.Ir()
    with ir.main_graph:
        assert ops.sum(popxl.variable(np.arange(4, dtype=np.int32))).dtype == popxl.int32


def test_in_place_variants_modify_their_input_and_match_the_out_of_place_op(executor):
    base = rng.standard_normal((2, 3)).astype(np.float32)

    def build():
        a, b, c, d = (popxl.variable(base, name=n) for n in "abcd")
        ops.add_(a, 1.5)
        ops.relu_(b)
        ops.gelu_(c)
        ops.exp_(d)
        k = popxl.variable(np.array([3, 4, 5], np.int32), name="k")
        ops.increment_mod_(k, 2, 6)
        return {"a": a, "b": b, "c": c, "d": d, "k": k}

    y = run(build, executor)
    t = torch.from_numpy(base)
    np.testing.assert_allclose(y["a"], base + 1.5, rtol=1e-6)
    np.testing.assert_allclose(y["b"], np.maximum(base, 0))
    np.testing.assert_allclose(y["c"], F.gelu(t, approximate="tanh").numpy(), rtol=1e-6)
    np.testing.assert_allclose(y["d"], np.exp(base), rtol=1e-6)
    np.testing.assert_array_equal(y["k"], [5, 0, 1])


def test_in_place_op_returns_its_input_handle():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.zeros(2, np.float32))
        assert ops.add_(a, 1.0).shape == a.shape


def test_elementwise_extras_match_numpy(executor):
    data = np.array([-2.5, -0.5, 0.0, 0.5, 1.5, np.inf, -np.inf, np.nan], np.float32)

    def build():
        x = popxl.variable(data)
        return {
            "ceil": ops.ceil(x), "floor": ops.floor(x), "sign": ops.sign(x),
            "isfinite": ops.isfinite(x), "isinf": ops.isinf(x), "isnan": ops.isnan(x),
            "identity": ops.identity(x), "io": ops.io_tile_copy(x),
        }  # fmt: skip

    y = run(build, executor)
    for name in ("ceil", "floor", "isfinite", "isinf", "isnan"):
        np.testing.assert_array_equal(y[name], getattr(np, name)(data), err_msg=name)
    # sign of NaN is not specified upstream; the simulator gives torch's 0.
    np.testing.assert_array_equal(y["sign"][:-1], np.sign(data[:-1]))
    np.testing.assert_array_equal(y["identity"], data)
    np.testing.assert_array_equal(y["io"], data)


def test_geluerf_is_the_exact_gelu_and_differs_from_the_tanh_gelu(executor):
    data = np.linspace(-3, 3, 13, dtype=np.float32)
    y = run(
        lambda: {"e": ops.geluerf(popxl.variable(data)), "t": ops.gelu(popxl.variable(data))},
        executor,
    )
    np.testing.assert_allclose(y["e"], F.gelu(torch.from_numpy(data)).numpy(), rtol=1e-6)
    assert not np.array_equal(y["e"], y["t"])


def test_cumsum_and_histogram_match_numpy(executor):
    data = np.array([[1, -2, 3], [4, 5, -6]], np.float32)
    levels = [-1.0, 2.0, 4.5]

    def build():
        x = popxl.variable(data)
        return {
            "c0": ops.cumsum(x, 0), "c1": ops.cumsum(x, 1),
            "h": ops.histogram(x, levels, False), "habs": ops.histogram(x, levels, True),
        }  # fmt: skip

    y = run(build, executor)
    np.testing.assert_array_equal(y["c0"], np.cumsum(data, 0))
    np.testing.assert_array_equal(y["c1"], np.cumsum(data, 1))
    # bins (-inf,-1) [-1,2) [2,4.5) [4.5,inf): -2,-6 | 1 | 3,4 | 5
    np.testing.assert_array_equal(y["h"], [2, 1, 2, 1])
    assert y["h"].dtype == np.uint32
    np.testing.assert_array_equal(y["habs"], [0, 1, 3, 2])


def test_group_and_batch_norm_match_torch(executor):
    x = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    w, b = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    mean, var = rng.standard_normal(4).astype(np.float32), rng.random(4).astype(np.float32) + 0.5

    def build():
        t = popxl.variable(x)
        vs = [popxl.variable(a) for a in (w, b, mean, var)]
        return {
            "g": ops.group_norm(t, vs[0], vs[1], 2, 1e-5),
            "bn": ops.batch_norm_inference(t, vs[0], vs[1], vs[2], vs[3], 1e-3),
        }

    y = run(build, executor)
    tx, tw, tb = map(torch.from_numpy, (x, w, b))
    np.testing.assert_allclose(
        y["g"], F.group_norm(tx, 2, tw, tb, 1e-5).numpy(), rtol=1e-5, atol=1e-5
    )
    expect = (x - mean[:, None, None]) / np.sqrt(var[:, None, None] + 1e-3) * w[:, None, None] + b[
        :, None, None
    ]
    np.testing.assert_allclose(y["bn"], expect, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="num_groups must divide"):
        run(
            lambda: {
                "g": ops.group_norm(popxl.variable(x), popxl.variable(w), popxl.variable(b), 3)
            },
            executor,
        )


def test_pooling_and_conv_match_torch_including_asymmetric_padding(executor):
    x = rng.standard_normal((1, 2, 5, 6)).astype(np.float32)
    w = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)

    def build():
        t = popxl.variable(x)
        return {
            "avg": ops.average_pool(t, (2, 2), (2, 2)),
            "avg_pad": ops.average_pool(t, (3, 3), (1, 1), padding=(1, 0, 1, 2)),
            "max": ops.max_pool(t, (3, 2), (1, 2), padding=(1, 0, 1, 0)),
            "conv": ops.conv(t, popxl.variable(w), stride=(1, 1), padding=(1, 1, 1, 1), groups=2),
            "same": ops.conv(t, popxl.variable(w), groups=2, pad_type="same_upper"),
        }

    y = run(build, executor)
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    np.testing.assert_allclose(y["avg"], F.avg_pool2d(tx, 2, 2).numpy(), rtol=1e-6)
    # padding (h_begin, w_begin, h_end, w_end) = (1, 0, 1, 2); padded cells are not counted.
    padded = F.pad(tx, (0, 2, 1, 1))
    ones = F.pad(torch.ones_like(tx), (0, 2, 1, 1))
    expect = F.avg_pool2d(padded, 3, 1) / F.avg_pool2d(ones, 3, 1)
    np.testing.assert_allclose(y["avg_pad"], expect.numpy(), rtol=1e-5)
    np.testing.assert_allclose(y["max"], F.max_pool2d(tx, (3, 2), (1, 2), (1, 0)).numpy())
    np.testing.assert_allclose(
        y["conv"], F.conv2d(tx, tw, padding=1, groups=2).numpy(), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        y["same"], F.conv2d(tx, tw, padding="same", groups=2).numpy(), rtol=1e-5, atol=1e-5
    )


def test_dynamic_update_refuses_an_update_that_does_not_fill_the_slice(executor):
    # upstream's unit test passes a (1, 3) update for the (1, 5, 3) slice of a (3, 5, 7) tensor;
    # the IPU copies the update in whole, so the misfit is refused here when the op is made.
    x = np.zeros((3, 5, 7), np.float32)
    u = np.arange(15, dtype=np.float32).reshape(1, 5, 3)

    def build():
        t, idx = popxl.variable(x), popxl.variable(np.array([1, 2], np.uint32), popxl.uint32)
        with pytest.raises(ValueError, match=r"has shape \(1, 3\), but the slice .* \(1, 5, 3\)"):
            ops.dynamic_update(t, idx, popxl.variable(u[0, :1]), [0, 2], [1, 3])
        with pytest.raises(ValueError, match="dynamic_update_: t_update"):
            ops.dynamic_update_(t, idx, popxl.variable(u[0]), [0, 2], [1, 3])
        return {"y": ops.dynamic_update(t, idx, popxl.variable(u), [0, 2], [1, 3])}

    want = x.copy()
    want[1:2, :, 2:5] = u
    np.testing.assert_array_equal(run(build, executor)["y"], want)


def test_scaled_add_on_integer_tensors_keeps_the_integer_dtype(executor):
    # upstream's unit test test_variable_location scaled_add_s int32 tensors with the default
    # float scales 1.0; integral scales keep int32 (torch refuses a float alpha on ints)
    x = np.array([1, 2], np.int32)
    y = np.array([3, 4], np.int32)

    def build():
        t = popxl.variable(x) + 0
        out = ops.scaled_add(popxl.variable(x), popxl.variable(y), 2.0, -3.0)
        ops.scaled_add_(t, popxl.variable(y))
        u = popxl.variable(x) + 0
        ops.scaled_add_(u, popxl.variable(y), 3.0, 2.0)
        assert out.dtype == t.dtype == popxl.int32
        return {"out": out, "t": t, "u": u}

    y_ = run(build, executor)
    np.testing.assert_array_equal(y_["out"], 2 * x - 3 * y)
    np.testing.assert_array_equal(y_["t"], x + y)
    np.testing.assert_array_equal(y_["u"], 3 * x + 2 * y)
    assert y_["out"].dtype == np.int32


def _conv_transpose_loops(x, w, stride, dil, groups, pads_begin, out_spatial):
    """ONNX ConvTranspose by its definition: input cell i of channel ci adds
    x[ci, i] * w[ci, co, k] to output cell i * stride + k * dilation - pad_begin."""
    n, c_in, h, wd = x.shape
    c_out_g = w.shape[1]
    out = np.zeros((n, c_out_g * groups, *out_spatial), np.float64)
    per_group = c_in // groups
    for ci in range(c_in):
        g = ci // per_group
        for co in range(c_out_g):
            for i in range(h):
                for j in range(wd):
                    for ki in range(w.shape[2]):
                        for kj in range(w.shape[3]):
                            oi = i * stride[0] + ki * dil[0] - pads_begin[0]
                            oj = j * stride[1] + kj * dil[1] - pads_begin[1]
                            if 0 <= oi < out_spatial[0] and 0 <= oj < out_spatial[1]:
                                out[:, g * c_out_g + co, oi, oj] += (
                                    x[:, ci, i, j] * w[ci, co, ki, kj]
                                )
    return out


def test_conv_transpose_matches_onnx_conv_transpose_by_its_definition(executor):
    # Upstream's ops.conv_transpose (ONNX ConvTranspose): weights (C_in, C_out / groups, k...),
    # output size stride * (in - 1) + output_padding + (k - 1) * dilation + 1 - pads, or the
    # output_shape given, the padding then split with the odd cell at the end for same_upper.
    x = rng.standard_normal((2, 4, 3, 4)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)  # groups=2: 6 output channels

    def build():
        t, k = popxl.variable(x), popxl.variable(w)
        return {
            "pads": ops.conv_transpose(
                t,
                k,
                stride=(2, 1),
                padding=(1, 0, 0, 1),
                dilation=(1, 2),
                groups=2,
                output_padding=(1, 0),
            ),  # fmt: skip
            "shape": ops.conv_transpose(t, k, stride=(2, 3), groups=2, output_shape=(6, 10)),
            "upper": ops.conv_transpose(t, k, stride=(2, 2), groups=2, pad_type="same_upper"),
            "lower": ops.conv_transpose(t, k, stride=(2, 2), groups=2, pad_type="same_lower"),
            "valid": ops.conv_transpose(t, k, groups=2, pad_type="valid"),
            "grow": ops.conv_transpose(t, k, groups=2, output_shape=(2, 6, 6, 6)),
        }

    y = run(build, executor)
    # (stride, dilation, pad begins, output size) per case; full = s * (in - 1) + (k - 1) * d + 1
    cases = {
        "pads": ((2, 1), (1, 2), (1, 0), (2 * 2 + 1 + 3 - 1, 3 + 3 - 1)),  # 7, 5
        # full (7, 11) vs (6, 10): totals (1, 1) -> begin 1 (odd cell first), end 0
        "shape": ((2, 3), (1, 1), (1, 1), (6, 10)),
        # full (7, 8) vs in * stride (6, 8): totals (1, 0) -> same_upper begins (0, 0)
        "upper": ((2, 2), (1, 1), (0, 0), (6, 8)),
        "lower": ((2, 2), (1, 1), (1, 0), (6, 8)),
        "valid": ((1, 1), (1, 1), (0, 0), (5, 5)),
        # full (5, 5) vs (6, 6): totals (-1, -1), truncated halves 0 -> begins (-1, -1): zeros
        "grow": ((1, 1), (1, 1), (-1, -1), (6, 6)),
    }
    for name, (stride, dil, begins, size) in cases.items():
        want = _conv_transpose_loops(x, w, stride, dil, 2, begins, size)
        assert y[name].shape == want.shape, name
        np.testing.assert_allclose(y[name], want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_conv_transpose_errors_name_the_expected_weight_layout():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.zeros((1, 4, 3, 3), np.float32))
        with pytest.raises(ValueError, match=r"C_in=4, C_out / groups"):
            ops.conv_transpose(t, popxl.variable(np.zeros((2, 4, 3, 3), np.float32)))
        with pytest.raises(ValueError, match="output_shape needs the 2 spatial sizes"):
            ops.conv_transpose(t, popxl.variable(np.zeros((4, 1, 3, 3), np.float32)),
                               output_shape=(5, 5, 5))  # fmt: skip


def test_dynamic_slice_and_update_use_the_run_time_index(executor):
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    u = -np.ones((2, 3), np.float32)

    def build():
        t = popxl.variable(x, name="x")
        idx = popxl.variable(np.array([1, 2], np.uint32), popxl.uint32, name="idx")
        s = ops.dynamic_slice(t, idx, [0, 1], [2, 3])
        upd = ops.dynamic_update(t, idx, popxl.constant(u), [0, 1], [2, 3])
        ops.dynamic_update_(t, idx, popxl.constant(u * 2), [0, 1], [2, 3])
        return {"s": s, "upd": upd, "x": t}

    y = run(build, executor)
    np.testing.assert_array_equal(y["s"], x[1:3, 2:5])
    expect = x.copy()
    expect[1:3, 2:5] = u
    np.testing.assert_array_equal(y["upd"], expect)
    expect[1:3, 2:5] = 2 * u
    np.testing.assert_array_equal(y["x"], expect)


def test_scatter_is_onnx_scatter_elements(executor):
    x = np.zeros((3, 3), np.float32)
    idx = np.array([[1, 0, 2], [0, 2, 1]], np.int32)
    val = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    y = run(
        lambda: {"y": ops.scatter(popxl.variable(x), popxl.constant(idx), popxl.constant(val), 0)},
        executor,
    )
    expect = torch.zeros(3, 3).scatter(0, torch.from_numpy(idx).long(), torch.from_numpy(val))
    np.testing.assert_array_equal(y["y"], expect.numpy())


def test_slice_and_tied_gather_equal_slice_and_gather(executor):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)

    def build():
        t = popxl.variable(x)
        return {
            "s": ops.slice_(t, [1], [3], axis=[1]),
            "g": ops.tied_gather(t, popxl.constant(np.array([2, 0], np.int32))),
        }

    y = run(build, executor)
    np.testing.assert_array_equal(y["s"], x[:, 1:3])
    np.testing.assert_array_equal(y["g"], x[[2, 0]])


def test_interpolate_nearest_matches_torch_for_integer_upsampling(executor):
    x = rng.standard_normal((1, 1, 2, 3)).astype(np.float32)
    y = run(lambda: {"y": ops.interpolate(popxl.variable(x), (1.0, 1.0, 2.0, 3.0))}, executor)["y"]
    np.testing.assert_array_equal(
        y, F.interpolate(torch.from_numpy(x), scale_factor=(2, 3)).numpy()
    )


def test_random_ops_have_the_requested_distribution_and_seeds_split(executor):
    seed = popxl.create_seeds(42)

    def build():
        s = popxl.variable(seed, popxl.uint32, name="seed")
        s0, s1 = ops.split_random_seed(s)
        return {
            "u": ops.random_uniform(s0, (4000,), -2.0, 2.0),
            "n": ops.random_normal(s1, (4000,), 1.0, 3.0),
            "s0": s0, "s1": s1,
        }  # fmt: skip

    y = run(build, executor)
    assert y["u"].min() >= -2.0 and y["u"].max() < 2.0 and abs(y["u"].mean()) < 0.1
    assert abs(y["n"].mean() - 1.0) < 0.2 and abs(y["n"].std() - 3.0) < 0.2
    assert y["s0"].dtype == np.uint32 and y["s0"].shape == (2,)
    assert not np.array_equal(y["s0"], y["s1"])


def test_random_ops_draw_from_their_seed(executor):
    # Upstream's samples are a function of the seed tensor: the same seed, the same samples;
    # replicas differ through their seeds (create_seeds(..., replicas=R)), not by themselves.
    R = 2
    per_replica = popxl.create_seeds(7, replicas=R)  # (R, 2)

    def build():
        ir = popxl.gcg().ir
        s = popxl.variable(popxl.create_seeds(42), popxl.uint32, name="seed")
        own = popxl.variable(per_replica, popxl.uint32, name="own",
                             replica_grouping=ir.replica_grouping(group_size=1))  # fmt: skip
        return {
            "u": ops.random_uniform(s, (3000,)), "u_again": ops.random_uniform(s, (3000,)),
            "n": ops.random_normal(s, (3000,), 1.0, 3.0), "n_again": ops.random_normal(s, (3000,), 1.0, 3.0),
            "u_own": ops.random_uniform(own, (3000,)),
            "h": ops.random_uniform(s, (3000,), dtype=popxl.float16),
        }  # fmt: skip

    y = run(build, executor, replication=R)
    np.testing.assert_array_equal(y["u"], y["u_again"])
    np.testing.assert_array_equal(y["n"], y["n_again"])
    np.testing.assert_array_equal(y["u"][0], y["u"][1])  # one seed on both replicas
    assert (y["u_own"][0] != y["u_own"][1]).mean() > 0.99  # their own seeds
    assert abs(y["u"].mean() - 0.5) < 0.03 and y["u"].min() >= 0.0 and y["u"].max() < 1.0
    assert abs(y["n"].mean() - 1.0) < 0.2 and abs(y["n"].std() - 3.0) < 0.2
    assert y["h"].dtype == np.float16


def test_seed_checks_and_create_seeds_shape():
    assert popxl.create_seeds(1, batches_per_step=3, replicas=2).shape == (3, 2, 2)
    assert popxl.create_seeds(1).dtype == np.uint32
    from torch_popxl.random_seed import two_uint32_to_uint64, uint64_to_two_uint32

    assert two_uint32_to_uint64(*uint64_to_two_uint32(2**64 - 5)) == 2**64 - 5
    ir = popxl.Ir()
    with (
        ir.main_graph,
        pytest.raises(ValueError, match=r"seed Tensor must be shape=\(2,\) dtype=uint32"),
    ):
        ops.split_random_seed(popxl.variable(np.zeros(2, np.int32)))


def test_collectives_all_reduce_over_ipus_sums_into_every_output(executor):
    a, b = np.ones(3, np.float32), np.arange(3, dtype=np.float32)

    def build():
        x, y = popxl.variable(a), popxl.variable(b)
        o = ops.collectives.all_reduce([x, y], ipus=[0, 1])
        i = ops.collectives.all_reduce_identical_inputs([x, y])
        return {"o0": o[0], "o1": o[1], "i1": i[1]}

    y = run(build, executor)
    np.testing.assert_array_equal(y["o0"], a + b)
    np.testing.assert_array_equal(y["o1"], a + b)
    np.testing.assert_array_equal(y["i1"], b)
    cg = ops.collectives.CommGroup(ops.collectives.CommGroupType.Consecutive, 2)
    assert cg.replicaGroupSize == 2 and cg == ops.collectives.CommGroup(
        ops.collectives.CommGroupType.Consecutive, 2
    )


def test_uint32_arithmetic_wraps_like_cpp_unsigned(executor):
    a = np.array([4294967295, 7, 0], np.uint32)
    b = np.array([3, 2, 1], np.uint32)

    def build():
        x = popxl.variable(a, popxl.uint32, name="x")
        y = popxl.constant(b, popxl.uint32)
        out = {"add": ops.add(x, y), "sub": x - y, "mul": x * y, "gt": ops.greater(x, y),
               "max": ops.maximum(x, y), "sum": ops.sum(x)}  # fmt: skip
        ops.var_updates.accumulate_(x, y)
        out["x"] = x
        return out

    y = run(build, executor)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(y["add"], a + b)
        np.testing.assert_array_equal(y["sub"], a - b)
        np.testing.assert_array_equal(y["mul"], a * b)
        np.testing.assert_array_equal(y["x"], a + b)
        np.testing.assert_array_equal(y["sum"], a.sum(dtype=np.uint32))
    np.testing.assert_array_equal(y["gt"], a > b)
    np.testing.assert_array_equal(y["max"], np.maximum(a, b))
    assert y["add"].dtype == np.uint32


def _adam_program(updater, executor, **kwargs):
    m = np.array([0.1, -0.2], np.float32)
    v = np.array([0.04, 0.09], np.float32)
    w = np.array([1.0, 2.0], np.float32)

    def build():
        t = popxl.variable(np.zeros((), np.float32), name="step")
        x = updater(popxl.variable(m), popxl.variable(v), popxl.variable(w), t, **kwargs)
        return {"x": x, "t": t}

    return run(build, executor), m, v, w


def test_lamb_updater_is_the_adam_term_and_adamax_uses_the_infinity_norm(executor):
    y, m, v, w = _adam_program(
        ops.var_updates.lamb_updater, executor, weight_decay=0.1, beta1=0.9, beta2=0.99
    )
    mc, vc = m / (1 - 0.9), v / (1 - 0.99)
    np.testing.assert_allclose(y["x"], mc / (np.sqrt(vc) + 1e-7) + 0.1 * w, rtol=1e-5)
    assert y["t"] == 1
    y, m, v, w = _adam_program(
        ops.var_updates.adamax_updater, executor, weight_decay=0.1, beta1=0.9
    )
    np.testing.assert_allclose(y["x"], m / (1 - 0.9) / (v + 1e-7) + 0.1 * w, rtol=1e-5)


UPDATER_ERRORS = [
    # (updater, kwargs, upstream message: ops/var_updates/adam_updater.py)
    ("adam_updater", {"weight_decay": 0.1}, "Weight decay requires weight to be not None."),
    ("adam_updater", {"time_step": True, "beta1": 0.9}, "Bias correction requires both beta1 and beta2 not None."),
    ("lamb_updater", {"weight_decay": 0.1}, "Weight decay requires weight to be not None."),
    ("lamb_updater", {"time_step": True, "beta2": 0.9}, "Bias correction requires both beta1 and beta2 not None."),
    ("adamax_updater", {}, "AdaMax requires time_step not None."),
]  # fmt: skip


@pytest.mark.parametrize(("name", "kwargs", "message"), UPDATER_ERRORS)
def test_updater_validation_messages_are_upstreams(name, kwargs, message):
    ir = popxl.Ir()
    with ir.main_graph:
        m = popxl.variable(np.zeros(2, np.float32))
        v = popxl.variable(np.zeros(2, np.float32))
        if kwargs.get("time_step"):
            kwargs = {**kwargs, "time_step": popxl.variable(np.zeros((), np.float32))}
        with pytest.raises(ValueError) as info:
            getattr(ops.var_updates, name)(m, v, **kwargs)
    assert str(info.value) == message


def test_utils_to_numpy_downcasts_and_float8_host_casts_round_trip():
    assert popxl.utils.to_numpy(np.arange(3)).dtype == np.int32
    assert popxl.utils.to_numpy(np.arange(3), downcast=False).dtype == np.int64
    data = np.array([0.5, -1.0, 3.0], np.float32)
    fp8 = popxl.utils.host_pow2scale_then_cast(data, popxl.float8_143, 1)
    back = popxl.utils.host_cast_then_pow2scale(fp8, popxl.float32, -1)
    np.testing.assert_array_equal(back, data)  # exactly representable values
    with pytest.raises(RuntimeError, match="not currently supported"):
        popxl.utils.host_pow2scale_then_cast(data, popxl.float16)


def test_merge_exchange_keeps_the_program(executor):
    def build():
        x = popxl.variable(np.ones(2, np.float32))
        with popxl.transforms.merge_exchange(), popxl.transforms.io_tile_exchange():
            y = x + 1
        return {"y": y}

    np.testing.assert_array_equal(run(build, executor)["y"], [2, 2])


def test_remote_code_load_checks_its_arguments():
    ir = popxl.Ir()
    g = ir.create_graph(lambda x: x + 1, popxl.TensorSpec((2,), popxl.float32))
    with ir.main_graph:
        ops.remote_code_load(g, "executable")
        with pytest.raises(ValueError, match="Not a valid location: 'somewhere'"):
            ops.remote_code_load(g, "somewhere")
        with pytest.raises(TypeError, match="must be a popxl Graph"):
            ops.remote_code_load("g", "executable")


def test_autodiff_accepts_concat_and_rejects_modifying_in_place_ops():
    # spec/popxl.md §8: concat_ is in place but not modifying; gelu_ and add_ modify.
    ir = popxl.Ir()
    spec = popxl.TensorSpec((3,), popxl.float32)
    g = ir.create_graph(lambda x: ops.concat_([x, x * 2.0]), spec)
    info = popxl.transforms.autodiff(g)
    assert len(info.expected_outputs) == 1
    modifying = {"gelu_": lambda x: ops.gelu_(x * 1.0), "add_": lambda x: ops.add_(x * 1.0, 1.0)}
    for fn in modifying.values():
        bad = ir.create_graph(fn, spec)
        with pytest.raises(PopXLError, match=r"^The graph .* contains a modifying op"):
            popxl.transforms.autodiff(bad)
