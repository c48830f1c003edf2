"""popxl.compile gives eager's loss and gradients on the global batch for any loss reduction.

The reference is the plain eager loop on the whole batch: ``opt.zero_grad();
loss_fn(model(x), y).backward(); opt.step()``. Sums, means, token means with ``ignore_index``
(micro-batches count different numbers of tokens), masked means and linear compositions must
match it at every replication / accumulation layout; losses that cannot be split into
micro-batch parts are refused when the program is built, with nothing changed.

Tolerance: float32 sums in another order (per replica, per micro-batch): rtol 1e-5 on losses,
rtol 1e-5 / atol 1e-6 on weights and momentum buffers after 3 steps. SGD with momentum, not
Adam: Adam divides by sqrt(v), which amplifies rounding where a gradient is about 0.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from optim_checks import train_both

import torch_popxl as popxl

RTOL, ATOL = 1e-5, 1e-6
# (R, GA, rts, state): replication 1/2/4, accumulation 1/2/4, RTS on/off, on-chip/remote.
LAYOUTS = [(1, 4, False, "on_chip"), (2, 2, True, "remote"), (4, 1, True, "on_chip"),
           (4, 4, False, "remote"), (2, 1, False, "on_chip")]  # fmt: skip


def mlp(out=4):
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, out))


class TokenModel(torch.nn.Module):
    """(batch, seq) token ids -> (batch, seq, vocab) logits."""

    def __init__(self, vocab=7, d=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.proj = torch.nn.Linear(d, vocab)

    def forward(self, x):
        return self.proj(torch.tanh(self.emb(x)))


class VAE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(12, 8)
        self.mu, self.logvar = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)
        self.dec = torch.nn.Linear(3, 12)

    def forward(self, x):
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + 0.1 * torch.tanh(logvar)  # deterministic: no sampling, eager-comparable
        return torch.sigmoid(self.dec(z)), mu, logvar


def vae_loss(out, x):
    recon, mu, logvar = out
    bce = F.binary_cross_entropy(recon, x, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def token_ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)


def masked_mse(out, target):
    y, mask = target
    per = ((out - y) ** 2).mean(dim=1)
    return (per * mask).sum() / (mask > 0).sum()


def smoothed_token_ce_plus_penalty(logits, y):
    # two counted means (the smoothing term counts non-ignored tokens itself) and a mean
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), label_smoothing=0.1)
    return ce + 0.01 * logits.pow(2).mean()


def sample_weighted_mse(out, target):
    # per-sample weights: a weighted count (a float sum without a gradient) divides
    y, weight = target
    return (((out - y) ** 2).mean(dim=1) * weight).sum() / weight.sum()


def sample_weighted_mse_plus_penalty(out, target):
    return sample_weighted_mse(out, target) + 0.01 * out.pow(2).mean()


def mean_plus_sum(out, y):
    return F.mse_loss(out, y) + 0.5 * F.l1_loss(out, y, reduction="sum") / 8 - 1.0


def _data(kind, n_steps=3, batch=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        if kind == "tokens":
            x = torch.randint(0, 7, (batch, 5), generator=g)
            y = torch.randint(0, 7, (batch, 5), generator=g)
            # uneven ignored tokens: some micro-batches count 0-5 tokens per row
            y[torch.rand(batch, 5, generator=g) < 0.4] = -100
            y[1] = -100  # a micro-batch of one row may count nothing at all
            out.append((x, y))
        elif kind == "classes":
            out.append(
                (torch.randn(batch, 12, generator=g), torch.randint(0, 4, (batch,), generator=g))
            )
        elif kind == "vae":
            x = torch.rand(batch, 12, generator=g)
            out.append((x, x))
        elif kind == "masked":
            x, y = torch.randn(batch, 12, generator=g), torch.randn(batch, 4, generator=g)
            mask = (torch.rand(batch, generator=g) < 0.6).float()
            mask[0] = 1.0
            out.append((x, (y, mask)))
        elif kind == "weighted":
            x, y = torch.randn(batch, 12, generator=g), torch.randn(batch, 4, generator=g)
            out.append((x, (y, torch.rand(batch, generator=g))))
        else:
            out.append((torch.randn(batch, 12, generator=g), torch.randn(batch, 4, generator=g)))
    return out


def batchmean_kl(out, y):
    return F.kl_div(out.log_softmax(1), y.softmax(1), reduction="batchmean")


def soft_label_ce_plus_batchmean_kl(out, y):
    # soft targets: a sum divided by the rows (Note [a sum divided by the batch's size])
    return F.cross_entropy(out, y.softmax(1)) + 0.5 * batchmean_kl(out, y)


def sum_over_rows(out, y):
    return (out - y).abs().sum() / out.shape[0]


CASES = {
    "ce_class_weights": (
        mlp,
        torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2, 3, 0.5])),
        "classes",
    ),  # fmt: skip
    "kl_div_batchmean": (mlp, batchmean_kl, "regression"),
    "soft_label_ce_plus_batchmean_kl": (mlp, soft_label_ce_plus_batchmean_kl, "regression"),
    "sum_over_the_batch_size": (mlp, sum_over_rows, "regression"),
    # label smoothing with class weights divides by the targets' weights summed
    "ce_class_weights_label_smoothing": (
        mlp,
        torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2, 3, 0.5]), label_smoothing=0.1),
        "classes",
    ),
    "sample_weighted_mean": (mlp, sample_weighted_mse, "weighted"),
    "sample_weighted_mean_plus_a_mean": (mlp, sample_weighted_mse_plus_penalty, "weighted"),
    "ce_sum": (mlp, torch.nn.CrossEntropyLoss(reduction="sum"), "classes"),
    "ce_mean": (mlp, torch.nn.CrossEntropyLoss(), "classes"),
    "token_mean_ignore_index": (TokenModel, token_ce, "tokens"),
    "vae_bce_sum_plus_kl": (VAE, vae_loss, "vae"),
    "masked_mean": (mlp, masked_mse, "masked"),
    "counted_means_plus_a_mean": (TokenModel, smoothed_token_ce_plus_penalty, "tokens"),
    "mean_plus_scaled_sum_minus_number": (mlp, mean_plus_sum, "regression"),
}


def _train_both(make, loss_fn, kind, R, GA, rts, state, n_steps=3):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    trainer = popxl.compile(model, loss_fn, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=32 if rts else None, optimizer_state=state)  # fmt: skip
    losses, ref_losses = [], []
    for x, y in _data(kind, n_steps):
        losses.append(trainer.step(x, y))
        ref_opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    trainer._publish_optimizer_state()  # optimizer.state as of now, while the trainer lives
    return model, ref, opt, ref_opt, losses, ref_losses


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_every_reduction_matches_the_eager_loop_on_the_global_batch(case, R, GA, rts, state):
    model, ref, opt, ref_opt, losses, ref_losses = _train_both(*CASES[case], R, GA, rts, state)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, err_msg=n)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[q]["momentum_buffer"], rtol=RTOL, atol=ATOL)  # fmt: skip


def test_a_summed_loss_is_not_divided_by_the_number_of_micro_batches():
    # The figure a mean over micro-batches would give: eager's / (R * GA).
    *_, losses, ref_losses = _train_both(*CASES["ce_sum"], 2, 2, False, "on_chip", n_steps=1)
    assert losses[0] == pytest.approx(ref_losses[0], rel=RTOL)
    assert losses[0] > 3 * ref_losses[0] / 4


NOT_SPLITTABLE = {
    "sqrt_of_a_mean": (lambda out, y: torch.sqrt(F.mse_loss(out, y)), "aten.sqrt"),
    "product_of_means": (lambda out, y: F.mse_loss(out, y) * F.l1_loss(out, y), "aten.mul"),
    "count_depending_on_the_outputs": (
        lambda out, y: (out * (out > 0.5)).sum() / (out > 0.5).sum() + F.mse_loss(out, y),
        "count of elements depends on the model's outputs",
    ),
    "sum_over_the_root_of_the_batch_size": (
        lambda out, y: F.mse_loss(out, y, reduction="sum") / out.shape[0] ** 0.5,
        "divides by another function of the micro-batch's size",
    ),
    "in_batch_negatives": (  # a contrastive loss: every sample's negatives are the others
        lambda out, y: F.cross_entropy(out @ out.t(), torch.arange(out.shape[0])),
        "depends on the other samples of its micro-batch",
    ),
    "dice_ratio_of_batch_sums": (
        lambda out, y: 1 - 2 * (out.sigmoid() * y.sigmoid()).sum() / (out.sigmoid().sum() + 1),
        "aten.div",
    ),
    "max_over_the_batch": (lambda out, y: (out - y).abs().max(), "reduces the batch"),
}


@pytest.mark.parametrize("case", sorted(NOT_SPLITTABLE))
def test_a_loss_that_cannot_be_split_is_refused_at_build_with_nothing_changed(case):
    loss_fn, says = NOT_SPLITTABLE[case]
    torch.manual_seed(0)
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = popxl.compile(model, loss_fn, opt, replication_factor=2, gradient_accumulation=2)
    x, y = _data("regression", 1)[0]
    with pytest.raises(ValueError, match="cannot split this loss") as err:
        trainer.plan(x, y)
    assert says in str(err.value)
    assert "replication_factor=1 and gradient_accumulation=1" in str(err.value)
    with pytest.raises(ValueError, match="cannot split this loss"):
        trainer.step(x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state


class Contrastive(torch.nn.Module):
    """CLIP's loss in small: every x of the batch scored against every z, the matching pair
    the class (``arange`` labels made in the forward), both directions' cross entropies."""

    def __init__(self):
        super().__init__()
        self.fx, self.fz = torch.nn.Linear(12, 6), torch.nn.Linear(5, 6)

    def forward(self, x, z, return_loss=False):
        logits = self.fx(x) @ self.fz(z).T
        if not return_loss:
            return logits
        labels = torch.arange(x.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def test_a_contrastive_loss_over_the_batch_is_refused_with_micro_batches_and_trains_without():
    """The model's loss pairs the samples of the whole batch: no micro-batch parts add up to
    it, so R * GA > 1 is refused when the program is built, saying why, with nothing changed
    (before, the step failed asking for targets); with R = GA = 1 it trains as eager."""
    torch.manual_seed(0)
    model = Contrastive()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    batches = [{"x": torch.randn(8, 12, generator=g), "z": torch.randn(8, 5, generator=g),
                "return_loss": True} for _ in range(2)]  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    split = popxl.compile(model, None, opt, replication_factor=2, gradient_accumulation=2)
    for run in (split.plan, split.step):
        with pytest.raises(ValueError, match="cannot split this loss") as err:
            run(batches[0])
        assert "pairs the samples of the batch with each other" in str(err.value)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
    trainer = popxl.compile(model, None, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for inputs in batches:
        loss = trainer.step(inputs)
        ref_opt.zero_grad()
        ref_loss = ref(**inputs)
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=RTOL)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


class Frames(torch.nn.Module):
    """(batch, frames, 6) features -> (frames, batch, 5) log-probabilities, as CTC takes them."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)

    def forward(self, x):
        return self.proj(x).log_softmax(-1).transpose(0, 1)


def ctc_per_label(log_probs, labels):
    """CTC with lengths as Python ints (Note [CTC loss in a captured graph]), each sequence's
    loss over its label count, the mean over the batch (what ``reduction='mean'`` computes)."""
    steps, n = log_probs.shape[:2]
    nll = F.ctc_loss(log_probs, labels, (steps,) * n, (labels.shape[1],) * n, reduction="none")
    return (nll / labels.shape[1]).mean()


@pytest.mark.parametrize(("R", "GA"), [(1, 1), (2, 2)])
def test_ctc_loss_with_int_lengths_trains_as_eager(R, GA):
    """Refused before: torch's fake tensors call ``_ctc_loss``'s output shapes data-dependent
    (Note [CTC loss in a captured graph]). Every replica's sequences run in one call (no
    per-replica loop in ``explain()``), with int lengths and with tensor lengths."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 10, 6, generator=g), torch.randint(1, 5, (8, 3), generator=g))
            for _ in range(3)]  # fmt: skip
    torch.manual_seed(0)
    trainer = train_both(Frames(), ctc_per_label, data, R, GA, lr=0.1, rtol=RTOL, atol=ATOL)
    assert trainer.explain() == []

    def tensor_lengths(log_probs, labels):
        n = torch.full((labels.shape[0],), labels.shape[1])
        return F.ctc_loss(log_probs, labels, torch.full_like(n, log_probs.shape[0]), n)

    torch.manual_seed(0)
    trainer = train_both(Frames(), tensor_lengths, data, R, GA, lr=0.1, rtol=RTOL, atol=ATOL)
    assert trainer.explain() == []


