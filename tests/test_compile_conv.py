"""Conv nets on the fast executor's stacked path: max pooling through the channels-last kernel
(Note [max pooling channels last]), convolutions as matmuls (Note [convolutions with one output
position]), batch norm per row or folded into the channels (Note [convolutions and batch norm
on stacked rows]) and accumulation loops that fold with batch norm's running statistics,
counters and dropout (Note [fold the accumulation loop]). Every result is compared with eager
torch per replica or with the reference executor."""

import numpy as np
import pytest
import torch
from optim_checks import SGD_LR, fast_matches_reference
from torch.utils._python_dispatch import TorchDispatchMode

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.runtime import explicit

aten = torch.ops.aten


@pytest.mark.parametrize(
    "kernel,stride,padding,dilation,ceil",
    [(2, 2, 0, 1, False), (3, 2, 1, 1, False), (3, 2, 1, 1, True), (2, 1, 0, 2, False)],
)
def test_channels_last_max_pooling_gives_eager_values_and_indices(
    kernel, stride, padding, dilation, ceil
):
    """Ties (ReLU's zeros, rounded values), NaN and -inf pick the same positions as ATen's
    contiguous kernel, so the unchanged backward routes gradients as eager's does."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 11, 12, generator=g).relu().round(decimals=1)
    x[0, 0, 0, 0], x[1, 1, 2, 3], x[2, 2, :4, :4] = float("nan"), float("-inf"), 0.0
    args = ([kernel] * 2, [stride] * 2, [padding] * 2, [dilation] * 2, ceil)
    out, indices = explicit._max_pool_channels_last(x, *args)
    want_out, want_indices = aten.max_pool2d_with_indices(x, *args)
    assert out.is_contiguous() and indices.is_contiguous()
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(out, want_out, equal_nan=True, rtol=0, atol=0)


def _eager_batch_norm(x, w, b, mean, var, grad, fold):
    """Per replica and iteration, in the loop's order: eager batch norm's output, running
    statistics after every update, and the input/weight/bias gradients of ``(y * grad).sum()``
    (``x``: ``[fold * R, N, C, H, W]``; ``w``, ``b``: ``[C]`` shared or ``[fold * R, C]``)."""
    mean, var = mean.clone(), var.clone()
    R = mean.shape[0]
    ys, gx, gw, gb = [], [], [], []
    for i in range(x.shape[0]):
        xi = x[i].clone().requires_grad_()
        wi = (w[i] if w.dim() == 2 else w).clone().requires_grad_()
        bi = (b[i] if b.dim() == 2 else b).clone().requires_grad_()
        y = torch.nn.functional.batch_norm(xi, mean[i % R], var[i % R], wi, bi, True, 0.1, 1e-5)
        (y * grad[i]).sum().backward()
        ys.append(y.detach())
        gx.append(xi.grad)
        gw.append(wi.grad)
        gb.append(bi.grad)
    return torch.stack(ys), mean, var, torch.stack(gx), torch.stack(gw), torch.stack(gb)


@pytest.mark.parametrize("image", [4, 24], ids=["channels_fold", "per_row"])
@pytest.mark.parametrize("fold", [1, 2])
@pytest.mark.parametrize("per_row_affine", [False, True])
def test_stacked_batch_norm_matches_eager_per_replica_and_iteration(image, fold, per_row_affine):
    """Both forms of Note [convolutions and batch norm on stacked rows] (small rows fold into
    the channels, large rows run one call each) give eager's per-replica output, saved
    statistics' gradients and running statistics, also when a folded loop's ``fold``
    iterations share the R rows of running statistics (updated once per iteration, in
    order, Note [fold the accumulation loop])."""
    R, N, C = 2, 8, 16
    assert (N * C * image * image >= explicit._BN_ROW_NUMEL) == (image == 24)
    g = torch.Generator().manual_seed(1)
    rows = fold * R
    x = torch.randn(rows, N, C, image, image, generator=g) * 2 + 0.5
    grad = torch.randn(x.shape, generator=g)
    shape = (rows, C) if per_row_affine else (C,)
    w, b = torch.rand(shape, generator=g) + 0.5, torch.randn(shape, generator=g)
    mean, var = torch.randn(R, C, generator=g), torch.rand(R, C, generator=g) + 0.5
    want = _eager_batch_norm(x, w, b, mean, var, grad, fold)
    flags = [True, per_row_affine, per_row_affine, True, True]
    got_mean, got_var = mean.clone(), var.clone()
    out, save_mean, save_invstd = explicit._batch_norm_stacked(
        x, w, b, got_mean, got_var, True, 0.1, 1e-5, flags=flags
    )
    gx, gw, gb = explicit._batch_norm_backward_stacked(
        grad, x, w, got_mean, got_var, save_mean, save_invstd, True, 1e-5, [True, True, True],
        flags=[True, True, per_row_affine, True, True, True, True],
    )  # fmt: skip
    if not per_row_affine:  # a shared weight's gradient is each row's own
        gw, gb = gw.reshape(rows, C), gb.reshape(rows, C)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for name, got, ref in zip(("out", "running mean", "running var", "grad x", "grad w",
                               "grad b"), (out, got_mean, got_var, gx, gw, gb), want,
                              strict=True):  # fmt: skip
        torch.testing.assert_close(got, ref, **tol, msg=name)
    flat = x.transpose(1, 2).reshape(rows, C, -1)
    torch.testing.assert_close(save_mean, flat.mean(-1), **tol)


def _cnn(dropout: float = 0.0, image: int = 8):
    side = (image - 2) // 2
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 6, 3), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Dropout(dropout), torch.nn.Flatten(),
        torch.nn.Linear(6 * side * side, 5),
    )  # fmt: skip


@pytest.mark.parametrize("image", [8, 24], ids=["channels_fold", "per_row"])
@pytest.mark.parametrize("R", [1, 2])
def test_batch_norm_accumulation_loop_folds_and_trains_as_the_reference(image, R):
    """The accumulation loop of a batch-norm CNN runs as one pass (each batch norm's running
    statistics updated once per micro-batch, ``num_batches_tracked`` counted once per
    micro-batch), also at R = 1 (Note [one replica, stacked]): losses, parameters, running
    statistics and counters equal the reference executor's."""
    GA = 3
    rng = np.random.default_rng(3)
    batches = [(rng.normal(size=(R * GA * 4, 2, image, image)).astype(np.float32),
                rng.integers(0, 5, R * GA * 4)) for _ in range(2)]  # fmt: skip

    def model():
        return _cnn(image=image)

    fast, fns = fast_matches_reference(model, R, GA, batches)
    assert fast["1.num_batches_tracked"] == 2 * GA  # per micro-batch, as eager counts
    source = fns["normal"].source
    assert source.count("iterations folded") == 1
    assert source.count(f"for _ in range({GA}):") == 2  # the two counters
    assert "_batch_norm_stacked" in str(fns["normal"].__globals__.values())


