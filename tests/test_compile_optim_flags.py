"""The flags a user may set on every torch optimizer, and LR schedulers, under popxl.compile:
each trains as the eager loop on the global batch, bit for bit at R=1 (the gradients are
eager's and the update runs torch's arithmetic), and close at R=2 with gradient accumulation
and sharded (RTS), off-chip state (the gradients are float32 sums in another order; the
tolerances of tests/test_compile_optimizers.py). A scheduler never rebuilds the program.

The model is tiny (12 -> 8 -> 4) and the steps few, so the sweep stays quick.
"""

import pytest
import torch
import torch.nn.functional as F
from optim_checks import assert_same_training, eager_step

import torch_popxl as popxl

STEPS = 3
EPS = 1e-4  # the adaptive optimizers' (tests/test_compile_optimizers.py, tolerances)
optim = torch.optim

FLAGS = {
    "sgd_nesterov": lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd_maximize": lambda ps: optim.SGD(ps, lr=0.05, maximize=True),
    "sgd_dampening_foreach": lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.2,
                                              foreach=True),
    "adam_amsgrad_maximize": lambda ps: optim.Adam(ps, lr=1e-2, amsgrad=True, maximize=True, eps=EPS),
    "adam_foreach": lambda ps: optim.Adam(ps, lr=1e-2, foreach=True, eps=EPS),
    "adam_single": lambda ps: optim.Adam(ps, lr=1e-2, foreach=False, weight_decay=1e-2, eps=EPS),
    "adam_fused": lambda ps: optim.Adam(ps, lr=1e-2, fused=True, eps=EPS),
    "adam_capturable": lambda ps: optim.Adam(ps, lr=1e-2, capturable=True, eps=EPS),
    "adam_differentiable": lambda ps: optim.Adam(ps, lr=1e-2, differentiable=True, eps=EPS),
    "adamw_amsgrad": lambda ps: optim.AdamW(ps, lr=1e-2, amsgrad=True, eps=EPS),
    "adamw_foreach": lambda ps: optim.AdamW(ps, lr=1e-2, foreach=True, eps=EPS),
    "adamw_fused": lambda ps: optim.AdamW(ps, lr=1e-2, fused=True, eps=EPS),
    "nadam_momentum_decay": lambda ps: optim.NAdam(ps, lr=1e-2, momentum_decay=8e-3, eps=EPS,
                                               weight_decay=1e-2),
    "nadam_decoupled_foreach": lambda ps: optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True,
                                                  weight_decay=1e-2, foreach=True, eps=EPS),
    "radam_decoupled": lambda ps: optim.RAdam(ps, lr=1e-2, decoupled_weight_decay=True,
                                          weight_decay=1e-2, eps=EPS),
    "adagrad_foreach": lambda ps: optim.Adagrad(ps, lr=1e-2, lr_decay=1e-3,
                                            initial_accumulator_value=0.2, foreach=True, eps=EPS),
    "asgd_wd": lambda ps: optim.ASGD(ps, lr=1e-2, lambd=1e-3, alpha=0.5, t0=1, weight_decay=1e-2),
    "rprop_maximize": lambda ps: optim.Rprop(ps, lr=1e-2, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0),
                                         maximize=True),
    "rmsprop_centered_momentum": lambda ps: optim.RMSprop(ps, lr=1e-2, centered=True, momentum=0.5,
                                                      eps=EPS),
    "rmsprop_foreach": lambda ps: optim.RMSprop(ps, lr=1e-2, foreach=True, alpha=0.9, eps=EPS),
    "adamax_wd_foreach": lambda ps: optim.Adamax(ps, lr=1e-2, weight_decay=1e-2, foreach=True,
                                             eps=EPS),
    "adadelta_rho_wd": lambda ps: optim.Adadelta(ps, lr=0.5, rho=0.8, weight_decay=1e-2),
    "adafactor_foreach": lambda ps: optim.Adafactor(ps, foreach=True),
}  # fmt: skip


# RAdam and ASGD branch on the step count, so they run torch's capturable path (float32
# tensor scalars: an ulp off; Note [captured optimizer steps])
NOT_EXACT = {"radam_decoupled", "asgd_wd"}
# eager torch on CPU refuses these flags (capturable: "params and state_steps must be on
# supported devices"; differentiable: an in-place update of a leaf that requires grad); the
# compiled step trains as without them
EAGER_WITHOUT = {"adam_capturable": "capturable", "adam_differentiable": "differentiable"}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def batches(n=STEPS, size=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 12, generator=g), torch.randn(size, 4, generator=g))
            for _ in range(n)]  # fmt: skip


