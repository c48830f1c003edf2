"""A training batch that does not split over the replicas trains as the eager loop on it.

Note [padded rows] (torch_popxl/compile_rows.py): 41 samples on 4 replicas run as 4 x GA
micro-batches padded with copies of the last row, which the loss does not read. Every test
runs the eager loop beside the compiled one from the same seed and compares the loss of every
step, the weights and the optimizer state at the end, and the outputs returned (the real
rows). A forward that mixes rows (BatchNorm in training mode) is refused before anything
changes, naming the op and its module.

Tolerance: float32 sums in another order (per replica, per micro-batch, over selected rows):
rtol 1e-5 / atol 1e-6 with SGD, 1e-4 / 1e-5 on the weights after Adam (which divides by
square roots of second moments near 0).
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_compile_shapes import loader as batches
from test_compile_shapes import sgd

import torch_popxl as popxl

RTOL, ATOL = 1e-5, 1e-6


def mlp(norm=None):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(12, 32)]
    layers += [norm(32)] if norm is not None else []
    return torch.nn.Sequential(*layers, torch.nn.GELU(), torch.nn.Linear(32, 4))


def adam(m):
    return torch.optim.Adam(m.parameters(), lr=1e-2)


def eager_step(m, opt, loss_fn, x, y):
    opt.zero_grad()
    out = m(x)
    loss = loss_fn(out, y)
    loss.backward()
    opt.step()
    return loss.item(), out.detach()


def assert_same(m, opt, ref, ref_opt, rtol=RTOL, atol=ATOL):
    for (n, p), q in zip(m.named_parameters(), ref.named_parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q[1].detach(), rtol=rtol, atol=atol, err_msg=n)
        for k, v in ref_opt.state[q[1]].items():
            np.testing.assert_allclose(opt.state[p][k], v, rtol=rtol, atol=atol, err_msg=k)


# (R, GA, rts, optimizer state): 41 on 4 x 1 runs as 44 rows; on 4 x 4 as 48 (micro-batches
# of 3, two of them padding only); 13 on 3 x 2 as 18; 3 on 4 x 4 as 4 (one micro-batch of 1)
LAYOUTS = [(4, 1, False, "on_chip"), (4, 4, True, "remote"), (3, 2, True, "on_chip"),
           (2, 8, False, "remote")]  # fmt: skip


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_a_batch_that_does_not_split_over_the_replicas_trains_as_eager_with_its_outputs(
    R, GA, rts, state
):
    m, ref = mlp(), mlp()
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if rts else None, optimizer_state=state,
                            return_outputs=True)  # fmt: skip
    for x, y in batches([64, 41, 13, 3, 41]):
        loss, out = trainer.step(x, y)
        expected, expected_out = eager_step(ref, ref_opt, F.cross_entropy, x, y)
        assert loss == pytest.approx(expected, rel=RTOL)
        assert out.shape == expected_out.shape  # the real rows only
        np.testing.assert_allclose(out.detach(), expected_out, rtol=RTOL, atol=ATOL)
    assert_same(m, opt, ref, ref_opt)
    assert len(trainer.programs) == 4  # 64, 41 (padded), 13, 3; the second 41 reuses its own


def _sample_weighted(out, target):
    y, w = target
    return (F.cross_entropy(out, y, reduction="none") * w).sum() / w.sum()


LOSSES = {
    "sum": lambda o, y: F.cross_entropy(o, y, reduction="sum"),
    "ignore_index": lambda o, y: F.cross_entropy(o, y, ignore_index=3),
    "label_smoothing": lambda o, y: F.cross_entropy(o, y, label_smoothing=0.1),
    "class_weights": lambda o, y: F.cross_entropy(o, y, weight=torch.tensor([1.0, 2.0, 0.5, 1.0])),
    "ce_plus_mse": lambda o, y: F.cross_entropy(o, y) + 0.1 * o.pow(2).mean(),
    "mse_one_hot": lambda o, y: F.mse_loss(o, F.one_hot(y, 4).float()),
    "kl_batchmean": lambda o, y: F.kl_div(
        F.log_softmax(o, -1), F.one_hot(y, 4).float(), reduction="batchmean"
    ),  # fmt: skip
    "sum_over_rows": lambda o, y: (
        (o.logsumexp(-1) - o.gather(1, y[:, None])[:, 0]).sum() / o.shape[0]
    ),
}


@pytest.mark.parametrize("name", LOSSES)
def test_losses_over_a_padded_batch_are_eagers_on_its_real_rows(name):
    # sums add the real rows; means, label smoothing and class weights count them; a sum
    # divided by the rows (kl_div's batchmean) divides by the real rows
    loss_fn = LOSSES[name]
    m, ref = mlp(), mlp()
    opt, ref_opt = adam(m), adam(ref)
    trainer = popxl.compile(m, loss_fn, opt, replication_factor=4, gradient_accumulation=2,
                            rts_threshold=64, optimizer_state="remote")  # fmt: skip
    for x, y in batches([41, 64, 13, 41]):
        assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, loss_fn, x, y)[0],
                                                   rel=RTOL, abs=ATOL)  # fmt: skip
    assert_same(m, opt, ref, ref_opt, rtol=1e-4, atol=1e-5)


def test_a_sample_weighted_mean_with_a_tuple_of_targets_over_a_padded_batch_is_eagers():
    m, ref = mlp(), mlp()
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, _sample_weighted, opt, replication_factor=4,
                            gradient_accumulation=2)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    for x, y in batches([41, 22]):
        w = torch.rand(len(y), generator=g)
        expected = eager_step(ref, ref_opt, _sample_weighted, x, (y, w))[0]
        assert trainer.step(x, (y, w)) == pytest.approx(expected, rel=RTOL)
    assert_same(m, opt, ref, ref_opt)


class TokenTagger(torch.nn.Module):
    """Rows are sequences: attention and layer norm within each row."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 16)
        self.layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, tokens):
        return self.head(self.layer(self.embed(tokens)))