@pytest.mark.parametrize("R", [1, 2])
def test_dropout_batch_norm_cnn_folds_its_loop(R):
    """Dropout draws into values each iteration creates and batch norm's running statistics
    update once per iteration, so the dropout CNN's accumulation loop folds, also at R = 1
    (Note [one replica, stacked]), and trains to finite weights and statistics (each row
    draws its own mask: tests/test_explicit.py)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(R * 2 * 4, 2, 8, 8)).astype(np.float32)
    y = rng.integers(0, 5, R * 2 * 4)
    torch.manual_seed(0)
    model = _cnn(dropout=0.5)
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            replication_factor=R, gradient_accumulation=2)  # fmt: skip
    losses = [trainer.step(x, y) for _ in range(3)]
    assert np.isfinite(losses).all()
    assert trainer.session._executor.program.folded_loops == 1
    assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    assert model[1].num_batches_tracked.item() == 3 * 2


def _build_counter(R, read: bool):
    """A loop over 4 micro-batches that counts its iterations into a variable (and, with
    ``read``, multiplies its stored result by the count, which sees every iteration's
    count: the loop must not fold then)."""
    ir = popxl.Ir(replication=R)
    ir.num_host_transfers = 4
    with ir.main_graph, popxl.in_sequence():
        W = popxl.variable(np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2), name="W")
        c = popxl.variable(np.zeros((), np.float32), name="count")
        xs = popxl.h2d_stream((5, 3), popxl.float32, "x")
        ys = popxl.d2h_stream((5, 2), popxl.float32, "y")

        def body(W, c):
            y = ops.host_load(xs) @ W
            c.add_(1.0)
            ops.host_store(ys, y * c if read else y)

        info = ops.repeat_with_info(ir.create_graph(body, W, c), 4, W, c)
        info.set_parent_input_modified(c)
    return ir, xs, ys, c


@pytest.mark.parametrize("read", [False, True])
def test_a_counter_folds_unless_the_loop_reads_it(read):
    R = 2
    x = np.random.default_rng(6).normal(size=(4, R, 5, 3)).astype(np.float32)
    results = {}
    for executor in ("fast", "reference"):
        ir, xs, ys, c = _build_counter(R, read)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        if executor == "fast":
            assert ("iterations folded" in session._executor.source()) is not read
        with session:
            results[executor] = (session.run({xs: x})[ys], session.get_tensor_data(c))
    np.testing.assert_allclose(results["fast"][0], results["reference"][0], rtol=1e-6)
    assert results["fast"][1] == results["reference"][1] == 4.0
    W = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
    scale = np.arange(1, 5, dtype=np.float32).reshape(4, 1, 1, 1) if read else 1.0
    np.testing.assert_allclose(results["fast"][0], (x @ W) * scale, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "image,kernel,stride,padding,one_position",
    [
        ((1, 1), (3, 3), 1, 1, True),  # resnet's last stage on 32x32 images
        ((2, 2), (3, 3), 2, 1, True),  # the stride-2 convolution into it
        ((2, 2), (1, 1), 2, 0, True),  # its downsampling shortcut
        ((4, 3), (4, 3), 1, 0, True),  # a kernel as large as the image
        ((5, 3), (3, 4), 5, 1, True),  # input rows and taps left unseen
        ((1, 1, 1), (3, 3, 3), 1, 1, True),  # 3-d
        ((3, 3), (3, 3), 2, 1, False),  # two output positions: ATen's kernel
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_convolutions_with_one_output_position_are_matmuls_with_eager_gradients(
    image, kernel, stride, padding, one_position, bias
):
    """Note [convolutions with one output position]: the output and the input, weight and
    bias gradients equal ATen's convolution's, for every output mask."""
    g = torch.Generator().manual_seed(2)
    spatial = len(image)
    x = torch.randn(6, 5, *image, generator=g)
    w = torch.randn(7, 5, *kernel, generator=g)
    b = torch.randn(7, generator=g) if bias else None
    conv = ([stride] * spatial, [padding] * spatial, [1] * spatial, False, [0] * spatial, 1)
    assert (explicit._one_position(x.shape, w.shape, *conv) is not None) == one_position
    out = explicit._convolution(x, w, b, *conv)
    want = aten.convolution(x, w, b, *conv)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(want.shape, generator=g)
    for mask in ([True, True, bias], [True, False, False], [False, True, False]):
        got = explicit._convolution_backward(grad, x, w, [7] if bias else None, *conv, mask)
        ref = aten.convolution_backward(grad, x, w, [7] if bias else None, *conv, mask)
        for name, a, r in zip(("x", "w", "b"), got, ref, strict=True):
            assert (a is None) == (r is None), name
            if r is not None:
                torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=name)


class _AtenCalls(TorchDispatchMode):
    """The aten overloads called under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("image,stride,taps", [((1, 1), 1, 1), ((2, 2), 2, 4), ((2, 1), 2, 2)])
