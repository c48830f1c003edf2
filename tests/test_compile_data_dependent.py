"""Model code that reads tensor values in Python, through popxl.compile (Note [guarded
specialisation] in torch_popxl/compile_guards.py): an assert on the inputs, torch's own
argument check (``F.gaussian_nll_loss`` with a predicted variance), a branch whose value
changes between batches, and Hugging Face masked LMs that do so (XLM and FlauBERT assert on
``lengths.max().item()``, I-BERT asserts on NaNs and branches on its buffers, Longformer
chooses global attention by ``any().item()``), trained beside eager torch.

A batch that breaks an assert raises what eager raises, and leaves the model, its buffers and
the optimizer state as they were; the trainer then goes on training as eager.

Tolerance: rtol 1e-5 / atol 1e-6 for the small models after AdamW steps (float32 sums in
another order, per replica and micro-batch); 1e-4 for the Hugging Face models, as their
sweep (benchmarks/sweep_hf_tasks.py) counts them.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from optim_checks import train_both

import torch_popxl as popxl
from torch_popxl.errors import DataDependentError

RTOL, ATOL = 1e-5, 1e-6


class _Both:
    """A model trained eagerly and, as a copy, through popxl.compile (AdamW for both), step
    by step on the same batches."""

    def __init__(self, model, loss_fn, R: int = 2, GA: int = 2, lr: float = 1e-2):
        self.eager = copy.deepcopy(model)
        self.model = model
        self.loss_fn = loss_fn
        self.opt_e = torch.optim.AdamW(self.eager.parameters(), lr=lr)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.trainer = popxl.compile(model, loss_fn, self.opt, replication_factor=R,
                                     gradient_accumulation=GA)  # fmt: skip

    def step(self, x, y) -> None:
        self.opt_e.zero_grad()
        want = self.loss_fn(self.eager(x), y)
        want.backward()
        self.opt_e.step()
        got = self.trainer.step(x, y)
        torch.testing.assert_close(torch.tensor(float(got)), want.detach(), rtol=RTOL, atol=ATOL)
        self.trainer.sync_weights()
        for (name, p), q in zip(self.model.named_parameters(), self.eager.parameters(),
                                strict=True):  # fmt: skip
            torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)

    def snapshot(self) -> tuple[dict, dict]:
        return (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()))

    def unchanged_since(self, snapshot: tuple[dict, dict]) -> None:
        model_state, opt_state = snapshot
        for k, v in self.model.state_dict().items():
            assert torch.equal(v, model_state[k]), k
        now = self.opt.state_dict()
        assert now["param_groups"] == opt_state["param_groups"]
        for p, entry in opt_state["state"].items():
            for k, v in entry.items():
                assert torch.equal(torch.as_tensor(now["state"][p][k]), torch.as_tensor(v)), k


class NonNegative(torch.nn.Module):
    """Asserts on its input, as model code checks its arguments."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        assert (x >= 0).all(), "the inputs must be non-negative"
        return self.fc2(torch.relu(self.fc1(x)))


def _batches(n: int, seed: int = 0, rows: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(n)]  # fmt: skip


def test_an_assert_on_the_inputs_trains_as_eager():
    torch.manual_seed(0)
    both = _Both(NonNegative(), F.cross_entropy)
    for x, y in _batches(3):
        both.step(x, y)


def test_a_batch_that_breaks_the_assert_raises_as_eager_and_changes_nothing():
    """One negative value in one micro-batch (row 5: micro-batch 1 of replica 0) and a batch
    that is negative everywhere (the program for that value is built, and the forward's
    Python raises) both raise eager's AssertionError; nothing changes, and training goes on
    as eager."""
    torch.manual_seed(0)
    both = _Both(NonNegative(), F.cross_entropy)
    for x, y in _batches(2):
        both.step(x, y)
    one = x.clone()
    one[5, 2] = -0.5
    for bad in (one, -x - 0.1):
        with pytest.raises(AssertionError, match="the inputs must be non-negative"):
            both.eager(bad)
        before = both.snapshot()
        with pytest.raises(AssertionError, match="the inputs must be non-negative"):
            both.trainer.step(bad, y)
        both.unchanged_since(before)
    for x, y in _batches(2, seed=1):
        both.step(x, y)


