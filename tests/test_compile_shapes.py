"""popxl.compile takes batches of any shape, as eager torch does.

A program is built per input signature when first seen and kept (bounded, counted in
``programs``): a DataLoader's short last batch trains as the eager loop on that batch;
inference takes any batch size; a training batch that does not split into R x GA micro-batches
runs as fewer equal micro-batches per replica; one that cannot split over the replicas is
padded with rows the loss does not read (tests/test_compile_padded.py).

Tolerance: float32 sums in another order (per replica, per micro-batch): rtol 1e-5 / atol 1e-6
after a few steps of SGD with momentum (Adam would amplify rounding where a gradient is ~0).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_popxl as popxl

RTOL, ATOL = 1e-5, 1e-6
LAYOUTS = [(1, 1, False, "on_chip"), (2, 4, True, "remote"), (4, 2, True, "on_chip"),
           (1, 4, False, "remote")]  # fmt: skip


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def loader(sizes, seed=1):
    """What a DataLoader over 168 samples with batch_size=64 gives: 64, 64, then 40."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g))
            for n in sizes]  # fmt: skip


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def eager_step(m, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def assert_same(m, opt, ref, ref_opt):
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, err_msg=n)
        np.testing.assert_allclose(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[q]["momentum_buffer"], rtol=RTOL, atol=ATOL)  # fmt: skip


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_a_short_last_batch_trains_as_eager_and_its_program_is_kept(R, GA, rts, state):
    m, ref = mlp(), mlp()
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if rts else None, optimizer_state=state)  # fmt: skip
    for epoch in range(2):
        for x, y in loader([64, 64, 40], seed=epoch):
            assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=RTOL)
    assert_same(m, opt, ref, ref_opt)
    assert len(trainer.programs) == 2  # 64 and 40 rows, each built once
    assert [shapes.split("],")[0] for _, shapes in trainer.programs] == [
        "([(64, 12) float32",
        "([(40, 12) float32",
    ]


@pytest.mark.parametrize(("R", "GA", "sizes"), [(4, 4, [64, 40]), (2, 8, [64, 36, 30]),
                                            (4, 8, [128, 80]), (1, 4, [32, 7])])  # fmt: skip
def test_a_short_batch_that_does_not_split_into_r_x_ga_runs_fewer_micro_batches_as_eager(
    R, GA, sizes
):
    # Note [a short last batch]: 40 on 4 x 4 runs as 2 micro-batches of 5 per replica, 36 on
    # 2 x 8 as 6 of 3, 30 as 5 of 3, 80 on 4 x 8 as 5 of 4, 7 on 1 x 4 as 1 of 7
    m, ref = mlp(), mlp()
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if R > 1 else None, optimizer_state="remote")  # fmt: skip
    for epoch in range(2):
        for x, y in loader(sizes, seed=epoch):
            assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=RTOL)
    assert_same(m, opt, ref, ref_opt)
    assert len(trainer.programs) == len(sizes)


def test_a_short_batch_with_a_counted_mean_and_outputs_runs_as_eager():
    # a token mean with ignore_index counts over the whole batch; the outputs come back in
    # the batch's row order from the fewer micro-batches
    m, ref = mlp(), mlp()
    opt, ref_opt = (
        torch.optim.Adam(m.parameters(), lr=1e-2),
        torch.optim.Adam(ref.parameters(), lr=1e-2),
    )

    def loss_fn(out, y):
        return F.cross_entropy(out, y, ignore_index=3)

    trainer = popxl.compile(m, loss_fn, opt, replication_factor=2, gradient_accumulation=4,
                            return_outputs=True)  # fmt: skip
    for x, y in loader([64, 20, 64, 20]):
        loss, out = trainer.step(x, y)
        expected = ref(x)
        np.testing.assert_allclose(out.detach(), expected.detach(), rtol=RTOL, atol=ATOL)
        ref_opt.zero_grad()
        ref_loss = loss_fn(expected, y)
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=RTOL)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)


def test_a_batch_that_cannot_split_over_the_replicas_is_padded_and_trains_as_eager():
    # Note [padded rows]: 42 on 4 x 4 runs as 48 rows the loss reads 42 of; the refusal where
    # the forward mixes rows (and nothing changing then) is tests/test_compile_padded.py's
    m, ref = mlp(), mlp()
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=4, gradient_accumulation=4)
    for x, y in loader([64, 42, 32]):
        assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=RTOL)
    assert_same(m, opt, ref, ref_opt)
    assert len(trainer.programs) == 3


def test_the_programs_kept_are_bounded_and_a_dropped_one_is_rebuilt():
    m, ref = mlp(), mlp()
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=2, gradient_accumulation=2)
    trainer.max_programs = 2
    for x, y in loader([16, 24, 32, 16, 24]):
        assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=RTOL)
        assert len(trainer.programs) <= 2
    assert [s.split("],")[0] for _, s in trainer.programs] == [
        "([(16, 12) float32",
        "([(24, 12) float32",
    ]
    assert_same(m, opt, ref, ref_opt)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_inference_takes_any_batch_size(R):
    m = mlp().eval()
    infer = popxl.compile(m, replication_factor=R)
    sizes = (10, 64, 3, 1, 10)
    for n in sizes:
        x = torch.randn(n, 12)
        out = infer(x)
        assert out.shape == (n, 4)
        torch.testing.assert_close(out, m(x).detach(), rtol=RTOL, atol=ATOL)
    # one program per padded size (3 and 1 rows both run as 4 at R=4), 10 rows reused
    assert len(infer.programs) == len({-(-n // R) * R for n in sizes})


def test_inference_in_train_mode_needs_a_batch_that_splits_over_the_replicas():
    m = torch.nn.Sequential(torch.nn.Linear(12, 4), torch.nn.BatchNorm1d(4))
    infer = popxl.compile(m, replication_factor=4)
    with pytest.raises(ValueError, match="give a multiple of 4"):
        infer(torch.randn(10, 12))
    assert not infer.programs
