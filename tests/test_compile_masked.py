"""Losses over rows selected by a boolean mask (``out[mask]``, ``masked_select``) train as eager.

Note [rows selected by a mask] (torch_popxl/compile_masked.py): a selection is captured as all
rows with the mask beside them; sums, means and losses read only the selected rows, and the
loss splitter adds the micro-batches up to eager's loss on the global batch. Every test runs
the same steps eagerly and compares the loss of each step and the weights at the end.

Tolerance: float32 sums in another order (per replica, per micro-batch): rtol 1e-5 / atol 1e-6.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_popxl as popxl
from torch_popxl.compile_masked import MaskedRows
from torch_popxl.errors import DataDependentError

RTOL, ATOL = 1e-5, 1e-6
C = 5  # classes


def _gen(seed=1):
    return torch.Generator().manual_seed(seed)


class Tagger(nn.Module):
    """Token classification: (batch, tokens) ids to (batch, tokens, C) logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(30, 16), nn.Linear(16, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def regressor():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def token_batches(n=3, b=8, T=6):
    g = _gen()
    out = []
    for _ in range(n):
        ids = torch.randint(0, 30, (b, T), generator=g)
        attention = (torch.rand(b, T, generator=g) > 0.3).long()
        out.append((ids, (torch.randint(0, C, (b, T), generator=g), attention)))
    return out


def regression_batches(n=3, b=16, nan_rows=()):
    g = _gen(2)
    out = []
    for _ in range(n):
        t = torch.randn(b, 3, generator=g)
        t[torch.rand(b, 3, generator=g) > 0.7] = float("nan")
        t[list(nan_rows)] = float("nan")
        out.append((torch.randn(b, 12, generator=g), t))
    return out


def train_both(model, loss_fn, batches, R, GA, optimizer=torch.optim.SGD, lr=0.1):
    eager = copy.deepcopy(model)
    opt = optimizer(eager.parameters(), lr=lr)
    trainer = popxl.compile(model, loss_fn, optimizer(model.parameters(), lr=lr),
                            replication_factor=R, gradient_accumulation=GA)  # fmt: skip
    for x, y in batches:
        opt.zero_grad()
        want = loss_fn(eager(x), y)
        want.backward()
        opt.step()
        got = trainer.step(x, y)
        if math.isnan(want.item()):
            assert math.isnan(got)
        else:
            assert got == pytest.approx(want.item(), rel=RTOL, abs=ATOL)
    trainer.sync_weights()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)
    return trainer


def train_own_loss(model, batches, optimizer, lr):
    """A model that returns its loss, trained on dicts of inputs at R=2, GA=2 and eagerly."""
    eager = copy.deepcopy(model)
    opt = optimizer(eager.parameters(), lr=lr)
    trainer = popxl.compile(model, None, optimizer(model.parameters(), lr=lr),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    for inputs in batches:
        opt.zero_grad()
        want = eager(**inputs)
        want.backward()
        opt.step()
        assert trainer.step(inputs) == pytest.approx(want.item(), rel=RTOL)
    trainer.sync_weights()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


def token_loss(logits, targets):
    """The token-classification loss Hugging Face models used to write."""
    labels, attention = targets
    active = attention.view(-1) == 1
    return F.cross_entropy(logits.view(-1, C)[active], labels.view(-1)[active])


def weighted_and_smoothed(logits, targets):
    labels, attention = targets
    active = attention.bool()
    weight = torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0])
    return F.cross_entropy(logits[active], labels[active], weight=weight) + F.cross_entropy(
        logits[active], labels[active], label_smoothing=0.1
    )


def nan_masked_mse(out, t):
    rows = ~t.isnan().any(1)
    return F.mse_loss(out[rows], t[rows])


def masked_select_l1(out, t):
    ok = ~t.isnan()
    return (torch.masked_select(out, ok) - torch.masked_select(t, ok)).abs().mean()


def none_reduction_then_mean(out, t):
    t = torch.nan_to_num(t)
    per_element = F.smooth_l1_loss(out, t, reduction="none")
    return per_element[t > 0].mean() + 0.1 * out.pow(2).mean()


def valid_rows_bce_sum(out, t):
    labels = (torch.nan_to_num(t) > 0).float()
    valid = labels.sum(1) > 0
    return F.binary_cross_entropy_with_logits(out[valid], labels[valid], reduction="sum")


def row_norms(out, t):
    rows = ~t.isnan().any(1)
    return F.mse_loss(out[rows], t[rows]) + out[rows].abs().sum(1).mean()


@pytest.mark.parametrize("loss_fn", [token_loss, weighted_and_smoothed])
@pytest.mark.parametrize(("R", "GA"), [(1, 1), (2, 2)])
def test_token_losses_over_attended_positions_train_as_eager(loss_fn, R, GA):
    train_both(Tagger(), loss_fn, token_batches(), R, GA)


@pytest.mark.parametrize(
    "loss_fn",
    [nan_masked_mse, masked_select_l1, none_reduction_then_mean, valid_rows_bce_sum, row_norms],
)
def test_regression_losses_over_selected_rows_train_as_eager(loss_fn):
    train_both(regressor(), loss_fn, regression_batches(), 2, 2, optimizer=torch.optim.Adam,
               lr=1e-2)  # fmt: skip


def test_micro_batches_that_select_nothing_add_nothing():
    # the first two of four micro-batches select no row: their NaN targets are never read
    train_both(regressor(), nan_masked_mse, regression_batches(nan_rows=range(8)), 2, 2)


def test_a_batch_that_selects_nothing_has_eager_nan_loss_and_zero_gradients():
    batches = regression_batches(nan_rows=range(16))[:1] + regression_batches()[1:]
    train_both(regressor(), nan_masked_mse, batches, 2, 2)


