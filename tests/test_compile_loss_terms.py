"""Losses that add up several means, each counted over the whole global batch, train as eager.

Hugging Face heads compute two or more counted means in ``forward`` (GPT2DoubleHeadsModel's
token mean plus multiple-choice mean, BertForPreTraining's masked-LM plus next-sentence means,
the question-answering heads' ``(start + end) / 2`` with positions outside the sequence
ignored); multi-task models weight their terms by numbers or by tensors computed from the
parameters. The reference is the eager loop on the whole batch: ``R * GA`` micro-batches must
give its loss, weights, ``p.grad`` and SGD momentum buffers (bit for bit at R = GA = 1, else to
float32 summation order: rtol 1e-5, atol 1e-6 after 3 steps). A term that is no sum of
micro-batch parts (a product of two means over the batch: Mixtral's load-balancing loss) is
refused when the program is built, naming the op, with nothing changed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from optim_checks import assert_same_training

import torch_popxl as popxl
from torch_popxl.compile_loss import LossDecompositionError

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

RTOL = 1e-5
# (R, GA, rts_threshold, optimizer_state): the micro-batch is the batch; replicas and
# accumulation; the same with sharded state off chip
LAYOUTS = [(1, 1, None, "on_chip"), (2, 2, None, "on_chip"), (2, 2, 8, "remote")]
B, S, V = 8, 6, 40  # rows, positions, vocabulary


def _train_both(model, loss_fn, batches, R, GA, rts, state, exact=True):
    """Three SGD-momentum steps compiled and eager on the same global batches; the losses
    equal eager's at every step, and weights, gradients and momentum buffers at the end (bit
    for bit with one micro-batch where ``exact``)."""
    eager = copy.deepcopy(model)
    opt, opt_e = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager))
    trainer = popxl.compile(model, loss_fn, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=rts, optimizer_state=state)  # fmt: skip
    exact = exact and R * GA == 1
    for inputs, targets in batches:
        got = trainer.step(inputs, targets)
        opt_e.zero_grad()
        out = eager(**inputs)
        if loss_fn is not None:
            want = loss_fn(out, targets)
        else:  # a Hugging Face output's loss, or the loss itself
            want = out.loss if hasattr(out, "loss") else out
        want.backward()
        opt_e.step()
        if exact:
            assert got == want.item()
        else:
            assert got == pytest.approx(want.item(), rel=RTOL)
    trainer.sync_weights()
    assert_same_training(model, opt, eager, opt_e, exact=exact)
    return trainer


def _ids(g):
    return torch.randint(0, V, (B, S), generator=g)


# ---- Hugging Face heads with two counted means -----------------------------------------------


def _gpt2_double_heads():
    config = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0,
                                     summary_first_dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2DoubleHeadsModel(config)


def _gpt2_double_heads_batches(n=3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (B, 2, S), generator=g)
        labels = ids.clone()
        labels[torch.rand(B, 2, S, generator=g) < 0.4] = -100  # every micro-batch counts others
        mc_labels = torch.randint(0, 2, (B,), generator=g)
        mc_labels[::3] = -100  # ignored rows in the multiple-choice mean too
        out.append(({"input_ids": ids, "mc_token_ids": torch.randint(0, S, (B, 2), generator=g),
                     "labels": labels, "mc_labels": mc_labels}, None))  # fmt: skip
    return out


def lm_plus_mc(out, _targets):
    return out.loss + out.mc_loss


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_gpt2_double_heads_lm_plus_multiple_choice_loss_trains_as_eager(R, GA, rts, state):
    """``out.loss + out.mc_loss``: a token mean over the labels that are not -100 plus a
    multiple-choice mean over the rows whose label is not -100, both counted in the forward
    (before: refused, the forward's counts could not be counted)."""
    _train_both(_gpt2_double_heads(), lm_plus_mc, _gpt2_double_heads_batches(), R, GA, rts, state)


def _bert_config():
    return transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64,
                                   max_position_embeddings=32, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)  # fmt: skip


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_bert_for_pretraining_masked_lm_plus_next_sentence_loss_trains_as_eager(R, GA, rts, state):
    """The model's own loss: a masked-LM token mean (70 % of the labels -100) plus a
    next-sentence mean."""
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(_bert_config())
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(3):
        ids = _ids(g)
        labels = ids.clone()
        labels[torch.rand(B, S, generator=g) < 0.7] = -100
        batches.append(({"input_ids": ids, "labels": labels,
                         "next_sentence_label": torch.randint(0, 2, (B,), generator=g)}, None))  # fmt: skip
    _train_both(model, None, batches, R, GA, rts, state)


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_bert_question_answering_with_positions_outside_the_sequence_trains_as_eager(
    R, GA, rts, state
):
    """``(start_ce + end_ce) / 2`` with the positions clamped to the sequence's length, which
    is the ignored index: rows whose answer lies outside count in neither mean."""
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(_bert_config())
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        start, end = (torch.randint(0, S + 4, (B,), generator=g) for _ in range(2))
        assert (start >= S).any() and (start < S).any()
        batches.append(({"input_ids": _ids(g), "start_positions": start,
                         "end_positions": end}, None))  # fmt: skip
    _train_both(model, None, batches, R, GA, rts, state)


# ---- a mixture of experts: a product of two means over the batch ----------------------------


def _mixtral():
    config = transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, max_position_embeddings=32,
        experts_implementation="batched_mm")  # (the eager experts select rows by value)  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def _mixtral_batches(n=2):
    g = torch.Generator().manual_seed(4)
    return [({"input_ids": (ids := _ids(g)), "labels": ids}, None) for _ in range(n)]


