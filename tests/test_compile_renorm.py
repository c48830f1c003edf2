"""nn.Embedding(max_norm=...) trains as in eager torch (Note [embedding rows renormalised]).

Eager renormalises the rows the global batch looks up, in place, once per forward; the
compiled step looks rows up renormalised in every micro-batch and renormalises the union of
the global batch's rows once after them. Every test runs the eager loop beside the compiled
one from the same seed. Tolerances: bit for bit on one replica without accumulation, and for
a frozen table (only the renorm writes it) on any layout, where a row renormalised twice would
differ (eager's renorm is not idempotent in float32); otherwise float32 sums of the micro-
batches' gradients in another order: rtol 1e-5 / atol 1e-6.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_popxl as popxl


class Tagged(torch.nn.Module):
    def __init__(self, frozen=False, norm_type=2.0, padding_idx=None, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(30, 8, max_norm=1.0, norm_type=norm_type,
                                      padding_idx=padding_idx, dtype=dtype)  # fmt: skip
        with torch.no_grad():
            self.emb.weight.mul_(3.0)  # most rows above max_norm
        self.emb.requires_grad_(not frozen)
        self.head = torch.nn.Linear(8, 3, dtype=dtype)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _batches(n_steps, rows=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 30, (rows, 5), generator=g), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(n_steps)]  # fmt: skip


def train_both(model, R, GA, exact, **kwargs):
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    trainer = popxl.compile(model, F.cross_entropy, opt, replication_factor=R,
                            gradient_accumulation=GA, **kwargs)  # fmt: skip
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for ids, y in _batches(3):
        loss = trainer.step(ids, y)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(ids), y)
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=tol["rtol"], abs=tol["atol"])
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), msg=n, **tol)
        for k, v in ref_opt.state.get(q, {}).items():
            torch.testing.assert_close(opt.state[p][k], v, msg=f"{n} {k}", **tol)
    return model, ref


@pytest.mark.parametrize(("norm_type", "padding_idx"), [(2.0, None), (1.0, 0), (3.0, None)])
def test_a_max_norm_embedding_trains_bit_for_bit_on_one_replica(norm_type, padding_idx):
    train_both(Tagged(norm_type=norm_type, padding_idx=padding_idx), 1, 1, exact=True)


def test_a_float64_max_norm_embedding_trains_bit_for_bit():
    train_both(Tagged(dtype=torch.float64), 1, 1, exact=True)


@pytest.mark.parametrize(("R", "GA", "kwargs"), [
    (2, 2, {}), (4, 1, {"rts_threshold": 16, "optimizer_state": "remote"}), (1, 4, {}),
])  # fmt: skip
def test_a_max_norm_embedding_trains_as_eager_over_replicas_and_micro_batches(R, GA, kwargs):
    train_both(Tagged(), R, GA, exact=False, **kwargs)


@pytest.mark.parametrize(("R", "GA"), [(2, 2), (4, 2), (1, 4)])
def test_the_global_batchs_rows_are_renormalised_once_as_eager_does(R, GA):
    # a frozen table: only the renorm writes it, bit for bit eager's, though rows repeat over
    # micro-batches and replicas (renormalised per micro-batch they would differ)
    model, ref = train_both(Tagged(frozen=True), R, GA, exact=False)
    assert torch.equal(model.emb.weight, ref.emb.weight)
    untouched = Tagged(frozen=True).emb.weight
    assert not torch.equal(model.emb.weight, untouched)  # (the renorm did write it)


def test_a_read_of_the_weight_after_its_max_norm_lookup_is_refused_with_nothing_changed():
    class Tied(torch.nn.Module):  # eager's output projection reads the renormalised rows
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(30, 8, max_norm=1.0)

        def forward(self, ids):
            return F.linear(self.emb(ids).mean(1), self.emb.weight)

    model = Tied()
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    ids, _ = _batches(1)[0]
    with pytest.raises(ValueError, match=r"linear reads the parameter 'emb.weight' after "
                       r"F.embedding\(\.\.\., max_norm=\.\.\.\) renormalised"):  # fmt: skip
        trainer.step(ids, torch.randint(0, 30, (16,)))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
