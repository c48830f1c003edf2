"""Public example training scripts ported to popxl.compile by replacing only the training step.

Each script below follows a well-known PyTorch example loop (pytorch/examples: the MNIST CNN
with Adadelta and StepLR, the VAE with its summed loss, the word-language-model Transformer with
a causal mask, gradient clipping and manual learning-rate annealing, the imagenet example's
torchvision classifier with SGD momentum and validation) written once, with the
step as a parameter: ``eager_step`` is the original ``zero_grad / loss.backward / step``;
``compiled_step`` is ``trainer.step``. Both run on the same synthetic data (DataLoader batches
of 16 with a short last batch, several epochs, evaluation between epochs) and must print the
same losses and end with the same weights. Dropout and the VAE's noise are off for the exact
comparison (the draws differ); a run with them on must train.

Tolerances: float32 sums in another order over R=2 replicas x GA=2 micro-batches: losses rtol
1e-5, weights atol 1e-5 (Adadelta and Adam use eps=1e-4 here so that rounding near zero
gradients is not amplified to a step).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from optim_checks import per_replica_eager_step
from torch.utils.data import DataLoader, TensorDataset

import torch_popxl as popxl

R, GA = 2, 2


def _loader(x, y, batch=16):
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def _train(model, opt, loader, step, epochs, on_epoch=None):
    """The examples' loop: per batch a step that returns the loss (printed), per epoch a hook."""
    printed = []
    for epoch in range(epochs):
        model.train()
        for data, target in loader:
            printed.append(float(step(data, target)))
        if on_epoch is not None:
            on_epoch(epoch)
    return printed


def _eager_step(model, opt, loss_fn, clip=None):
    def step(data, target):
        opt.zero_grad()
        loss = loss_fn(model(*data) if isinstance(data, tuple) else model(data), target)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return loss.item()

    return step


def _compiled_step(model, opt, loss_fn, clip=None):
    trainer = popxl.compile(model, loss_fn, opt, replication_factor=R, gradient_accumulation=GA,
                            max_grad_norm=clip)  # fmt: skip
    return trainer.step, trainer


def _same_weights(a, b, atol=1e-5):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=atol)


# ---- pytorch/examples mnist: CNN, Adadelta, StepLR, nll_loss on log_softmax -----------------


class MnistNet(torch.nn.Module):
    def __init__(self, p1=0.25, p2=0.5):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, 1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = torch.nn.Dropout(p1)
        self.dropout2 = torch.nn.Dropout(p2)
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def _mnist_data(n=40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 14, 14, generator=g), torch.randint(0, 10, (n,), generator=g)


def _run_mnist(compiled: bool, dropout: bool):
    torch.manual_seed(0)
    model = MnistNet(*((0.25, 0.5) if dropout else (0.0, 0.0)))
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0, eps=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    x, y = _mnist_data()
    test_x, test_y = _mnist_data(24)
    step = (_compiled_step(model, opt, F.nll_loss)[0] if compiled
            else _eager_step(model, opt, F.nll_loss))  # fmt: skip
    tests = []

    def on_epoch(epoch):
        model.eval()
        with torch.no_grad():  # the example's test(): the model's own forward
            tests.append(float(F.nll_loss(model(test_x), test_y, reduction="sum")) / len(test_y))
        scheduler.step()

    printed = _train(model, opt, _loader(x, y), step, epochs=3, on_epoch=on_epoch)
    return model, printed, tests


def test_mnist_cnn_with_adadelta_and_steplr_prints_eager_losses():
    eager, eager_losses, eager_tests = _run_mnist(False, dropout=False)
    ported, losses, tests = _run_mnist(True, dropout=False)
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    np.testing.assert_allclose(tests, eager_tests, rtol=1e-5)
    _same_weights(ported, eager)
    assert len(losses) == 9  # 3 epochs of 16, 16 and a short batch of 8


def test_mnist_cnn_with_dropout_trains_like_eager():
    # the draws differ, so the losses do not match one by one; each epoch's mean does, loosely
    # (random labels: the training loss falls as the model memorises them)
    _, eager_losses, _ = _run_mnist(False, dropout=True)
    _, losses, tests = _run_mnist(True, dropout=True)
    assert all(math.isfinite(v) for v in losses + tests)
    epochs = np.array(losses).reshape(3, 3).mean(1)
    np.testing.assert_allclose(epochs, np.array(eager_losses).reshape(3, 3).mean(1), rtol=0.1)


