"""The step's fast path (Note [the step's fast path] in compile.py): a batch of the types,
shapes and dtypes a step has already checked skips the batch checks and enters the streams
directly. It trains as eager torch and bit for bit as the full path, leaves the caller's
arrays alone, and every change a user can make between steps is still seen.

References: eager torch on the same schedule (rtol 2e-4 / atol 2e-5, float32 sums in another
order) and the full path (exact: the same program on the same values).
"""

import copy
import importlib

import numpy as np
import pytest
import torch

import torch_popxl as popxl

_compile = importlib.import_module("torch_popxl.compile")
RTOL, ATOL = 2e-4, 2e-5
R, GA = 2, 2


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _batches(n=4, rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(rows, 12)).astype(np.float32), rng.integers(0, 4, rows))
            for _ in range(n)]  # fmt: skip


def _eager_step(model, opt, x, y) -> float:
    """One eager step on the compiled schedule: R x GA' equal chunks, mean of their losses."""
    ga = GA if len(x) % (R * GA) == 0 else 1
    opt.zero_grad()
    total = 0.0
    for xc, yc in zip(
        np.split(np.asarray(x), R * ga), np.split(np.asarray(y), R * ga), strict=True
    ):
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(xc)), torch.from_numpy(yc))
        (loss / (R * ga)).backward()
        total += loss.item() / (R * ga)
    opt.step()
    return total


def _np(a) -> np.ndarray:
    return a.detach().numpy() if isinstance(a, torch.Tensor) else a


def _pair(make_opt=lambda ps: torch.optim.Adam(ps, lr=1e-2), **kw):
    """A compiled trainer and an eager copy of the same model with its own optimizer."""
    model = _mlp()
    ref = copy.deepcopy(model)
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                            make_opt(model.parameters()), replication_factor=R,
                            gradient_accumulation=GA, **kw)  # fmt: skip
    return trainer, ref, make_opt(ref.parameters())


def _assert_params(model, ref, exact=False):
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if exact:
            assert torch.equal(p.detach(), q.detach()), n
        else:
            np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, err_msg=n)


def _counting_checks(monkeypatch) -> list:
    """Records every full batch check (the fast path skips it)."""
    calls: list = []
    full = _compile.Trainer._check_batch

    def check(self, inputs, targets):
        calls.append(1)
        return full(self, inputs, targets)

    monkeypatch.setattr(_compile.Trainer, "_check_batch", check)
    return calls


@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("layout", [{}, {"rts_threshold": 32, "optimizer_state": "remote"}],
                         ids=["on_chip", "remote_rts"])  # fmt: skip
def test_fast_steps_train_as_eager_and_as_the_full_path(monkeypatch, as_torch, layout):
    batches = _batches()
    if as_torch:  # (the input requiring grad, as a tensor from another graph may)
        batches = [(torch.from_numpy(x).requires_grad_(), torch.from_numpy(y)) for x, y in batches]
    trainer, ref, ref_opt = _pair(**layout)
    full, _, _ = _pair(**layout)
    monkeypatch.setattr(_compile._FastStep, "record", staticmethod(lambda *a: None))
    full_losses = [full.step(x, y) for x, y in batches]  # nothing recorded: the full path
    full.sync_weights()
    monkeypatch.undo()
    calls = _counting_checks(monkeypatch)
    kept = [(_np(x).copy(), _np(y).copy()) for x, y in batches]
    losses = [trainer.step(x, y) for x, y in batches]
    ref_losses = [_eager_step(ref, ref_opt, _np(x), _np(y)) for x, y in batches]
    assert len(calls) == 1  # the first step checked the batch; the others took the fast path
    assert losses == full_losses  # the same program on the same values: the same bits
    _assert_params(trainer.model, full.model, exact=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    _assert_params(trainer.model, ref)
    for (x, y), (x0, y0) in zip(batches, kept, strict=True):  # the caller's data untouched
        assert np.array_equal(_np(x), x0) and np.array_equal(_np(y), y0)


def test_other_batches_take_the_full_path_and_train_as_eager(monkeypatch):
    """A short batch, a non-contiguous or reversed view, int32 targets, float64 inputs (narrowed
    by the full path): each is checked in full and trains as eager does."""
    trainer, ref, ref_opt = _pair()
    calls = _counting_checks(monkeypatch)
    (x, y), (x2, y2), (x3, y3) = _batches(3)
    wide = np.random.default_rng(1).normal(size=(12, 32)).astype(np.float32)
    steps = [
        (x, y),  # checked: recorded
        (x2, y2),  # fast
        (x[:12], y[:12]),  # another shape: checked (runs as R x 1 micro-batches)
        (x3[::-1], y3[::-1]),  # negative strides: checked
        (wide.T[:16, :12], y),  # column-major rows: checked
        (x2, y2.astype(np.int32)),  # another dtype: checked
        (x3.astype(np.float64), y3),  # float64, narrowed: checked
    ]
    for xs, ys in steps:
        loss = trainer.step(xs, ys)
        ref_loss = _eager_step(
            ref, ref_opt, np.ascontiguousarray(xs, np.float32), ys.astype(np.int64)
        )
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert len(calls) == len(steps) - 1
    _assert_params(trainer.model, ref)


def test_changes_between_fast_steps_are_seen(monkeypatch):
    """Weight decay switched on, a gradient hook registered, the learning rate changed: each
    reaches the next step of the same batch shape as it reaches eager torch."""
    trainer, ref, ref_opt = _pair()
    calls = _counting_checks(monkeypatch)
    batches = _batches(5)
    changes = [
        lambda m, opt: None,
        lambda m, opt: None,
        lambda m, opt: opt.param_groups[0].update(weight_decay=0.5),  # a new program
        lambda m, opt: m[0].bias.register_hook(lambda g: g * 0),  # a new program
        lambda m, opt: opt.param_groups[0].update(lr=0.1),  # a hyperparameter: pushed
    ]
    for (x, y), change in zip(batches, changes, strict=True):
        change(trainer.model, trainer.optimizer)
        change(ref, ref_opt)
        np.testing.assert_allclose(
            trainer.step(x, y), _eager_step(ref, ref_opt, x, y), rtol=RTOL, atol=ATOL
        )
        _assert_params(trainer.model, ref)
    assert len(calls) == 3  # the first step and the two that built new programs


def test_errors_on_the_fast_path_are_the_full_paths_and_change_nothing():
    trainer, _, _ = _pair()
    x, y = _batches(1)[0]
    trainer.step(x, y)
    trainer.step(x, y)  # fast
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    old = trainer.model[2].weight
    trainer.model[2].weight = torch.nn.Parameter(old.detach().clone())
    with pytest.raises(ValueError, match=r"\['2.weight'\] of the model were replaced"):
        trainer.step(x, y)
    trainer.model[2].weight = old
    with torch.no_grad():
        trainer.model[0].weight.data = trainer.model[0].weight.detach().clone()
    with pytest.raises(ValueError, match="the storage of '0.weight' was replaced"):
        trainer.step(x, y)
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
