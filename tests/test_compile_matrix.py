"""The loop features of popxl.compile at every corner of replication, accumulation, sharding
and placement, each step compared with eager torch on the global batch.

Two scenarios cover the features (issue 30's "Done when"):

* ``classifier``: a summed cross-entropy (``reduction="sum"``: the global batch's sum, not a
  mean of micro-batch sums), RMSprop with momentum (a captured torch optimizer), a frozen
  first layer, ``p.grad``, ``return_outputs=True`` and a DataLoader-style short last batch;
* ``tagger``: a model returning its own token mean with ``ignore_index`` (``loss_fn=None``),
  micro-batches counting different numbers of tokens, Adadelta, ``p.grad`` and a short last
  batch.

Each checks the loss of every step, the outputs, the weights, ``p.grad`` and the optimizer
state against eager torch (``zero_grad; loss.backward(); step`` on the whole batch).

Layouts: the full product R {1,2,4} x GA {1,2,4} x RTS {off,on} x {on_chip, remote} is 30
layouts (RTS needs replicas); ``LAYOUTS`` is a pairwise-covering subset of 9: every (R, GA)
pair, and every value of each factor with every value of each other factor.

Tolerances: float32 sums in another order (replicas, micro-batches): losses rtol 1e-5,
tensors rtol 1e-4 / atol 1e-5 (state: atol scaled by its magnitude, as RMSprop's and
Adadelta's buffers are not scaled by lr); eps 1e-3 keeps rounding near zero gradients from
being amplified to a full step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_popxl as popxl

# (R, GA, rts, optimizer_state): a pairwise-covering subset (see the module docstring)
LAYOUTS = [
    (1, 1, False, "on_chip"), (1, 2, False, "remote"), (1, 4, False, "on_chip"),
    (2, 1, True, "remote"), (2, 2, False, "remote"), (2, 4, True, "on_chip"),
    (4, 1, False, "on_chip"), (4, 2, True, "on_chip"), (4, 4, True, "remote"),
]  # fmt: skip
IDS = [f"R{r}-GA{ga}-{'rts' if rts else 'full'}-{st}" for r, ga, rts, st in LAYOUTS]
SIZES = (32, 32, 16)  # two full batches and a short last one


def _compile(model, loss_fn, opt, layout, **kw):
    R, GA, rts, state = layout
    return popxl.compile(model, loss_fn, opt, replication_factor=R, gradient_accumulation=GA,
                         rts_threshold=64 if rts else None, optimizer_state=state, **kw)  # fmt: skip


def _check(trained, opt, ref, ref_opt):
    kw = {"rtol": 1e-4, "atol": 1e-5}
    for (n, p), q in zip(trained.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), **kw, msg=n)
        if q.grad is None:  # frozen: no gradient, no state
            assert p.grad is None and p not in opt.state, n
            continue
        torch.testing.assert_close(p.grad, q.grad, **kw, msg=f"{n}.grad")
        assert sorted(opt.state[p]) == sorted(ref_opt.state[q]), n
        for k, v in ref_opt.state[q].items():
            atol = kw["atol"] * max(1.0, v.abs().max().item())
            torch.testing.assert_close(opt.state[p][k], v, rtol=kw["rtol"], atol=atol,
                                       msg=f"{n}.{k}")  # fmt: skip


# ---- classifier: summed loss, RMSprop, frozen layer, p.grad, outputs, short last batch --------


def _classifier():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8),
                                torch.nn.GELU(), torch.nn.Linear(8, 4))  # fmt: skip
    model[0].requires_grad_(False)  # fine-tuning: the first layer is frozen
    opt = torch.optim.RMSprop([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                              momentum=0.5, eps=1e-3)  # fmt: skip
    return model, opt


def _classifier_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g))
            for n in SIZES]  # fmt: skip


def summed_ce(logits, y):
    return F.cross_entropy(logits, y, reduction="sum")


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_summed_loss_rmsprop_frozen_layer_outputs_and_short_batch_match_eager(layout):
    model, opt = _classifier()
    ref, ref_opt = _classifier()
    trainer = _compile(model, summed_ce, opt, layout, return_outputs=True)
    for x, y in _classifier_data():
        loss, logits = trainer.step(x, y)
        ref_opt.zero_grad()
        ref_logits = ref(x)
        ref_loss = summed_ce(ref_logits, y)
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
        assert logits.shape == (len(x), 4)
        torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-4, atol=1e-5)
    _check(model, opt, ref, ref_opt)
    assert len(trainer.programs) == 2  # the full batch and the short last one
    if layout[2]:  # sharding really happened
        assert any(s.sharded for s in trainer._active.slots)


# ---- tagger: the model's own token mean (ignore_index), Adadelta, loss_fn=None ----------------


class Tagger(torch.nn.Module):
    """Returns its loss as Hugging Face models do: a token mean over the labels that are not
    -100, in an output with ``.loss``."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

        class Output(dict):
            __getattr__ = dict.__getitem__

        return Output(loss=loss, logits=logits)


def _tagger():
    torch.manual_seed(0)
    model = Tagger()
    return model, torch.optim.Adadelta(model.parameters(), lr=1.0, eps=1e-3)


def _tagger_data():
    g = torch.Generator().manual_seed(2)
    out = []
    for n in SIZES:
        ids = torch.randint(0, 11, (n, 6), generator=g)
        labels = torch.randint(0, 11, (n, 6), generator=g)
        # padding of random length: micro-batches count different numbers of tokens
        keep = torch.randint(1, 7, (n,), generator=g)
        labels[torch.arange(6) >= keep[:, None]] = -100
        out.append((ids, labels))
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_model_returning_a_token_mean_with_ignore_index_trains_as_eager(layout):
    model, opt = _tagger()
    ref, ref_opt = _tagger()
    trainer = _compile(model, None, opt, layout)
    for ids, labels in _tagger_data():
        loss = trainer.step({"input_ids": ids, "labels": labels})
        ref_opt.zero_grad()
        ref_loss = ref(ids, labels).loss
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    _check(model, opt, ref, ref_opt)
    # the counted tokens really differ between micro-batches
    R, GA = layout[0], layout[1]
    counts = [int((c != -100).sum()) for c in _tagger_data()[0][1].chunk(R * GA)]
    assert R * GA == 1 or len(set(counts)) > 1
    np.testing.assert_equal(len(trainer.programs), 2)