def test_a_model_that_returns_a_masked_loss_trains_as_eager():
    class WithLoss(Tagger):
        def forward(self, ids, attention, labels):
            return token_loss(super().forward(ids), (labels, attention))

    batches = [{"ids": ids, "attention": attention, "labels": labels}
               for ids, (labels, attention) in token_batches()]  # fmt: skip
    train_own_loss(WithLoss(), batches, torch.optim.SGD, lr=0.1)


class MaskedHead(nn.Module):
    """A masked-language-model head run only on the selected tokens' hidden states."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.body = nn.Embedding(30, 16), nn.Linear(16, 16)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, C))

    def forward(self, ids, labels):
        hidden = torch.tanh(self.body(self.emb(ids)))
        chosen = labels != -100
        return F.cross_entropy(self.head(hidden[chosen]), labels[chosen])


def test_a_head_over_the_selected_rows_trains_as_eager():
    batches = [{"ids": ids, "labels": labels.masked_fill(attention == 0, -100)}
               for ids, (labels, attention) in token_batches()]  # fmt: skip
    train_own_loss(MaskedHead(), batches, torch.optim.AdamW, lr=1e-2)


@pytest.mark.parametrize(
    "loss_fn", [token_loss, weighted_and_smoothed, nan_masked_mse, masked_select_l1,
                none_reduction_then_mean, valid_rows_bce_sum, row_norms],
)  # fmt: skip
def test_the_rewrite_of_a_selection_gives_eager_values(loss_fn):
    # the rules themselves, on real tensors: the whole rows with the mask give eager's value
    # on the selected rows (as the loss splitter's eager replays run them; gradients are
    # compared through the trained weights above)
    if loss_fn in (token_loss, weighted_and_smoothed):
        ids, targets = token_batches(1)[0]
        out = Tagger()(ids)
    else:
        x, targets = regression_batches(1)[0]
        out = regressor()(x)
    with torch.no_grad():
        want = loss_fn(out, targets)
        with MaskedRows(always=True):
            got = loss_fn(out, targets)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_what_cannot_read_a_selection_is_refused_naming_the_op():
    def pairs(out, t):
        rows = ~t.isnan().any(1)
        selected = out[rows]
        return (selected @ selected.T).mean()

    def two_masks(out, t):
        return F.mse_loss(out[~t.isnan().any(1)], t[~t.isnan().any(1)])

    for loss_fn, says in [(pairs, "is not elementwise, row-wise or a reduction"),
                          (two_masks, "compute it once")]:  # fmt: skip
        model = regressor()
        before = copy.deepcopy(model.state_dict())
        trainer = popxl.compile(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                                replication_factor=2)  # fmt: skip
        x, t = regression_batches(1)[0]
        with pytest.raises(DataDependentError, match=says):
            trainer.step(x, t)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k


class QNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 2))  # fmt: skip

    def forward(self, x):
        return self.net(x)


class DQNLoss(nn.Module):
    """PyTorch's DQN tutorial's ``optimize_model``: the next states' values from the target
    network over the non-final rows only, written back into a zero vector
    (``next_values[non_final] = target(next[non_final]).max(1).values``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.policy = QNet()
        self.target = copy.deepcopy(self.policy).requires_grad_(False)

    def forward(self, state, action, next_state, non_final, reward):
        q = self.policy(state).gather(1, action)
        with torch.no_grad():
            next_values = torch.zeros(state.shape[0])
            next_values[non_final] = self.target(next_state[non_final]).max(1).values
        return F.smooth_l1_loss(q, (next_values * 0.99 + reward).unsqueeze(1))


@pytest.mark.parametrize(("R", "GA"), [(1, 1), (2, 2)])
def test_dqn_tutorial_optimize_model_with_soft_target_updates_trains_as_eager(R, GA):
    g = _gen(2)
    batches = [(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16, 1), generator=g),
                torch.randn(16, 4, generator=g), torch.rand(16, generator=g) > 0.25,
                torch.randn(16, generator=g)) for _ in range(4)]  # fmt: skip
    model, eager = DQNLoss(), DQNLoss()
    opt = torch.optim.AdamW(model.policy.parameters(), lr=1e-3, amsgrad=True)
    opt_e = torch.optim.AdamW(eager.policy.parameters(), lr=1e-3, amsgrad=True)
    trainer = popxl.compile(model, None, opt, replication_factor=R, gradient_accumulation=GA)
    for batch in batches:
        opt_e.zero_grad()
        want = eager(*batch)
        want.backward()
        opt_e.step()
        assert trainer.step(batch) == pytest.approx(want.item(), rel=RTOL, abs=ATOL)
        for m in (model, eager):  # the tutorial's soft update of the target network
            policy, target = m.policy.state_dict(), m.target.state_dict()
            m.target.load_state_dict({k: policy[k] * 0.005 + target[k] * 0.995 for k in policy})
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)


def row_ops_over_a_selection(out, t):
    rows = out[~t.isnan().any(1)]
    top = rows.topk(2, dim=1).values.sum()
    ordered = rows.sort(dim=1).values[:, 0].mean()
    best = rows.gather(1, rows.argmax(1, keepdim=True)).sum()
    return top + ordered + best + rows.cumsum(1).mean() + rows.max(1).values.mean()


def test_ops_along_another_dim_than_the_rows_read_a_selection_as_eager():
    train_both(regressor(), row_ops_over_a_selection, regression_batches(), 2, 2)
    with torch.no_grad():
        x, t = regression_batches(1)[0]
        out = regressor()(x)
        with MaskedRows(always=True):
            got = row_ops_over_a_selection(out, t)
        torch.testing.assert_close(got, row_ops_over_a_selection(out, t), rtol=RTOL, atol=ATOL)