def test_a_sequence_model_with_a_token_mean_over_a_padded_batch_is_eagers():
    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, 5), y.reshape(-1), ignore_index=-100)

    m, ref = TokenTagger(), TokenTagger()
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, loss_fn, opt, replication_factor=4, gradient_accumulation=2,
                            return_outputs=True)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    for n in (11, 16, 7):
        tokens = torch.randint(0, 10, (n, 6), generator=g)
        y = torch.randint(0, 5, (n, 6), generator=g)
        y[:, 4:] = -100  # padded positions of each sequence
        loss, out = trainer.step(tokens, y)
        expected, expected_out = eager_step(ref, ref_opt, loss_fn, tokens, y)
        assert loss == pytest.approx(expected, rel=RTOL)
        np.testing.assert_allclose(out.detach(), expected_out, rtol=1e-5, atol=1e-5)
    assert_same(m, opt, ref, ref_opt, rtol=1e-5, atol=1e-5)


def test_batch_norm_in_eval_mode_keeps_rows_independent_and_trains_as_eager():
    m, ref = mlp(torch.nn.BatchNorm1d), mlp(torch.nn.BatchNorm1d)
    m.eval(), ref.eval()
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=4)
    for x, y in batches([41, 10]):
        loss = trainer.step(x, y)
        assert loss == pytest.approx(eager_step(ref, ref_opt, F.cross_entropy, x, y)[0], rel=RTOL)
    assert_same(m, opt, ref, ref_opt)


class Centred(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(12, 4)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0)


class ReturnsItsLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = mlp()

    def forward(self, x, labels):
        return F.cross_entropy(self.fc(x), labels)


# (model, loss_fn, the op and module the error names, what the padding changes)
MIXING = [
    (lambda: mlp(torch.nn.BatchNorm1d), F.cross_entropy,
     "aten.native_batch_norm.default in module '1' (BatchNorm1d)", "buffer '1.running_mean'"),
    (Centred, F.cross_entropy, "aten.mean.dim in the model's forward (Centred)", "output"),
    (ReturnsItsLoss, None, "in the model's forward (ReturnsItsLoss)", "output"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "loss_fn", "op", "changed"), MIXING)
def test_a_forward_that_mixes_rows_is_refused_naming_the_op_before_anything_changes(
    make, loss_fn, op, changed
):
    # the reference: a twin trainer that never sees the refused batch (BatchNorm's statistics
    # are per replica, so eager torch is no reference for it at R = 4)
    m = make()
    twin_m = copy.deepcopy(m)
    opt, twin_opt = sgd(m), sgd(twin_m)
    trainer = popxl.compile(m, loss_fn, opt, replication_factor=4, gradient_accumulation=2)
    twin = popxl.compile(twin_m, loss_fn, twin_opt, replication_factor=4, gradient_accumulation=2)
    (x, y), (x41, y41), (x16, y16) = batches([64, 41, 16])

    def step(trainer, x, y):
        return trainer.step({"x": x, "labels": y}) if loss_fn is None else trainer.step(x, y)

    assert step(trainer, x, y) == step(twin, x, y)
    before = copy.deepcopy(m.state_dict())
    momentum = {p: opt.state[p]["momentum_buffer"].clone() for p in m.parameters()}
    with pytest.raises(ValueError) as err:
        step(trainer, x41, y41)
    msg = str(err.value)
    assert "41 samples" in msg and "replication_factor = 4" in msg, msg
    assert op in msg and "mixes the rows" in msg and changed in msg, msg
    assert "multiple of 4 (such as 40 or 44)" in msg and "drop_last=True" in msg, msg
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p in m.parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], momentum[p])
    assert len(trainer.programs) == 1
    # training goes on as if the failed call had not happened
    assert step(trainer, x16, y16) == step(twin, x16, y16)
    for p, q in zip(m.parameters(), twin_m.parameters(), strict=True):
        assert torch.equal(p, q)
