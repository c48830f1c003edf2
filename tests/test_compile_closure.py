"""Optimizers whose step takes a closure (LBFGS) train through popxl.compile as in eager torch.

Note [optimizers that take a closure] (torch_popxl/compile.py): torch's LBFGS steps in eager,
its closure runs the compiled program (loss and gradients of the global batch on the
replicas). Reference: pytorch/examples' time_sequence_prediction loop (LSTMCells, LBFGS with
a closure), run eagerly on the same batches.

Tolerance: one replica runs eager's arithmetic, so losses, weights, p.grad are equal bit for
bit. With replicas and accumulation the gradients are summed in another order; LBFGS's inner
iterations amplify float32 rounding (1e-7 grows to 1e-2 in three steps), so those runs are in
float64, where the weights agree to 1e-6: measured at R=2, GA=2 on an Intel Xeon (MKL), the
largest relative difference grows 1.5e-12 -> 3.6e-11 -> 2.3e-8 over the three steps (a wrong
gradient moves them by O(1)).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_popxl as popxl


class Sequence(nn.Module):
    """time_sequence_prediction's model: two LSTMCells over the steps, a linear readout."""

    def __init__(self, hidden=12):
        super().__init__()
        torch.manual_seed(0)
        self.hidden = hidden
        self.lstm1, self.lstm2 = nn.LSTMCell(1, hidden), nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, x):
        h1 = x.new_zeros(x.shape[0], self.hidden)
        c1, h2, c2 = torch.zeros_like(h1), torch.zeros_like(h1), torch.zeros_like(h1)
        outputs = []
        for step in x.split(1, dim=1):
            h1, c1 = self.lstm1(step, (h1, c1))
            h2, c2 = self.lstm2(h1, (h2, c2))
            outputs.append(self.linear(h2))
        return torch.cat(outputs, 1)


def waves(dtype=torch.float32, rows=16, steps=10):
    g = torch.Generator().manual_seed(1)
    t = torch.linspace(0, 6, rows * steps).view(rows, steps)
    x = torch.sin(t + torch.rand(rows, 1, generator=g)) + 0.05 * torch.randn(
        rows, steps, generator=g
    )
    return x.to(dtype), torch.roll(x, -1, 1).to(dtype)


def _run(R, GA, dtype, line_search_fn=None, schedule=False, steps=3):
    model = Sequence().to(dtype)
    eager = copy.deepcopy(model)
    opt = torch.optim.LBFGS(eager.parameters(), lr=0.8, line_search_fn=line_search_fn)
    compiled_opt = torch.optim.LBFGS(model.parameters(), lr=0.8, line_search_fn=line_search_fn)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if schedule else None
    compiled_sched = (torch.optim.lr_scheduler.StepLR(compiled_opt, 1, gamma=0.5)
                      if schedule else None)  # fmt: skip
    trainer = popxl.compile(model, F.mse_loss, compiled_opt, replication_factor=R,
                            gradient_accumulation=GA)  # fmt: skip
    x, y = waves(dtype)
    losses, eager_losses = [], []
    for _ in range(steps):

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(eager(x), y)
            loss.backward()
            return loss

        eager_losses.append(opt.step(closure).item())
        losses.append(trainer.step(x, y))
        for s in (sched, compiled_sched):
            if s is not None:
                s.step()
    return model, eager, compiled_opt, opt, losses, eager_losses


@pytest.mark.parametrize("schedule", [False, True])
def test_lbfgs_on_one_replica_is_eager_bit_for_bit(schedule):
    model, eager, opt, eager_opt, losses, eager_losses = _run(1, 1, torch.float32,
                                                              schedule=schedule)  # fmt: skip
    assert losses == eager_losses
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert torch.equal(p.grad, q.grad), name
    assert opt.state[opt._params[0]]["n_iter"] == eager_opt.state[eager_opt._params[0]]["n_iter"]
    assert opt.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"]


@pytest.mark.parametrize(("R", "GA", "line_search_fn"), [(2, 2, None), (2, 1, "strong_wolfe")])
def test_lbfgs_on_replicas_with_accumulation_matches_eager_on_the_global_batch(R, GA,
                                                                               line_search_fn):  # fmt: skip
    model, eager, _, _, losses, eager_losses = _run(R, GA, torch.float64, line_search_fn)
    assert losses == pytest.approx(eager_losses, rel=1e-10)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-8, msg=name)


def test_lbfgs_returns_the_first_closures_loss_and_outputs():
    model = Sequence()
    trainer = popxl.compile(model, F.mse_loss, torch.optim.LBFGS(model.parameters(), max_iter=4),
                            replication_factor=2, return_outputs=True)  # fmt: skip
    x, y = waves()
    with torch.no_grad():
        before = model(x)
    loss, out = trainer.step(x, y)
    torch.testing.assert_close(out, before, rtol=1e-6, atol=1e-6)
    assert loss == pytest.approx(F.mse_loss(before, y).item(), rel=1e-6)
