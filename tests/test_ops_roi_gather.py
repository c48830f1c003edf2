"""``ops.roi_align`` against torchvision's RoIAlign (upstream's own test compares the two with
``aligned=False``) and ``ops.gather(..., zero_OOR=True)`` against numpy ``take`` with the
out-of-range rows zeroed, on both executors."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops

EXECUTORS = ["fast", "reference"]


@pytest.fixture(params=EXECUTORS)
def executor(request):
    return request.param


def run(build, executor, feeds=None):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        outs = build()
        streams = {}
        for k, t in outs.items():
            s = popxl.d2h_stream(t.shape, t.dtype, k)
            ops.host_store(s, t)
            streams[k] = s
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run(feeds or {})
    return {k: out[s] for k, s in streams.items()}


# ---- roi_align ----------------------------------------------------------------------------

# Upstream facts (popart python/popxl/ops/roialign.py, popx/op/roialignx.cpp): ONNX RoiAlign-10,
# average pooling only, popnn roiAlign with aligned=false; upstream's test matches
# torchvision.ops.RoIAlign(output_size, spatial_scale, sampling_ratio) (aligned=False) to 1e-4.
ROI_CASES = {
    # name: (N, C, H, W, num_rois, output_size, spatial_scale, sampling_ratio, box range)
    "upstream_single_image": (1, 4, 50, 50, 64, (6, 6), 0.05, 2, 100.0),
    "upstream_batch": (5, 4, 25, 25, 32, (12, 12), 0.5, 3, 100.0),
    "rectangular_bins_boxes_off_the_map": (2, 3, 9, 13, 16, (3, 5), 1.0, 1, 30.0),
}


@pytest.mark.parametrize("case", sorted(ROI_CASES))
def test_roi_align_matches_torchvision_roi_align_unaligned(case, executor):
    tv_ops = pytest.importorskip("torchvision.ops")
    n, c, h, w, k, size, scale, ratio, extent = ROI_CASES[case]
    rng = np.random.default_rng(len(case))
    data = rng.uniform(0, 2, (n, c, h, w)).astype(np.float32)
    boxes = rng.uniform(-5, extent, (k, 4)).astype(np.float32)  # includes inverted boxes
    index = rng.integers(0, n, (k,)).astype(np.int32)

    got = run(
        lambda: {
            "y": ops.roi_align(
                popxl.constant(data), popxl.constant(boxes), popxl.constant(index),
                size, scale, ratio,
            )
        },
        executor,
    )["y"]  # fmt: skip
    rois = torch.from_numpy(np.concatenate([index[:, None].astype(np.float32), boxes], axis=1))
    want = tv_ops.roi_align(
        torch.from_numpy(data), rois, size, spatial_scale=scale, sampling_ratio=ratio,
        aligned=False,
    ).numpy()  # fmt: skip
    assert got.shape == (k, c, *size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_roi_align_of_one_centred_sample_is_the_hand_computed_bilinear_value():
    # A 1x1 bin over box [0, 0, 2, 2] with one sample reads the map at (y, x) = (1, 1).
    data = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    got = run(
        lambda: {
            "y": ops.roi_align(
                popxl.constant(data),
                popxl.constant(np.array([[0.0, 0.0, 2.0, 2.0], [0.5, 0.0, 2.5, 2.0]], np.float32)),
                popxl.constant(np.array([0, 0], np.int32)),
                (1, 1), 1.0, 1,
            )
        },
        "reference",
    )["y"]  # fmt: skip
    # data[1, 1] = 5; at x = 1.5 the sample mixes data[1, 1] and data[1, 2] equally: 5.5.
    np.testing.assert_allclose(got.reshape(-1), [5.0, 5.5])


ROI_ERRORS = [
    ("rank3_input", dict(t=(1, 4, 4)), ValueError, "t must be [N, C, H, W]"),
    ("rois_shape", dict(rois=(3, 5)), ValueError, "rois must be [num_rois, 4]"),
    ("index_shape", dict(index=(2,)), ValueError, "batch_index must be an integer tensor"),
    ("float_index", dict(index_dtype=popxl.float32), ValueError, "batch_index must be an integer"),
    ("output_size", dict(size=(2,)), ValueError, "output_size must be two positive ints"),
    ("adaptive_ratio", dict(ratio=0), ValueError, "sampling_ratio must be a positive int"),
]


@pytest.mark.parametrize(("name", "change", "exc", "message"), ROI_ERRORS,
                         ids=[e[0] for e in ROI_ERRORS])  # fmt: skip
def test_roi_align_rejects_bad_arguments_with_what_was_given(name, change, exc, message):
    args = dict(t=(1, 2, 4, 4), rois=(3, 4), index=(3,), index_dtype=popxl.int32, size=(2, 2),
                ratio=1)  # fmt: skip
    args.update(change)
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.zeros(args["t"], np.float32))
        rois = popxl.variable(np.zeros(args["rois"], np.float32))
        index = popxl.variable(np.zeros(args["index"]), args["index_dtype"])
        with pytest.raises(exc, match=message.replace("[", r"\[")):
            ops.roi_align(t, rois, index, args["size"], 1.0, args["ratio"])


def test_roi_align_is_differentiable_like_torchvision():
    tv_ops = pytest.importorskip("torchvision.ops")
    rng = np.random.default_rng(3)
    data = rng.standard_normal((2, 2, 6, 7)).astype(np.float32)
    boxes = rng.uniform(0, 8, (5, 4)).astype(np.float32)
    index = rng.integers(0, 2, (5,)).astype(np.int32)
    ir = popxl.Ir()
    fwd = ir.create_graph(
        lambda x: ops.roi_align(x, popxl.constant(boxes), popxl.constant(index), (2, 3), 1.0, 2),
        popxl.TensorSpec(data.shape, popxl.float32),
    )
    bwd = popxl.transforms.autodiff(fwd)
    seed = rng.standard_normal((5, 2, 2, 3)).astype(np.float32)
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(data)
        info = ops.call_with_info(fwd, x)
        acts = bwd.inputs_dict(info)
        (dx,) = ops.call(bwd.graph, popxl.constant(seed), inputs_dict=acts)
        s = popxl.d2h_stream(dx.shape, dx.dtype, "dx")
        ops.host_store(s, dx)
    with popxl.Session(ir, "ipu_model") as session:
        got = session.run()[s]
    tx = torch.from_numpy(data).requires_grad_()
    rois = torch.from_numpy(np.concatenate([index[:, None].astype(np.float32), boxes], 1))
    tv_ops.roi_align(tx, rois, (2, 3), 1.0, 2, aligned=False).backward(torch.from_numpy(seed))
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-5, atol=1e-5)


# ---- gather zero_OOR ----------------------------------------------------------------------

# Upstream (popxl/ops/gather.py): "If `True`, out of range indices will produce zeros."
GATHER_CASES = {
    # name: (indices, axis)
    "axis0_past_the_end_and_negative": (np.array([3, 7, 0, -1], np.int32), 0),
    "axis1_2d_indices": (np.array([[1, 5], [-4, 2]], np.int32), 1),
}


@pytest.mark.parametrize("case", sorted(GATHER_CASES))
def test_gather_zero_oor_gives_zeros_for_out_of_range_indices(case, executor):
    indices, axis = GATHER_CASES[case]
    data = np.arange(1, 4 * 3 + 1, dtype=np.float32).reshape(4, 3)
    got = run(
        lambda: {
            "g": ops.gather(popxl.constant(data), popxl.constant(indices), axis, zero_OOR=True),
            "t": ops.tied_gather(
                popxl.constant(data), popxl.constant(indices), axis, zero_OOR=True
            ),  # fmt: skip
        },
        executor,
    )
    size = data.shape[axis]
    valid = (indices >= 0) & (indices < size)
    want = np.take(data, np.where(valid, indices, 0), axis=axis)
    mask = valid.reshape((1,) * axis + indices.shape + (1,) * (data.ndim - axis - 1))
    want = np.where(mask, want, 0)
    np.testing.assert_array_equal(got["g"], want)
    np.testing.assert_array_equal(got["t"], want)


def test_gather_zero_oor_keeps_in_range_rows_even_next_to_inf(executor):
    data = np.array([[np.inf, 1.0], [2.0, 3.0]], np.float32)
    got = run(
        lambda: {
            "g": ops.gather(
                popxl.constant(data), popxl.constant(np.array([1, 9], np.int32)), zero_OOR=True
            )
        },  # fmt: skip
        executor,
    )["g"]
    np.testing.assert_array_equal(got, [[2.0, 3.0], [0.0, 0.0]])


def test_roi_align_and_gather_zero_oor_run_per_replica(executor):
    # Two replicas load different maps (data, 2 * data): each result is its own replica's.
    tv_ops = pytest.importorskip("torchvision.ops")
    rng = np.random.default_rng(5)
    data = rng.uniform(0, 2, (2, 3, 8, 8)).astype(np.float32)
    boxes = rng.uniform(0, 10, (4, 4)).astype(np.float32)
    index = np.array([0, 1, 1, 0], np.int32)
    ir = popxl.Ir(replication=2)
    with ir.main_graph, popxl.in_sequence():
        feed = popxl.h2d_stream(data.shape, popxl.float32, "maps")
        x = ops.host_load(feed)
        y = ops.roi_align(x, popxl.constant(boxes), popxl.constant(index), (2, 2), 0.5, 2)
        g = ops.gather(x, popxl.constant(np.array([1, 5], np.int32)), zero_OOR=True)
        s_y, s_g = popxl.d2h_stream(y.shape, y.dtype, "y"), popxl.d2h_stream(g.shape, g.dtype, "g")
        ops.host_store(s_y, y)
        ops.host_store(s_g, g)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run({feed: np.stack([data, 2 * data])})
    rois = torch.from_numpy(np.concatenate([index[:, None].astype(np.float32), boxes], axis=1))
    want = tv_ops.roi_align(torch.from_numpy(data), rois, (2, 2), 0.5, 2, aligned=False).numpy()
    for r, scale in enumerate((1.0, 2.0)):
        np.testing.assert_allclose(out[s_y][r], scale * want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out[s_g][r][0], scale * data[1])
        np.testing.assert_array_equal(out[s_g][r][1], np.zeros_like(data[0]))