def test_any_loss_trains_as_written_with_one_replica_and_no_accumulation():
    loss_fn = NOT_SPLITTABLE["sqrt_of_a_mean"][0]
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    trainer = popxl.compile(model, loss_fn, opt)
    for x, y in _data("regression", 2):
        loss = trainer.step(x, y)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=RTOL)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


def test_gaussian_nll_with_a_variance_of_ones_checks_it_at_capture_and_matches_eager():
    # gaussian_nll_loss raises on a negative variance (``if torch.any(var < 0)``): a variance
    # made by ``ones_like`` has a value known while the graph is captured (Note [constant
    # folding]), so the check runs there
    def loss_fn(out, y):
        return F.gaussian_nll_loss(out, y, torch.ones_like(out)) + F.poisson_nll_loss(out, y)

    model, ref, *_, losses, ref_losses = _train_both(mlp, loss_fn, "regression", 2, 2, False,
                                                     "on_chip")  # fmt: skip
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


# ---- CTC (Note [CTC loss in a captured graph] in opdefs/ctc.py) ------------------------------


def ctc(log_probs, targets):
    """Padded targets (0 = padding) whose lengths vary per sample, as a speech batch has."""
    frames, n, _ = log_probs.shape
    lengths = (targets > 0).sum(1)
    return F.ctc_loss(log_probs, targets, torch.full((n,), frames, dtype=torch.long), lengths,
                      zero_infinity=True)  # fmt: skip