def test_mixtral_router_aux_loss_trains_as_eager_without_micro_batches():
    """``lm_loss + router_aux_loss_coef * aux``, the aux loss a function of the whole batch's
    routing: with one micro-batch it trains as eager, to rounding (not bit for bit: the
    embedding's weights differed from eager's by 4e-9 in one run of three)."""
    _train_both(_mixtral(), None, _mixtral_batches(), 1, 1, None, "on_chip", exact=False)


def test_mixtral_router_aux_loss_is_refused_with_micro_batches_naming_the_product():
    """The load-balancing loss is the share of tokens each expert gets times its mean routing
    probability, both over all tokens of the batch: micro-batch parts cannot add up to it (a
    product of means). Refused at build, naming the product, with nothing changed."""
    model = _mixtral()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = popxl.compile(model, None, opt, replication_factor=2, gradient_accumulation=2)
    with pytest.raises(LossDecompositionError, match="cannot split this loss") as err:
        trainer.step(_mixtral_batches(1)[0][0])
    assert "aten.mul.Tensor applied to a reduction of the batch over its rows" in str(err.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state


# ---- hand-written multi-task models ---------------------------------------------------------


class MultiTask(torch.nn.Module):
    """A classification head and a regression head on one body; ``weighting`` says how the
    forward adds their losses: numbers, or weights learned as parameters (uncertainty
    weighting: ``exp(-s) * loss + s``)."""

    def __init__(self, weighting: str = "numbers"):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.cls, self.reg = (torch.nn.Linear(12, 16), torch.nn.Linear(16, 5),
                                         torch.nn.Linear(16, 3))  # fmt: skip
        self.weighting = weighting
        self.log_vars = torch.nn.Parameter(torch.tensor([0.3, -0.2]))

    def heads(self, x):
        h = torch.tanh(self.body(x))
        return self.cls(h), self.reg(h)

    def forward(self, x, labels=None, values=None, weights=None):
        logits, pred = self.heads(x)
        if labels is None:
            return logits, pred
        ce = F.cross_entropy(logits, labels, ignore_index=-1)  # counted: rows not -1
        if self.weighting == "learned":
            s = self.log_vars
            return torch.exp(-s[0]) * ce + s[0] + torch.exp(-s[1]) * F.mse_loss(pred, values) + s[1]
        if self.weighting == "weighted_mean":  # a weighted mean: a computed denominator
            per_row = ((pred - values) ** 2).sum(1)
            return ce + (per_row * weights).sum() / weights.sum()
        if self.weighting == "over_rows":  # a sum divided by the batch's size, as a number
            return ce + 0.1 * ((pred - values) ** 2).sum() / pred.shape[0]
        return ce + 0.5 * F.mse_loss(pred, values)


def _multi_task_batches(n=3, rows=B):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        labels = torch.randint(0, 5, (rows,), generator=g)
        labels[torch.rand(rows, generator=g) < 0.4] = -1
        out.append(({"x": torch.randn(rows, 12, generator=g), "labels": labels,
                     "values": torch.randn(rows, 3, generator=g),
                     "weights": torch.rand(rows, generator=g)}, None))  # fmt: skip
    return out


@pytest.mark.parametrize("weighting", ["numbers", "learned", "weighted_mean", "over_rows"])
@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_multi_task_loss_computed_in_forward_trains_as_eager(weighting, R, GA, rts, state):
    """``ce + 0.5 * mse`` in the forward; the same weighted by ``exp(-s)`` with ``s`` a
    parameter (its gradient too); ``ce`` plus a weighted mean ``sum(w * l) / sum(w)``; ``ce``
    plus a sum divided by the batch's rows as a number (a mean over the global batch's rows:
    Note [a sum divided by the batch's size])."""
    _train_both(MultiTask(weighting), None, _multi_task_batches(), R, GA, rts, state)


def multi_task_loss_fn(out, targets):
    (logits, pred), (labels, values) = out, targets
    return F.cross_entropy(logits, labels, ignore_index=-1) + 0.5 * F.mse_loss(pred, values)


class Heads(MultiTask):
    def forward(self, x):
        return self.heads(x)


@pytest.mark.parametrize(("R", "n"), [(4, 10), (2, 7)])
def test_two_terms_on_a_short_batch_padded_over_the_replicas_train_as_eager(R, n):
    """A batch that does not split over the replicas is padded with rows the loss does not
    read: both terms count the real rows only (``ce`` its non-ignored ones)."""
    model = Heads()
    eager = copy.deepcopy(model)
    opt, opt_e = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager))
    trainer = popxl.compile(model, multi_task_loss_fn, opt, replication_factor=R,
                            gradient_accumulation=2)  # fmt: skip
    for inputs, _ in _multi_task_batches(rows=n):
        targets = (inputs["labels"], inputs["values"])
        got = trainer.step(inputs["x"], targets)
        opt_e.zero_grad()
        want = multi_task_loss_fn(eager(inputs["x"]), targets)
        want.backward()
        opt_e.step()
        assert got == pytest.approx(want.item(), rel=RTOL)
    trainer.sync_weights()
    assert_same_training(model, opt, eager, opt_e)


# ---- what cannot be split -------------------------------------------------------------------


class SquaredMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(12, 3)

    def forward(self, x, labels):
        return F.cross_entropy(self.fc(x), labels, ignore_index=-1) + self.fc(x).mean() ** 2


def test_a_nonlinear_function_of_a_batch_mean_beside_a_counted_mean_is_refused_naming_it():
    model = SquaredMean()
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    labels = torch.tensor([0, 1, -1, 2, 2, -1, 0, 1])
    with pytest.raises(LossDecompositionError, match="aten.pow.Tensor_Scalar applied to a "
                       "reduction of the batch"):  # fmt: skip
        trainer.step({"x": torch.randn(8, 12), "labels": labels})
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
