"""Packed sequences (``pack_padded_sequence`` into an RNN) in captured code equal eager torch.

Note [packed sequences in a captured graph] (torch_popxl/capture_packed.py): a packed batch
is kept as all padded steps with a mask of the steps that run. The rules are checked on real
tensors against torch's packed kernels, then trained through popxl.compile against the eager
loop (losses of every step and the weights at the end) and run by an inference program.

Tolerance: the unrolled recurrence rounds as torch's composite ops do, torch's packed
kernels fuse the gates: 1e-6 on one forward; rtol 1e-4 / atol 1e-5 after steps of training.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_popxl as popxl
from torch_popxl.capture_packed import PackedRNN
from torch_popxl.errors import DataDependentError

RTOL, ATOL = 1e-4, 1e-5
VOCAB, CLASSES = 30, 4


def _packed_run(rnn, x, lengths, batch_first, enforce_sorted, hx, total_length):
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=batch_first,
                                               enforce_sorted=enforce_sorted)  # fmt: skip
    out, hidden = rnn(packed, hx)
    padded, lens = nn.utils.rnn.pad_packed_sequence(out, batch_first=batch_first,
                                                    padding_value=-1.0, total_length=total_length)  # fmt: skip
    return padded, hidden, lens


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_the_masked_recurrence_equals_torchs_packed_kernels(cls, bidirectional, batch_first):
    torch.manual_seed(0)
    rnn = cls(4, 5, num_layers=2, batch_first=batch_first, bidirectional=bidirectional)
    for enforce_sorted, lengths, with_hx, total in [
        (False, [6, 2, 4, 1], False, None),
        (True, [6, 4, 3, 3], True, 8),
    ]:
        x = torch.randn(4, 6, 4) if batch_first else torch.randn(6, 4, 4)
        hx = None
        if with_hx:
            h0 = torch.randn(2 * (2 if bidirectional else 1), 4, 5)
            hx = (h0, torch.randn_like(h0)) if cls is nn.LSTM else h0
        args = (rnn, x, torch.tensor(lengths), batch_first, enforce_sorted, hx, total)
        want = _packed_run(*args)
        with PackedRNN():
            got = _packed_run(*args)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


class Classifier(nn.Module):
    """Embeddings, a packed bidirectional 2-layer RNN, the last layer's final states."""

    def __init__(self, cls=nn.LSTM):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.rnn = cls(8, 12, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(24, CLASSES)

    def forward(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(tokens), lengths.cpu(),
                                                   batch_first=True, enforce_sorted=False)  # fmt: skip
        _, hidden = self.rnn(packed)
        h = hidden[0] if isinstance(hidden, tuple) else hidden
        return self.head(torch.cat([h[-2], h[-1]], 1))


class Tagger(nn.Module):
    """A tag per token from the padded outputs of a packed GRU."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.rnn = nn.GRU(8, 12, batch_first=True)
        self.head = nn.Linear(12, CLASSES)

    def forward(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(tokens), lengths,
                                                   batch_first=True, enforce_sorted=False)  # fmt: skip
        out, _ = self.rnn(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(padded)


def _batches(n=3, b=8, steps=7, per_token=False):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        lengths = torch.randint(1, steps + 1, (b,), generator=g)
        lengths[0] = steps  # padded to the batch's longest sequence, as collate functions pad
        tokens = torch.randint(1, VOCAB, (b, steps), generator=g)
        tokens[torch.arange(steps) >= lengths.unsqueeze(1)] = 0
        if per_token:
            y = torch.randint(0, CLASSES, (b, steps), generator=g)
            y[torch.arange(steps) >= lengths.unsqueeze(1)] = -100
        else:
            y = torch.randint(0, CLASSES, (b,), generator=g)
        out.append(((tokens, lengths), y))
    return out


def token_ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, CLASSES), y.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize(
    ("make", "loss_fn", "per_token"),
    [(lambda: Classifier(nn.LSTM), F.cross_entropy, False),
     (lambda: Classifier(nn.GRU), F.cross_entropy, False),
     (Tagger, token_ce, True)],
)  # fmt: skip
def test_a_packed_rnn_trains_as_eager_on_replicas(make, loss_fn, per_token):
    model = make()
    eager = copy.deepcopy(model)
    opt = torch.optim.Adam(eager.parameters(), lr=1e-2)
    trainer = popxl.compile(model, loss_fn, torch.optim.Adam(model.parameters(), lr=1e-2),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    for inputs, y in _batches(per_token=per_token):
        opt.zero_grad()
        want = loss_fn(eager(*inputs), y)
        want.backward()
        opt.step()
        assert trainer.step(inputs, y) == pytest.approx(want.item(), rel=RTOL)
    trainer.sync_weights()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)


def test_an_inference_program_runs_a_packed_rnn_as_eager():
    model = Classifier().eval()
    infer = popxl.compile(model, replication_factor=2)
    (tokens, lengths), _ = _batches(1)[0]
    with torch.no_grad():
        want = model(tokens, lengths)
    torch.testing.assert_close(infer((tokens, lengths)), want, rtol=1e-5, atol=1e-6)


def test_an_lstm_with_proj_size_over_packed_sequences_is_refused_naming_why():
    class Projected(Classifier):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(8, 12, batch_first=True, bidirectional=True, proj_size=6,
                               num_layers=2)  # fmt: skip
            self.head = nn.Linear(12, CLASSES)

    model = Projected()
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    inputs, y = _batches(1)[0]
    with pytest.raises(DataDependentError, match="proj_size"):
        trainer.step(inputs, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