def _ctc_batches(n_steps=3, batch=8):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n_steps):
        targets = torch.randint(1, 5, (batch, 4), generator=g)
        targets[::3, 3] = 0
        targets[1::4, 2:] = 0
        out.append((torch.randn(batch, 10, 6, generator=g), targets))
    return out


@pytest.mark.parametrize(("R", "GA"), [(1, 1), (2, 1), (2, 2)])
def test_ctc_loss_with_per_sample_lengths_trains_as_eager(R, GA):
    torch.manual_seed(0)
    train_both(Frames(), ctc, _ctc_batches(), R, GA, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padded", [True, False])
def test_ctc_ops_on_stacked_replicas_match_torch_per_replica(padded):
    """The vmap rules run every replica's samples as one call: values and gradients equal
    torch's own ``ctc_loss`` on each replica (padded or concatenated targets)."""
    g = torch.Generator().manual_seed(3)
    R, T, N, C = 3, 7, 4, 5
    log_probs = torch.randn(R, T, N, C, generator=g).log_softmax(-1).requires_grad_(True)
    target_lengths = torch.randint(1, 4, (R, N), generator=g)
    input_lengths = torch.full((N,), T, dtype=torch.long)  # the same on every replica
    if padded:
        targets = torch.randint(1, C, (R, N, 3), generator=g)
    else:  # each replica's targets concatenated, every replica the same total length
        target_lengths[:, -1] = 8 - target_lengths[:, :-1].sum(1)
        targets = torch.randint(1, C, (R, 8), generator=g)

    def one(lp, tg, tl):
        return torch.ops.torch_popxl.ctc_loss(lp, tg, input_lengths, tl, 0, False)

    got = torch.func.vmap(one)(log_probs, targets, target_lengths)
    (got_grad,) = torch.autograd.grad(got.sum(), log_probs)
    for r in range(R):
        lp = log_probs[r].detach().requires_grad_(True)
        want = F.ctc_loss(lp, targets[r], input_lengths, target_lengths[r], reduction="none")
        (want_grad,) = torch.autograd.grad(want.sum(), lp)
        torch.testing.assert_close(got[r], want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_grad[r], want_grad, rtol=1e-6, atol=1e-6)


class TwoHeads(torch.nn.Module):
    """A multi-task model: a dict of a classification and a box-regression output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.cls, self.box = (torch.nn.Linear(12, 16), torch.nn.Linear(16, 4),
                                         torch.nn.Linear(16, 2))  # fmt: skip

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"cls": self.cls(h), "box": self.box(h)}


def multi_task(out, targets):
    labels, (boxes, weights) = targets["cls"], targets["box"]
    per_box = F.smooth_l1_loss(out["box"], boxes, reduction="none").sum(1)
    return F.cross_entropy(out["cls"], labels, ignore_index=-1) + (per_box * weights).mean()


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS[:3])
def test_targets_as_a_dict_of_nested_tensors_train_as_eager(R, GA, rts, state):
    """``trainer.step(x, {"cls": labels, "box": (boxes, weights)})``: the targets reach the loss
    in the structure given, cut into micro-batches leaf by leaf."""
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        labels = torch.randint(0, 4, (16,), generator=g)
        labels[::5] = -1  # ignored rows: micro-batches count different numbers
        box = (torch.randn(16, 2, generator=g), torch.rand(16, generator=g))
        batches.append((torch.randn(16, 12, generator=g), {"cls": labels, "box": box}))
    model, eager = TwoHeads(), TwoHeads()
    opt, opt_e = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager))
    trainer = popxl.compile(model, multi_task, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=8 if rts else None, optimizer_state=state)  # fmt: skip
    for x, y in batches:
        opt_e.zero_grad()
        want = multi_task(eager(x), y)
        want.backward()
        opt_e.step()
        assert trainer.step(x, y) == pytest.approx(want.item(), rel=RTOL)
    for (n, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=n)
