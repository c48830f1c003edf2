"""Helpers the compile tests share: one eager training step, the comparison of a compiled
trainer's weights and optimizer state with eager torch's, training a model both ways side by
side, and SGD-momentum steps on either executor."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

import torch_popxl as popxl

RTOL, ATOL = 1e-5, 1e-6
SGD_LR = 0.1  # the learning rate of ``fast_matches_reference``'s SGD momentum


def eager_step(m, opt, x, y) -> float:
    opt.zero_grad()
    loss = F.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def assert_same_training(m, opt, m_ref, opt_ref, exact: bool = False) -> None:
    """Weights, the last step's ``p.grad`` and every optimizer state tensor equal eager's (bit
    for bit when ``exact``)."""
    check = torch.testing.assert_close
    kw = {"rtol": 0, "atol": 0} if exact else {"rtol": RTOL, "atol": ATOL}
    for (name, p), q in zip(m.named_parameters(), m_ref.parameters(), strict=True):
        check(p.detach(), q.detach(), **kw, msg=lambda s, n=name: f"{n}: {s}")
        check(p.grad, q.grad, **kw, msg=lambda s, n=name: f"{n}.grad: {s}")
        assert sorted(opt.state[p]) == sorted(opt_ref.state[q]), name
        for k, v in opt_ref.state[q].items():
            # state is not scaled by lr (RMSprop's buffer of g / sqrt(v) reaches ~10): its
            # absolute tolerance scales with its magnitude
            kw_state = dict(kw, atol=kw["atol"] * max(1.0, v.abs().max().item()))
            check(opt.state[p][k], v, **kw_state, msg=lambda s, n=f"{name}.{k}": f"{n}: {s}")


def kernel_steps_against_eager(model, make_optimizer, count_calls):
    """Three MSE steps of ``model`` compiled (one replica) and eager, each with
    ``make_optimizer(params)``; ``count_calls(trainer)`` is installed after the first step (the
    program is built) and its result returned with the trainer and both optimizers, for the
    caller's assertions. Weights, p.grad and state are then compared bit for bit."""
    ref = copy.deepcopy(model)
    opt, opt_ref = make_optimizer(model.parameters()), make_optimizer(ref.parameters())
    trainer = popxl.compile(model, F.mse_loss, opt)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen))
               for _ in range(3)]  # fmt: skip
    trainer.step(*batches[0])
    eager_step(ref, opt_ref, *batches[0])
    calls = count_calls(trainer)
    for x, y in batches[1:]:
        trainer.step(x, y)
        eager_step(ref, opt_ref, x, y)
    trainer.sync_weights()
    assert_same_training(model, opt, ref, opt_ref, exact=True)
    return trainer, opt, calls


def train_both(model, loss_fn, batches, R, GA, *, lr=0.1, rtol=RTOL, atol=ATOL,
               optimizer=torch.optim.SGD, **compile_kw):  # fmt: skip
    """Trains ``model`` eagerly and a copy through popxl.compile (``optimizer(params, lr)``
    for both; ``compile_kw`` to popxl.compile); compares the losses of every step and the
    weights at the end; returns the trainer. ``batches`` holds (inputs, targets), tensors or
    arrays; with ``loss_fn=None`` inputs is a dict of kwargs."""
    eager = copy.deepcopy(model)
    opt_e = optimizer(eager.parameters(), lr=lr)
    trainer = popxl.compile(model, loss_fn, optimizer(model.parameters(), lr=lr),
                            replication_factor=R, gradient_accumulation=GA, **compile_kw)  # fmt: skip
    for x, y in batches:
        opt_e.zero_grad()
        if loss_fn is None:
            want = eager(**x).loss
            got = trainer.step(x)
        else:
            want = loss_fn(eager(torch.as_tensor(x)), torch.as_tensor(y))
            got = trainer.step(x, y)
        want.backward()
        opt_e.step()
        torch.testing.assert_close(torch.tensor(float(got)), want.detach(), rtol=rtol, atol=atol)
    trainer.sync_weights()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol, msg=name)
    return trainer


def _sgd_momentum_run(executor: str, model_fn, R: int, GA: int, batches):
    torch.manual_seed(0)
    model = model_fn()
    trainer = popxl.compile(model, F.cross_entropy,
                            torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9),
                            replication_factor=R, gradient_accumulation=GA,
                            executor=executor)  # fmt: skip
    losses = [trainer.step(x, y) for x, y in batches]
    state = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    fns = dict(trainer.session._executor.fns) if executor == "fast" else {}
    return np.asarray(losses), state, fns


def fast_matches_reference(model_fn, R: int, GA: int, batches, first_loss=None,
                           state_atol: float = 1e-5):  # fmt: skip
    """``model_fn()`` (from seed 0) trained with SGD momentum and cross-entropy through
    popxl.compile on the fast and on the reference executor: the losses and the module's state
    afterwards (parameters, running statistics, counters) are equal (the state to
    ``state_atol``), and the first loss is ``first_loss`` (eager's, when given); returns the
    fast run's state and its generated fragments."""
    fast_losses, fast, fns = _sgd_momentum_run("fast", model_fn, R, GA, batches)
    ref_losses, ref, _ = _sgd_momentum_run("reference", model_fn, R, GA, batches)
    np.testing.assert_allclose(fast_losses, ref_losses, rtol=1e-5, atol=1e-6)
    if first_loss is not None:
        np.testing.assert_allclose(fast_losses[0], first_loss, rtol=1e-5, atol=1e-6)
    for k, want in ref.items():
        np.testing.assert_allclose(fast[k], want, rtol=1e-4, atol=state_atol, err_msg=k)
    return fast, fns


def per_replica_eager_step(model, opt, loss_fn, R: int, GA: int):
    """The eager reference of a step with batch norm at R replicas x GA micro-batches (Note
    [per-replica batch statistics] in torch_popxl/compile.py): each replica runs its own
    micro-batches (rows g*R + r of the R*GA equal parts) in order from the module's buffers,
    the gradients of all parts are summed, and the module keeps replica 0's buffers."""
    buffers = list(model.buffers())

    def step(data, target):
        opt.zero_grad()
        parts = R * GA
        xs, ys = data.chunk(parts), target.chunk(parts)
        start = [b.clone() for b in buffers]
        replica0 = None
        total = 0.0
        for r in range(R):
            with torch.no_grad():
                for b, v in zip(buffers, start, strict=True):
                    b.copy_(v)
            for g in range(GA):
                loss = loss_fn(model(xs[g * R + r]), ys[g * R + r])
                (loss / parts).backward()  # the global mean: equal parts
                total += loss.item() / parts
            if r == 0:
                replica0 = [b.clone() for b in buffers]
        with torch.no_grad():
            for b, v in zip(buffers, replica0, strict=True):
                b.copy_(v)
        opt.step()
        return total

    return step
