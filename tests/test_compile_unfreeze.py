"""Fine-tuning loops that change what trains between steps, against eager torch: layers
unfrozen after some steps (each keeps torch's own step count: Note [parameters stepped fewer
times] in compile.py), parameters added with ``add_param_group``, optimizer state reset by the
user (``optimizer.state.clear()``, ``del optimizer.state[p]``), and checkpoints taken while
parameters are stepped differently."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from optim_checks import assert_same_training

import torch_popxl as popxl

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    # (eps: g / sqrt(v) of a gradient element near 0 would amplify its summation-order rounding
    # at R * GA > 1 beyond the tolerance; bit for bit at one replica either way)
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, eps=1e-4),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),  # a captured torch step
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),  # state from its constructor
}
PLACEMENTS = {
    "one_replica": {},  # bit for bit
    "on_chip": dict(replication_factor=2, gradient_accumulation=2),
    "remote_rts": dict(replication_factor=2, gradient_accumulation=2, rts_threshold=8,
                       optimizer_state="remote"),
}  # fmt: skip
STEPS = 6


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """The claims are bit for bit against eager torch's CPU kernels at one replica, and within
    float32 summation-order rounding at R * GA > 1 (which a GPU's kernels, adding in other
    orders again, exceed for RMSprop's g / sqrt(v)); the step counts are device-independent."""
    monkeypatch.setenv("TORCH_POPXL_DEVICE", "cpu")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
    )  # fmt: skip


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(STEPS)]  # fmt: skip


def _train(compiled: bool, make_opt, events: dict, frozen=(0, 2), **placement):
    """STEPS steps; ``events[i](model, optimizer)`` runs before step i."""
    m = _model()
    for i in frozen:
        m[i].requires_grad_(False)
    opt = make_opt(m.parameters())
    trainer = popxl.compile(m, F.cross_entropy, opt, **placement) if compiled else None
    losses = []
    for i, (x, y) in enumerate(_batches()):
        if i in events:
            events[i](m, opt)
        if trainer is not None:
            losses.append(float(trainer.step(x, y)))
        else:
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return m, opt, losses


def _same(events, make_opt, frozen=(0, 2), **placement):
    m_ref, opt_ref, want = _train(False, make_opt, events, frozen)
    m, opt, got = _train(True, make_opt, events, frozen, **placement)
    tol = dict(rtol=1e-5, atol=1e-6) if placement else dict(rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tol)
    assert_same_training(m, opt, m_ref, opt_ref, exact=not placement)
    return opt, opt_ref


GRADUAL = {  # gradual unfreezing, top down (ULMFiT's schedule)
    2: lambda m, opt: m[2].requires_grad_(True),
    4: lambda m, opt: m[0].requires_grad_(True),
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_layers_unfrozen_after_some_steps_train_as_eager(name, placement):
    opt, opt_ref = _same(GRADUAL, OPTIMIZERS[name], **PLACEMENTS[placement])
    if "step" in opt_ref.state[opt_ref.param_groups[0]["params"][0]]:  # torch counts per parameter
        steps = [float(opt.state[p]["step"]) for p in opt.param_groups[0]["params"]]
        # the first layer unfrozen before step 4, the second before step 2, the head from 0
        assert steps == [2.0, 2.0, 4.0, 4.0, 6.0, 6.0], steps


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_param_group_added_after_some_steps_trains_as_eager(placement):
    def add(m, opt):
        m[0].requires_grad_(True)
        opt.add_param_group({"params": list(m[0].parameters()), "lr": 1e-3})

    def make(ps):  # the head alone to begin with
        return torch.optim.AdamW([p for p in ps if p.requires_grad], lr=1e-2)

    _same({3: add}, make, frozen=(0,), **PLACEMENTS[placement])


@pytest.mark.parametrize(
    "reset",
    [
        lambda m, opt: opt.state.clear(),  # restart every moment and count
        lambda m, opt: opt.state.__delitem__(m[4].weight),  # one parameter's
        lambda m, opt: opt.state.pop(m[4].bias),
    ],
    ids=["clear", "del", "pop"],
)
@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_optimizer_state_reset_by_the_user_trains_as_eager(name, reset):
    _same({3: reset}, OPTIMIZERS[name], frozen=(), **PLACEMENTS["on_chip"])


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_checkpoint_with_parameters_stepped_differently_resumes_as_eager(placement):
    """Trainer.state_dict() taken after an unfreeze (one layer 2 steps behind, one not stepped
    yet) restores into a fresh trainer that goes on as the original does."""
    make = OPTIMIZERS["adam"]
    batches = _batches()

    def setup():
        m = _model()
        m[0].requires_grad_(False)
        m[2].requires_grad_(False)
        return m, popxl.compile(m, F.cross_entropy, make(m.parameters()), **PLACEMENTS[placement])

    m, trainer = setup()
    for i in range(4):
        if i == 2:
            m[2].requires_grad_(True)
        trainer.step(*batches[i])
    m[0].requires_grad_(True)  # unfrozen, not stepped yet: no state in the checkpoint
    ckpt = copy.deepcopy(trainer.state_dict())
    assert ckpt["optimizer"]["step"] == 4
    assert ckpt["optimizer"]["steps"] == {"2.weight": 2, "2.bias": 2, "4.weight": 4, "4.bias": 4}

    m2, trainer2 = setup()
    m2[0].requires_grad_(True)
    m2[2].requires_grad_(True)
    trainer2.load_state_dict(ckpt)
    for x, y in batches[4:]:
        trainer.step(x, y)
        trainer2.step(x, y)
    assert_same_training(m2, trainer2.optimizer, m, trainer.optimizer, exact=True)
    assert float(trainer2.optimizer.state[m2[0].weight]["step"]) == 2.0


def test_a_checkpoint_with_bad_step_counts_is_refused_and_changes_nothing():
    m = _model()
    trainer = popxl.compile(m, F.cross_entropy, OPTIMIZERS["adam"](m.parameters()))
    trainer.step(*_batches()[0])
    ckpt = trainer.state_dict()
    before = copy.deepcopy(ckpt)
    for steps, match in [({"0.weight": 5}, r"ints in 1\.\.1"),
                         ({"0.weight": 1}, "must name the parameters in 'state'")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            trainer.load_state_dict(dict(ckpt, optimizer=dict(ckpt["optimizer"], steps=steps)))
        after = trainer.state_dict()
        for k, v in before["model"].items():
            assert torch.equal(after["model"][k], v), k
        assert after["optimizer"]["step"] == 1