# ---- pytorch/examples vae: summed BCE + KL divergence, Adam -----------------------------------


class VAE(torch.nn.Module):
    def __init__(self, noise=True):
        super().__init__()
        self.noise = noise
        self.fc1, self.fc21, self.fc22 = (torch.nn.Linear(64, 32), torch.nn.Linear(32, 8),
                                          torch.nn.Linear(32, 8))  # fmt: skip
        self.fc3, self.fc4 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 64)

    def forward(self, x):
        h = F.relu(self.fc1(x.view(-1, 64)))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu
        if self.training and self.noise:
            z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def vae_loss(outputs, x):
    recon, mu, logvar = outputs
    bce = F.binary_cross_entropy(recon, x.view(-1, 64), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def _run_vae(compiled: bool, noise: bool):
    torch.manual_seed(0)
    model = VAE(noise)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(40, 1, 8, 8, generator=g)
    step = (_compiled_step(model, opt, vae_loss)[0] if compiled
            else _eager_step(model, opt, vae_loss))  # fmt: skip
    # the example prints loss / len(data): the summed loss is per batch, not a mean
    losses = _train(model, opt, _loader(x, x), step, epochs=2)
    return model, losses


def test_vae_with_a_summed_loss_prints_eager_losses():
    eager, eager_losses = _run_vae(False, noise=False)
    ported, losses = _run_vae(True, noise=False)
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    _same_weights(ported, eager)


def test_vae_with_noise_trains():
    _, losses = _run_vae(True, noise=True)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


# ---- pytorch/examples word_language_model: Transformer, causal mask, clipping, annealing ------


class TransformerLM(torch.nn.Module):
    def __init__(self, ntoken=50, d=16, heads=2, layers=2, dropout=0.0):
        super().__init__()
        self.encoder = torch.nn.Embedding(ntoken, d)
        layer = torch.nn.TransformerEncoderLayer(d, heads, 32, dropout, batch_first=True)
        self.transformer = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.decoder = torch.nn.Linear(d, ntoken)
        self.d = d

    def forward(self, src):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(src.shape[1])
        x = self.encoder(src) * math.sqrt(self.d)
        return F.log_softmax(self.decoder(self.transformer(x, mask=mask)), dim=-1)


def lm_loss(output, target):
    return F.nll_loss(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _run_lm(compiled: bool):
    torch.manual_seed(0)
    model = TransformerLM()
    lr = 5.0
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 50, (40, 9), generator=g)
    val = torch.randint(0, 50, (8, 9), generator=g)
    step = (_compiled_step(model, opt, lm_loss, clip=0.25)[0] if compiled
            else _eager_step(model, opt, lm_loss, clip=0.25))  # fmt: skip
    vals, best = [], [None]

    def on_epoch(epoch):
        model.eval()
        with torch.no_grad():
            vals.append(float(lm_loss(model(val[:, :-1]), val[:, 1:])))
        # the example anneals the learning rate when validation does not improve; here every
        # other epoch, so that the annealing certainly happens in a short run
        if best[0] is None or vals[-1] < best[0]:
            best[0] = vals[-1]
        if epoch % 2 == 0:
            for group in opt.param_groups:
                group["lr"] /= 4.0

    losses = _train(model, opt, _loader(tokens[:, :-1], tokens[:, 1:]), step, 3, on_epoch)
    return model, losses, vals, opt.param_groups[0]["lr"]


def test_transformer_lm_with_causal_mask_clipping_and_annealing_prints_eager_losses():
    eager, eager_losses, eager_vals, eager_lr = _run_lm(False)
    ported, losses, vals, lr = _run_lm(True)
    assert lr == eager_lr == 5.0 / 16
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    np.testing.assert_allclose(vals, eager_vals, rtol=1e-5)
    _same_weights(ported, eager)


@pytest.mark.parametrize("run", [_run_mnist, _run_vae, _run_lm])
def test_the_ported_scripts_leave_nothing_on_the_slow_path(run, monkeypatch):
    explained = []
    compile_ = popxl.compile

    def recording(*args, **kwargs):
        trainer = compile_(*args, **kwargs)
        explained.append(trainer)
        return trainer

    monkeypatch.setattr(popxl, "compile", recording)
    kwargs = {"compiled": True}
    if run is _run_mnist:
        kwargs["dropout"] = True
    elif run is _run_vae:
        kwargs["noise"] = True
    run(**kwargs)
    assert [t.explain() for t in explained] == [[]]  # one trainer, all on the fast path


# ---- a torchvision classifier (pytorch/examples imagenet's loop): SGD momentum + validation ---


def _run_classifier(compiled: bool):
    import torchvision

    torch.manual_seed(0)
    # SqueezeNet: a torchvision model without batch norm (whose per-replica statistics are the
    # one documented difference from eager); its dropout off for the exact comparison
    model = torchvision.models.squeezenet1_1(num_classes=10, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(24, 3, 32, 32, generator=g), torch.randint(0, 10, (24,), generator=g)
    val_x, val_y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    step = (_compiled_step(model, opt, loss_fn)[0] if compiled
            else _eager_step(model, opt, loss_fn))  # fmt: skip
    accuracy = []

    def validate(epoch):
        model.eval()
        with torch.no_grad():
            accuracy.append(float((model(val_x).argmax(1) == val_y).float().mean()))

    losses = _train(model, opt, _loader(x, y), step, epochs=2, on_epoch=validate)
    return model, losses, accuracy


def test_torchvision_classifier_with_sgd_momentum_and_validation_prints_eager_losses():
    pytest.importorskip("torchvision")
    eager, eager_losses, eager_acc = _run_classifier(False)
    ported, losses, acc = _run_classifier(True)
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    assert acc == eager_acc
    _same_weights(ported, eager)


# ---- a batch-norm torchvision classifier (ResNet-18 at 32x32): per-replica statistics ---------


def _run_resnet(compiled: bool):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator().manual_seed(4)
    # batches of 32 and a short one of 16: micro-batches of 8 and 4 rows
    x, y = torch.randn(48, 3, 32, 32, generator=g), torch.randint(0, 10, (48,), generator=g)
    val_x, val_y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    step = (_compiled_step(model, opt, loss_fn)[0] if compiled
            else per_replica_eager_step(model, opt, loss_fn, R, GA))  # fmt: skip
    vals, after_first_epoch = [], []

    def validate(epoch):  # the example's validate(): eval mode, the running statistics
        model.eval()
        with torch.no_grad():
            out = model(val_x)
            vals.append(
                (float(loss_fn(out, val_y)), float((out.argmax(1) == val_y).float().mean()))
            )
        if epoch == 0:
            after_first_epoch.extend(t.detach().clone() for t in model.state_dict().values())

    losses = _train(model, opt, _loader(x, y, batch=32), step, epochs=2, on_epoch=validate)
    return model, losses, vals, after_first_epoch


def test_resnet18_with_batch_norm_sgd_momentum_and_validation_prints_eager_losses():
    """Eager on each replica's micro-batches is the reference (batch statistics per replica,
    as DDP keeps them). The first epoch (a full batch, a short one, validation with replica 0's
    running statistics) is equal to summation order; the second tracks it: ResNet-18 on
    random labels with micro-batches of 4-8 rows is chaotic (in eager alone, weights moved by
    1e-7 of themselves change a gradient by 20 % within four steps)."""
    torchvision = pytest.importorskip("torchvision")
    eager, eager_losses, eager_vals, eager_first = _run_resnet(False)
    ported, losses, vals, first = _run_resnet(True)
    np.testing.assert_allclose(losses[:2], eager_losses[:2], rtol=1e-5)
    np.testing.assert_allclose(vals[0], eager_vals[0], rtol=1e-5)
    names = list(ported.state_dict())  # parameters and buffers (running statistics)
    for n, a, b in zip(names, first, eager_first, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    np.testing.assert_allclose(losses[2:], eager_losses[2:], rtol=1e-2)
    np.testing.assert_allclose(vals[1][0], eager_vals[1][0], rtol=5e-2)
    assert int(ported.bn1.num_batches_tracked) == 2 * 2 * GA  # 2 epochs of 2 steps, replica 0
    # the eager loop on the global batch normalises over all 32 rows: not these losses
    torch.manual_seed(0)
    fresh = torchvision.models.resnet18(num_classes=10)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    with torch.no_grad():
        assert abs(float(torch.nn.CrossEntropyLoss()(fresh(x), y)) - losses[0]) > 1e-3