class MeanAndVariance(torch.nn.Module):
    """A regression head that predicts a mean, with a variance scaled from a column of the
    data: ``F.gaussian_nll_loss`` checks ``torch.any(var < 0)`` on it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.mean = torch.nn.Linear(8, 1)
        self.log_scale = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        h = torch.tanh(self.fc(x[:, :4]))
        return self.mean(h).squeeze(-1), x[:, 4] * self.log_scale.exp()


def _gaussian_nll(out, y):
    mean, var = out
    return F.gaussian_nll_loss(mean, y, var)


def test_gaussian_nll_loss_with_a_predicted_variance_trains_as_eager_and_checks_it():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        x = torch.randn(8, 5, generator=g)
        x[:, 4] = torch.rand(8, generator=g) + 0.1
        batches.append((x, torch.randn(8, generator=g)))
    both = _Both(MeanAndVariance(), _gaussian_nll)
    for x, y in batches:
        both.step(x, y)
    bad = x.clone()
    bad[3, 4] = -1.0  # a negative variance on one row
    with pytest.raises(ValueError, match="var has negative entry"):
        _gaussian_nll(both.eager(bad), y)
    before = both.snapshot()
    with pytest.raises(ValueError, match="var has negative entry"):
        both.trainer.step(bad, y)
    both.unchanged_since(before)
    both.step(*batches[0])


class Gate(torch.nn.Module):
    """Branches on the batch's mean: another activation for negative batches."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.fc1(x)
        h = torch.relu(h) if x.mean() > 0 else torch.tanh(h)
        return self.fc2(h)


def test_a_branch_whose_value_changes_between_batches_trains_as_eager():
    """Positive, negative, positive batches: a program per value, the first one used again
    (two builds for three steps)."""
    torch.manual_seed(0)
    both = _Both(Gate(), F.cross_entropy)
    builds = []
    build = both.trainer._build
    both.trainer._build = lambda *a: builds.append(1) or build(*a)  # type: ignore[method-assign]
    batches = _batches(3)
    for sign, (x, y) in zip((1, -1, 1), batches, strict=True):
        both.step(sign * x, y)
    assert len(builds) == 2
    assert len(both.trainer.programs) == 1  # one input signature


def test_a_value_that_differs_between_micro_batches_is_refused_naming_it():
    """Eager reads ``x.mean() > 0`` once on the global batch; a program runs every
    micro-batch alike, so values that differ between them are refused, with both values and
    where they were, before anything changes."""
    torch.manual_seed(0)
    both = _Both(Gate(), F.cross_entropy)
    (x, y), (x2, y2) = _batches(2)
    both.step(x, y)
    mixed = x2.clone()
    mixed[4:] *= -1  # rows 4-7: micro-batch 1 of both replicas
    both.eager(mixed)  # eager runs it (one value for the global batch)
    before = both.snapshot()
    with pytest.raises(DataDependentError) as info:
        both.trainer.step(mixed, y2)
    message = str(info.value)
    assert "x.mean() > 0" in message and "test_compile_data_dependent.py" in message
    assert "True on micro-batch 0 of replica 0 and False on micro-batch 1 of replica 0" in message
    assert "Nothing was changed" in message
    both.unchanged_since(before)
    both.step(x2, y2)


def test_an_inference_program_reads_values_as_eager():
    torch.manual_seed(0)
    model = Gate().eval()
    infer = popxl.compile(model, replication_factor=2)
    x = torch.rand(6, 6)
    for batch in (x, -x, x):
        torch.testing.assert_close(infer(batch), model(batch), rtol=RTOL, atol=ATOL)
    checked = NonNegative().eval()
    infer = popxl.compile(checked, replication_factor=2)
    torch.testing.assert_close(infer(x), checked(x), rtol=RTOL, atol=ATOL)
    bad = x.clone()
    bad[4, 0] = -1.0  # replica 1's rows
    with pytest.raises(AssertionError, match="the inputs must be non-negative"):
        infer(bad)
    torch.testing.assert_close(infer(x), checked(x), rtol=RTOL, atol=ATOL)


# ---- Hugging Face masked LMs (their default configs made small) ----------------------------

transformers = pytest.importorskip("transformers")
VOCAB = 128


def _masked_lm(name: str):
    T = transformers
    xlm = dict(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=2, max_position_embeddings=64,
               dropout=0.0, attention_dropout=0.0)  # fmt: skip
    bert = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)  # fmt: skip
    config = {
        "xlm": lambda: T.XLMConfig(**xlm),
        "flaubert": lambda: T.FlaubertConfig(**xlm, layerdrop=0.0),
        "ibert": lambda: T.IBertConfig(**bert),
        "longformer": lambda: T.LongformerConfig(**bert, attention_window=4),
    }[name]()
    torch.manual_seed(0)
    return T.AutoModelForMaskedLM.from_config(config).train()


