"""Inference programs on replicas return eager's value for outputs the forward reduces over
the batch (Note [batch-reduced outputs of an inference program] in
torch_popxl/compile_infer.py): a validation loss from given labels, a model's ``(logits,
loss)``.

Each test runs the same batch through eager torch (``torch.no_grad()``, eval mode) and
through ``popxl.compile(model, replication_factor=R)``, at R = 1, 2, 3 and with batches that
do not split over the replicas (7 and 5 rows: padded by whole replicas). Tolerance rtol 1e-5 /
atol 1e-6: float32 sums per replica, added in float64 on the host.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_popxl as popxl

RTOL, ATOL = 1e-5, 1e-6
SIZES = [(1, 8), (2, 8), (3, 9), (2, 7), (3, 7), (3, 5)]  # (R, rows)


def _close(got, want, what):
    torch.testing.assert_close(torch.as_tensor(got), want.detach(), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip


class _Regressor(torch.nn.Module):
    """Returns ``(outputs, loss)`` for the reduction asked for."""

    def __init__(self, loss: str):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 3))  # fmt: skip
        self.loss = loss

    def forward(self, x, y):
        out = self.net(x)
        if self.loss == "mse":
            return out, F.mse_loss(out, y)
        if self.loss == "sum":
            return out, F.l1_loss(out, y, reduction="sum")
        if self.loss == "mix":  # a sum, a mean and a number: 0.5 * mse + sum / 10 + 1
            return out, 0.5 * F.mse_loss(out, y) + (out - y).abs().sum() / 10 + 1.0
        if self.loss == "per_row":  # a sum divided by the batch's size: a mean over rows
            return out, (out - y).pow(2).sum() / x.shape[0]
        if self.loss == "sqrt":  # not a combination of sums and means
            return out, F.mse_loss(out, y).sqrt()
        assert self.loss == "max"
        return out, (out - y).abs().max()


def _data(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


@pytest.mark.parametrize("R, rows", SIZES)
@pytest.mark.parametrize("loss", ["mse", "sum", "mix", "per_row"])
def test_a_models_loss_on_replicas_is_eagers(loss, R, rows):
    """``(outputs, loss)`` with the loss a mean, a sum, a combination of both with a number,
    or a sum over the batch's size: the outputs and the loss equal eager's on the whole batch
    (was refused with replicas)."""
    torch.manual_seed(0)
    model = _Regressor(loss).eval()
    program = popxl.compile(model, replication_factor=R)
    for seed in range(2):  # (the second batch reuses the program)
        x, y = _data(rows, seed)
        out, got = program((x, y))
        with torch.no_grad():
            want_out, want = model(x, y)
        _close(out, want_out, "outputs")
        _close(got, want, "loss")


class _TokenLoss(torch.nn.Module):
    """A token-level cross-entropy over the labels that are not -100 (a counted mean)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 20)

    def forward(self, ids, labels):
        logits = self.head(self.embed(ids))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _token_batch(rows: int, seed: int = 0, ignored: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (rows, 6), generator=g)
    labels = torch.randint(0, 20, (rows, 6), generator=g)
    labels[torch.rand(rows, 6, generator=g) < ignored] = -100  # rows count different tokens
    labels[0] = -100  # one row counts nothing
    return ids, labels


@pytest.mark.parametrize("R, rows", SIZES)
def test_a_token_mean_over_labels_not_ignored_on_replicas_is_eagers(R, rows):
    """Every replica counts a different number of tokens; the mean is over the tokens of
    the whole batch."""
    torch.manual_seed(0)
    model = _TokenLoss().eval()
    ids, labels = _token_batch(rows)
    got = popxl.compile(model, replication_factor=R)({"ids": ids, "labels": labels})
    with torch.no_grad():
        want = model(ids, labels)
    _close(got["logits"], want["logits"], "logits")
    _close(got["loss"], want["loss"], "loss")


@pytest.mark.parametrize("loss", ["sqrt", "max"])
def test_a_reduction_that_does_not_add_up_is_refused_by_name(loss):
    model = _Regressor(loss).eval()
    with pytest.raises(ValueError, match=r"output\[1\] has shape \[\].*cannot be put together"):
        popxl.compile(model, replication_factor=2)(_data(8))


class _Contrastive(torch.nn.Module):
    """In-batch negatives: every sample against every other (terms that look like a counted
    mean, whose replicas' parts do not add up)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(3, 8)

    def forward(self, x, y):
        logits = self.a(x) @ self.b(y).T
        return F.cross_entropy(logits, torch.arange(x.shape[0]))


def test_a_loss_that_pairs_the_samples_of_the_batch_is_refused_by_name():
    model = _Contrastive().eval()
    with pytest.raises(ValueError, match=r"output is reduced over the batch.*pairs the samples"):
        popxl.compile(model, replication_factor=2)(_data(8))
    x, y = _data(8)  # one replica: the whole batch, eager's value
    with torch.no_grad():
        _close(popxl.compile(model)((x, y)), model(x, y), "loss")


transformers = pytest.importorskip("transformers")


def _gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                     n_head=2)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("R, rows", SIZES)
def test_gpt2_validation_loss_with_ignored_labels_on_replicas_is_eagers(R, rows):
    """GPT2LMHeadModel's loss from ``labels`` (shifted inside the model, -100 ignored): a
    token mean over the batch's counted labels."""
    model = _gpt2()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (rows, 10), generator=g)
    labels = ids.clone()
    labels[:, 7:] = -100  # padding at the end of every sequence
    labels[-1, 2:] = -100  # a short last sequence
    program = popxl.compile(model, replication_factor=R)
    got = program({"input_ids": ids, "labels": labels})
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels)
    _close(got.loss, want.loss, "loss")
    _close(got.logits, want.logits, "logits")


@pytest.mark.parametrize("R, rows", SIZES)
def test_bert_sequence_classification_validation_loss_on_replicas_is_eagers(R, rows):
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    g = torch.Generator().manual_seed(2)
    inputs = {"input_ids": torch.randint(0, 64, (rows, 10), generator=g),
              "labels": torch.randint(0, 3, (rows,), generator=g)}  # fmt: skip
    got = popxl.compile(model, replication_factor=R)(inputs)
    with torch.no_grad():
        want = model(**inputs)
    _close(got.loss, want.loss, "loss")
    _close(got.logits, want.logits, "logits")


def test_a_short_batch_is_padded_by_whole_replicas_only_for_reduced_outputs():
    """7 rows on 2 replicas: per-sample outputs alone run as two shares of 4 (one padded
    row); with a batch-reduced loss as 7 rows on one replica and a replica of padding."""
    torch.manual_seed(0)
    model = _Regressor("mse").eval()
    x, y = _data(7)
    rows_only = popxl.compile(model.net, replication_factor=2)
    _close(rows_only(x), model.net(x), "outputs")
    assert rows_only.programs == ((False, "(8, 6) float32"),)
    with_loss = popxl.compile(model, replication_factor=2)
    _close(with_loss((x, y))[1], model(x, y)[1], "loss")
    assert with_loss.programs == ((False, "(14, 6) float32, (14, 3) float32"),)