def test_one_position_weight_gradient_scatters_several_taps_in_one_pass(image, stride, taps):
    """A one-position convolution's weight gradient (zero at the taps that see only padding)
    is written by ``scatter_`` where it has several taps and by ``index_copy_`` where it has
    one (``_scatter_taps``), and equals ATen's."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, *image, generator=g)
    w = torch.randn(5, 6, 3, 3, generator=g)
    conv = ([stride] * 2, [1, 1], [1, 1], False, [0, 0], 1)
    grad = torch.randn(4, 5, 1, 1, generator=g)
    with _AtenCalls() as mode:
        got = explicit._convolution_backward(grad, x, w, None, *conv, [False, True, False])[1]
    want = aten.convolution_backward(grad, x, w, None, *conv, [False, True, False])[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert int((want != 0).flatten(2).any(dim=(0, 1)).sum()) == taps  # the taps it has
    scatter, index_copy = aten.scatter_.src in mode.calls, aten.index_copy_.default in mode.calls
    assert (scatter, index_copy) == ((taps > 1), (taps == 1))


def test_resnet_stage_with_one_output_position_trains_as_the_reference():
    """A conv net whose last convolutions see 1x1 and 2x2 images (their weight gradients
    summed over replicas, their accumulation loop folded) trains as the reference executor."""
    R, GA = 2, 2
    rng = np.random.default_rng(12)
    batches = [(rng.normal(size=(R * GA * 4, 3, 4, 4)).astype(np.float32),
                rng.integers(0, 5, R * GA * 4)) for _ in range(2)]  # fmt: skip

    def model():
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3, stride=2, padding=1),
            torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.Flatten(),
            torch.nn.Linear(16, 5),
        )  # fmt: skip

    fast, fns = fast_matches_reference(model, R, GA, batches)
    fn = fns["normal"]
    assert fn.explicit and "iterations folded" in fn.source
    # Note [one gather of a convolution's taps]: the two one-position convolutions (4 and 1
    # of their 9 taps) gather their taps once, at the forward; the backward reads them
    (gather,) = [k for k, v in fn.__globals__.items() if v is explicit._tap_weights]
    assert fn.source.count(f"{gather}(") == 2
    assert fn.source.count(", weights=v") == 4


class _TiedConv(torch.nn.Module):
    """One stride-2 convolution on 2x2 images (4 of its 9 taps; its input gradient needed)
    and, after, on their 1x1 corners (the centre tap; no input gradient: its backward
    reads no taps, so the 2x2 one's backward is the next to look its weight up)."""

    def __init__(self):
        super().__init__()
        self.point = torch.nn.Conv2d(6, 6, 1)
        self.conv = torch.nn.Conv2d(6, 6, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(6, 5)

    def forward(self, x):
        both = self.conv(self.point(x)) + self.conv(x[:, :, :1, :1])
        return self.head(both.flatten(1))


def test_one_weight_with_other_taps_in_two_convolutions_trains_as_the_reference():
    """Note [one gather of a convolution's taps]: a backward reads the taps its own forward
    gathered (keyed by weight and taps), so a weight used with two tap sets trains as the
    reference executor does."""
    R, GA = 2, 2
    rng = np.random.default_rng(13)
    batches = [(rng.normal(size=(R * GA * 4, 6, 2, 2)).astype(np.float32),
                rng.integers(0, 5, R * GA * 4)) for _ in range(2)]  # fmt: skip
    _, fns = fast_matches_reference(_TiedConv, R, GA, batches)
    assert fns["normal"].source.count(", weights=v") == 3  # two forwards, the 2x2 backward


@pytest.mark.parametrize("image", [4, 24], ids=["channels_fold", "per_row"])
def test_stacked_batch_norm_in_evaluation_matches_eager_per_replica(image):
    """Evaluation normalises with each replica's running statistics, saves none (``[rows,
    0]``, as the kernel's empty ones) and leaves the statistics as they were; the
    gradients equal eager's per replica."""
    R, N, C = 2, 8, 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(R, N, C, image, image, generator=g)
    grad = torch.randn(x.shape, generator=g)
    w, b = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)
    mean, var = torch.randn(R, C, generator=g), torch.rand(R, C, generator=g) + 0.5
    before = mean.clone(), var.clone()
    out, save_mean, save_invstd = explicit._batch_norm_stacked(
        x, w, b, mean, var, False, 0.1, 1e-5, flags=[True, False, False, True, True]
    )
    assert save_mean.shape == save_invstd.shape == (R, 0)
    torch.testing.assert_close((mean, var), before, rtol=0, atol=0)
    gx, gw, gb = explicit._batch_norm_backward_stacked(
        grad, x, w, mean, var, save_mean, save_invstd, False, 1e-5, [True, True, True],
        flags=[True, True, False, True, True, True, True],
    )  # fmt: skip
    for r in range(R):
        xr, wr, br = (t.clone().requires_grad_() for t in (x[r], w, b))
        y = torch.nn.functional.batch_norm(xr, mean[r], var[r], wr, br, False, 0.1, 1e-5)
        (y * grad[r]).sum().backward()
        torch.testing.assert_close(out[r], y.detach(), rtol=1e-5, atol=1e-5)
        for got, want in ((gx[r], xr.grad), (gw.reshape(R, C)[r], wr.grad),
                          (gb.reshape(R, C)[r], br.grad)):  # fmt: skip
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("image", [(9, 8), (4, 4)], ids=["large", "small"])
@pytest.mark.parametrize("channels_in,given_channels_last", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("summed", [False, True])
def test_stacked_convolutions_run_channels_last_with_eager_values(
    image, channels_in, given_channels_last, summed
):
    """Note [convolutions channels last]: rows of images large enough that have one channel
    (both layouts at once) or come channels-last (a convolution's output) give channels-last
    outputs and input gradients, NCHW ones with more channels and small images NCHW, whose
    values are eager's per replica; the weight and bias gradients are each row's (or,
    ``summed``, their sum over the rows)."""
    R, N, C_out = 2, 3, 5
    g = torch.Generator().manual_seed(7)
    x = torch.randn(R, N, channels_in, *image, generator=g)
    if given_channels_last:  # [R, N, H, W, C] in memory
        x = x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
    w, b = torch.randn(C_out, channels_in, 3, 3, generator=g), torch.randn(C_out, generator=g)
    large = image[0] * image[1] >= explicit._CHANNELS_LAST_POSITIONS
    channels_last = large and (channels_in == 1 or given_channels_last)
    conv = ([1, 1], [1, 0], [1, 1], False, [0, 0], 1)
    out = explicit._conv_stacked(x, w, b, *conv, flags=[True, False, False])
    assert out.shape == (R, N, C_out, image[0], image[1] - 2)
    assert (out[0].stride(1) == 1) == channels_last
    grad = torch.randn(out.shape, generator=g)
    gx, gw, gb = explicit._conv_backward_stacked(
        grad, x, w, [C_out], *conv, [True, True, True],
        flags=[True, True, False], summed=summed,
    )  # fmt: skip
    assert (gx[0].stride(1) == 1) == (channels_last and channels_in > 1)
    want_w, want_b = [], []
    for r in range(R):
        xr, wr, br = (t.clone().requires_grad_() for t in (x[r], w, b))
        y = torch.nn.functional.conv2d(xr, wr, br, padding=(1, 0))
        (y * grad[r]).sum().backward()
        torch.testing.assert_close(out[r], y.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx[r], xr.grad, rtol=1e-5, atol=1e-5)
        want_w.append(wr.grad)
        want_b.append(br.grad)
    want_w, want_b = torch.stack(want_w), torch.stack(want_b)
    if summed:
        want_w, want_b = want_w.sum(0), want_b.sum(0)
    torch.testing.assert_close(gw, want_w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gb, want_b, rtol=1e-4, atol=1e-4)


def test_max_pooling_keeps_a_channels_last_image_channels_last_with_eager_gradients():
    """Note [max pooling channels last]: a convolution's channels-last output is pooled in
    its layout (no copies), with eager's values and indices; the backward, given an NCHW
    output gradient, routes it as eager's does."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 6, 10, 10, generator=g).relu().round(decimals=1)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    args = ([2, 2], [2, 2], [0, 0], [1, 1], False)
    out, indices = explicit._max_pool_channels_last(x_cl, *args)
    want_out, want_indices = aten.max_pool2d_with_indices(x, *args)
    assert out.stride(1) == 1  # the layout kept
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    grad = torch.randn(want_out.shape, generator=g)
    got = explicit._max_pool_backward_channels_last(grad, x_cl, *args, indices)
    want = aten.max_pool2d_with_indices_backward(grad, x, *args, want_indices)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_efficientnet_b0_with_folded_accumulation_trains_as_the_reference_and_eager():
    """torchvision's efficientnet_b0 (depthwise convolutions, squeeze-excitation, SiLU, batch
    norm in training, its last stages at one output position) at R = 2, GA = 2: the folded
    loop's first loss is eager's mean over the four micro-batches (each its own batch norm
    statistics), and the step's weights are the reference executor's to float32's own
    accuracy on this net: the tolerance is ``lr`` times eager's largest float32 gradient error
    against float64 (about 2e-4 on gradients up to 16), times 4.
    Images of 64x64 and micro-batches of 4 keep the run well conditioned: with 32x32 images
    and micro-batches of 2 the last stages' batch norm normalises two values per channel, and
    eager's loss changes from 7.7 to 4.7 when its input is scaled by 1 + 1e-7 (4.9 in
    float64), so no two float32 summation orders agree there."""
    torchvision = pytest.importorskip("torchvision")
    R, GA, micro = 2, 2, 4
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.normal(size=(R * GA * micro, 3, 64, 64)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, R * GA * micro))

    def model():
        return torchvision.models.efficientnet_b0(num_classes=10, stochastic_depth_prob=0.0,
                                                  dropout=0.0)  # fmt: skip

    losses, grads = {}, {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        eager = model().to(dtype)
        loss = sum(torch.nn.functional.cross_entropy(eager(x[i:i + micro].to(dtype)),
                                                     y[i:i + micro])
                   for i in range(0, len(x), micro)) / (R * GA)  # fmt: skip
        loss.backward()
        losses[dtype] = loss.item()
        grads[dtype] = [p.grad.double() for p in eager.parameters()]
    err = max((a - b).abs().max().item()
              for a, b in zip(grads[torch.float32], grads[torch.float64], strict=True))  # fmt: skip
    _, fns = fast_matches_reference(model, R, GA, [(x.numpy(), y.numpy())],
                                    first_loss=losses[torch.float32], state_atol=SGD_LR * 4 * err)  # fmt: skip
    assert fns["normal"].explicit and "iterations folded" in fns["normal"].source