def train(make, R, GA, rts, state, schedule=None, n=STEPS, eager_without=None):
    """``n`` compiled and ``n`` eager steps of the same data; the trainer's programs."""
    m, m_ref = model(), model()
    opt, opt_ref = make(m.parameters()), make(m_ref.parameters())
    if eager_without:
        for g in (opt_ref.defaults, *opt_ref.param_groups):
            g[eager_without] = False
    trainer = popxl.compile(m, F.mse_loss, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=rts, optimizer_state=state)  # fmt: skip
    sched = schedule(opt) if schedule else None
    sched_ref = schedule(opt_ref) if schedule else None
    irs = set()
    for x, y in batches(n):
        loss = trainer.step(x.numpy(), y.numpy())
        loss_ref = eager_step(m_ref, opt_ref, x, y)
        irs.add(id(trainer.ir))
        for s, value in ((sched, loss), (sched_ref, loss_ref)):
            if isinstance(s, optim.lr_scheduler.ReduceLROnPlateau):
                s.step(value)
            elif s is not None:
                s.step()
    return (m, opt, m_ref, opt_ref), irs


LAYOUTS = [(1, 1, None, "on_chip"), (2, 2, 16, "remote")]


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
@pytest.mark.parametrize("kind", sorted(FLAGS))
def test_optimizer_flags_match_eager(kind, R, GA, rts, state):
    pair, _ = train(FLAGS[kind], R, GA, rts, state, eager_without=EAGER_WITHOUT.get(kind))
    assert_same_training(*pair, exact=R == 1 and kind not in NOT_EXACT)


def test_sparse_adam_is_refused_at_compile_time():
    m = model()
    opt = optim.SparseAdam(m.parameters())
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(
        TypeError, match=r"SparseAdam updates sparse gradients.*Use torch.optim.Adam"
    ):
        popxl.compile(m, F.mse_loss, opt)
    assert all(torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before, strict=True))


sched = optim.lr_scheduler
SCHEDULES = {
    # (optimizer, scheduler): OneCycleLR also cycles SGD's momentum and Adam's / Adamax's beta1
    "onecycle_sgd": (lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9),
                     lambda o: sched.OneCycleLR(o, max_lr=0.1, total_steps=8)),
    "onecycle_adam": (lambda ps: optim.Adam(ps, lr=1e-2, eps=EPS),
                      lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=8)),
    "onecycle_adamax": (lambda ps: optim.Adamax(ps, lr=1e-2, eps=EPS),
                        lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=8)),
    "cosine_restarts_rmsprop": (lambda ps: optim.RMSprop(ps, lr=1e-2, eps=EPS),
                                lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=2)),
    # mode="max" with a falling loss: the LR halves at every step
    "plateau_adadelta": (lambda ps: optim.Adadelta(ps, lr=1.0),
                         lambda o: sched.ReduceLROnPlateau(o, mode="max", patience=0)),
    "lambda_nadam": (lambda ps: optim.NAdam(ps, lr=1e-2, eps=EPS),
                     lambda o: sched.LambdaLR(o, lambda e: 1 / (e + 1))),
    "sequential_adafactor": (lambda ps: optim.Adafactor(ps, lr=5e-2),
                             lambda o: sched.SequentialLR(
                                 o, [sched.LinearLR(o, start_factor=0.1, total_iters=2),
                                     sched.ExponentialLR(o, gamma=0.5)], milestones=[2])),
}  # fmt: skip


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_lr_schedulers_match_eager_without_rebuilds(kind, R, GA, rts, state):
    make, schedule = SCHEDULES[kind]
    (m, opt, m_ref, opt_ref), irs = train(make, R, GA, rts, state, schedule, n=5)
    assert opt.param_groups[0]["lr"] != opt_ref.defaults["lr"]  # the schedule moved the LR
    assert opt.param_groups[0]["lr"] == opt_ref.param_groups[0]["lr"]
    assert len(irs) == 1, "a scheduler's step must not rebuild the program"
    assert_same_training(m, opt, m_ref, opt_ref, exact=R == 1)


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_manual_lr_edits_of_param_groups_match_eager(R, GA, rts, state):
    """Per-group LRs edited by hand between steps (warm-up written in the loop)."""

    def make(ps):
        ps = list(ps)
        return optim.NAdam([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}], lr=1e-2, eps=EPS)

    def warmup(o):
        class Warmup:
            def step(self):
                for i, g in enumerate(o.param_groups):
                    g["lr"] *= 1.5 if i == 0 else 0.5

        return Warmup()

    (m, opt, m_ref, opt_ref), irs = train(make, R, GA, rts, state, warmup, n=4)
    assert len(irs) == 1
    assert_same_training(m, opt, m_ref, opt_ref, exact=R == 1)