def _lm_batches(n: int, lengths: bool = False):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (8, 12), generator=g)
        labels = ids.clone()
        labels[:, ::3] = -100  # a third of the positions ignored
        batch = {"input_ids": ids, "labels": labels}
        if lengths:
            batch["lengths"] = torch.full((8,), 12)
        out.append((batch, None))
    return out


@pytest.mark.parametrize("name", ["xlm", "flaubert", "ibert", "longformer"])
def test_hugging_face_masked_lms_that_read_values_train_as_eager(name):
    train_both(_masked_lm(name), None, _lm_batches(2), 2, 2, optimizer=torch.optim.AdamW,
               lr=1e-3, rtol=1e-4, atol=1e-4)  # fmt: skip


def test_xlm_lengths_beyond_the_sequence_raise_as_eager():
    """XLM asserts ``lengths.max().item() <= slen``: given lengths, one row too long raises
    eager's AssertionError, and nothing changes."""
    model = _masked_lm("xlm")
    eager = copy.deepcopy(model)
    batches = _lm_batches(2, lengths=True)
    trainer = train_both(model, None, batches, 2, 2, optimizer=torch.optim.AdamW, lr=1e-3,
                         rtol=1e-4, atol=1e-4)  # fmt: skip
    bad = dict(batches[0][0])
    bad["lengths"] = bad["lengths"].clone()
    bad["lengths"][6] = 13
    with pytest.raises(AssertionError):
        eager(**bad)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(AssertionError):
        trainer.step(bad)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class LayerDrop(torch.nn.Module):
    """Skips its hidden layer on a random draw, as LayerDrop does."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x):
        if torch.rand(()) < 0.5:
            x = torch.relu(self.fc1(x))
        return self.fc2(x)


def test_a_decision_drawn_at_random_in_the_forward_is_refused_saying_so():
    torch.manual_seed(0)
    model = LayerDrop()
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    x, y = _batches(1)[0]
    with pytest.raises(DataDependentError, match="random numbers the forward draws"):
        trainer.step(x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class Zeroed(torch.nn.Module):
    """Zeroes the outputs of the rows whose first feature is negative, by their indices."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x):
        rows = (x[:, 0] < 0).nonzero(as_tuple=True)
        return self.fc(x).index_put(rows, torch.zeros(()))


def test_nonzero_of_a_count_that_stays_the_same_trains_as_eager():
    """``nonzero``'s result shape is its count: read, checked at every step, and recorded as
    ``nonzero_static`` of that size; a count that differs between micro-batches is refused
    naming the count."""
    torch.manual_seed(0)
    both = _Both(Zeroed(), F.cross_entropy)
    batches = _batches(3)
    for x, y in batches:
        x[::2, 0] *= -1  # one negative row in every micro-batch of 2 rows
        both.step(x, y)
    x, y = batches[0]
    x[4:, 0] = -x[4:, 0].abs()  # two in micro-batch 1 of each replica
    before = both.snapshot()
    with pytest.raises(DataDependentError, match="1 on micro-batch 0 of replica 0 and 2 on"):
        both.trainer.step(x, y)
    both.unchanged_since(before)


def test_a_forward_that_reads_no_value_copies_nothing_for_guards(monkeypatch):
    """The micro-batches' values a read is evaluated on (copies of every parameter and buffer
    per micro-batch) are made at the first read only: a program whose forward reads nothing
    builds without them (at R=4, GA=8 they were 32 copies of the model)."""
    made = []
    trainer_class = importlib.import_module("torch_popxl.compile").Trainer
    real = trainer_class._forward_values

    def counted(self, *args, **kwargs):
        made.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(trainer_class, "_forward_values", counted)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    trainer = popxl.compile(plain, F.cross_entropy, torch.optim.SGD(plain.parameters(), 0.1),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    x, y = _batches(1)[0]
    trainer.step(x.numpy(), y.numpy())
    assert made == []
    guarded = NonNegative()
    trainer = popxl.compile(guarded, F.cross_entropy, torch.optim.SGD(guarded.parameters(), 0.1),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    trainer.step(x.numpy(), y.numpy())
    assert made  # the assert's read evaluated the micro-batches
