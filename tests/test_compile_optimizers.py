"""Every torch optimizer under popxl.compile (Note [captured optimizer steps]): the optimizer's
own ``step()`` is captured, so Adadelta, RMSprop, Adagrad, Adamax, NAdam, RAdam, ASGD, Rprop and
a user's ``Optimizer`` subclass train as the eager loop on the global batch, at any replication,
gradient accumulation, sharded (RTS) or not, with state on chip or remote; the optimizer state
is torch's (``optimizer.state``); LR schedulers take effect without a rebuild.

Tolerances: at R=1, GA=1 the gradients are eager's bit for bit and the captured step runs
torch's own kernels with eager's scalars, so the optimizers in ``EXACT`` are compared with
``torch.equal``. With replicas or micro-batches the gradients are float32 sums in another order:
an absolute difference of ~1e-7 x the summands, which near a zero gradient is amplified by the
adaptive optimizers' ``g / (sqrt(v) + eps)`` up to ``lr x 1e-9 / eps`` (measured 1.5e-6 with
RMSprop's eps=1e-8). So the adaptive optimizers use eps=1e-4, which bounds that by ~1e-7, and
the comparison is rtol 1e-5 / atol 1e-6 (measured at most ~1e-7).
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from optim_checks import assert_same_training, eager_step

import torch_popxl as popxl

STEPS = 4
EPS = 1e-4  # the adaptive optimizers' (see the tolerances above)
# (R, GA, rts_threshold, optimizer_state)
LAYOUTS = [(1, 1, None, "on_chip"), (2, 2, None, "remote"), (2, 1, 16, "on_chip"),
           (2, 2, 16, "remote")]  # fmt: skip


class SignMomentum(torch.optim.Optimizer):
    """A user's optimizer in torch ops: momentum of the gradient, a step along its sign
    scaled by a running mean of |g| (elementwise)."""

    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                    state["scale"] = torch.full_like(p, 0.5)
                m = state["momentum"]
                m.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                state["scale"].lerp_(p.grad.abs(), 0.1)
                p.addcmul_(m.sign(), state["scale"], value=-group["lr"])


class NormalizedSGD(torch.optim.Optimizer):
    """A user's optimizer whose update reduces over the whole parameter (a norm)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-6), alpha=-group["lr"])


OPTIMIZERS = {
    # the common MNIST example's
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, eps=EPS),
    "rmsprop_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, eps=EPS),
    "rmsprop_centered_wd": lambda ps: torch.optim.RMSprop(
        ps, lr=1e-2, momentum=0.5, centered=True, weight_decay=1e-2, eps=EPS
    ),  # fmt: skip
    "adagrad": lambda ps: torch.optim.Adagrad(
        ps, lr=1e-2, lr_decay=1e-2, initial_accumulator_value=0.1, eps=EPS
    ),  # fmt: skip
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, eps=EPS),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, eps=EPS),
    "nadam_decoupled": lambda ps: torch.optim.NAdam(
        ps, lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True, eps=EPS
    ),  # fmt: skip
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, eps=EPS),
    # factored state (row and column variances of a matrix) and Python numbers from the step
    # count and norms (Note [steps on whole parameters])
    "adafactor": lambda ps: torch.optim.Adafactor(ps),
    "adafactor_wd_maximize": lambda ps: torch.optim.Adafactor(
        ps, lr=3e-2, weight_decay=0.1, maximize=True, eps=(1e-6, 1e-3), beta2_decay=-0.5, d=2.0
    ),  # fmt: skip
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=2),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "user_sign_momentum": lambda ps: SignMomentum(ps, lr=1e-2),
    # options the hand-written SGD/Adam/AdamW do not have run torch's own step too
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, eps=EPS),
    "adamw_maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True, eps=EPS),
    # momentum buffer made from the first gradient (dampening applies from the second step)
    "sgd_maximize_dampening": lambda ps: torch.optim.SGD(
        ps, lr=1e-2, momentum=0.9, dampening=0.3, maximize=True
    ),  # fmt: skip
}
# bit for bit at R=1: the step's scalars are eager's doubles. RAdam and ASGD branch on the
# step count and so run torch's capturable path (float32 tensor scalars): an ulp off.
EXACT = {"adadelta", "rmsprop", "rmsprop_momentum", "rmsprop_centered_wd", "adagrad", "adamax",
         "rprop", "user_sign_momentum", "adam_amsgrad", "adamw_maximize", "sgd_maximize_dampening", "nadam", "nadam_decoupled", "adafactor",
         "adafactor_wd_maximize"}  # fmt: skip


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )  # fmt: skip


def batches(n=STEPS, size=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 12, generator=g), torch.randn(size, 4, generator=g))
            for _ in range(n)]  # fmt: skip


def compiled(make, R=1, GA=1, rts=None, state="on_chip"):
    m = model()
    opt = make(m.parameters())
    trainer = popxl.compile(m, F.mse_loss, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=rts, optimizer_state=state)  # fmt: skip
    return m, opt, trainer


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_captured_optimizer_matches_eager(kind, R, GA, rts, state):
    make = OPTIMIZERS[kind]
    m, opt, trainer = compiled(make, R, GA, rts, state)
    m_ref = model()
    opt_ref = make(m_ref.parameters())
    for x, y in batches():
        loss = trainer.step(x.numpy(), y.numpy())
        loss_ref = eager_step(m_ref, opt_ref, x, y)
        assert loss == pytest.approx(loss_ref, rel=1e-5)
    exact = R == 1 and GA == 1 and kind in EXACT
    assert_same_training(m, opt, m_ref, opt_ref, exact=exact)
    if rts is not None:  # the weights (512 elements) and state really were sharded
        assert any(s.sharded for s in trainer._active.slots)


def test_lr_scheduler_takes_effect_without_rebuild():
    make = OPTIMIZERS["adadelta"]
    m, opt, trainer = compiled(make, R=2, GA=2)
    m_ref = model()
    opt_ref = make(m_ref.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=2, gamma=0.1)
    irs = set()
    for x, y in batches(6):
        trainer.step(x.numpy(), y.numpy())
        eager_step(m_ref, opt_ref, x, y)
        sched.step()
        sched_ref.step()
        irs.add(id(trainer.ir))
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)  # 1.0 x 0.1^3
    assert len(irs) == 1, "an LR change must not rebuild the program"
    assert_same_training(m, opt, m_ref, opt_ref)


def test_lr_change_is_not_ignored():
    """The test above can fail: without the LR change the weights differ from eager's."""
    make = OPTIMIZERS["rmsprop"]
    m, opt, trainer = compiled(make)
    m_ref = model()
    opt_ref = make(m_ref.parameters())
    for i, (x, y) in enumerate(batches()):
        trainer.step(x.numpy(), y.numpy())
        eager_step(m_ref, opt_ref, x, y)
        if i == 1:
            opt_ref.param_groups[0]["lr"] = 0.1
    with pytest.raises(AssertionError):
        assert_same_training(m, opt, m_ref, opt_ref)


def test_other_hyperparameter_edit_rebuilds_and_carries_state():
    """A value that picks torch's code path (weight decay, momentum) is structure: changing it
    rebuilds the program, which starts from the state the old one left."""
    make = OPTIMIZERS["rmsprop_momentum"]
    m, opt, trainer = compiled(make, R=2, rts=16)
    m_ref = model()
    opt_ref = make(m_ref.parameters())
    for i, (x, y) in enumerate(batches(5)):
        if i == 2:
            for o in (opt, opt_ref):
                o.param_groups[0]["weight_decay"] = 0.05
                o.param_groups[0]["momentum"] = 0.7
        trainer.step(x.numpy(), y.numpy())
        eager_step(m_ref, opt_ref, x, y)
    assert_same_training(m, opt, m_ref, opt_ref)


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS[1:])
def test_state_dict_round_trip(R, GA, rts, state):
    make = OPTIMIZERS["nadam"]  # param-shaped and scalar state (mu_product)
    data = batches(5)
    m, opt, trainer = compiled(make, R, GA, rts, state)
    for x, y in data[:3]:
        trainer.step(x.numpy(), y.numpy())
    ckpt = copy.deepcopy(trainer.state_dict())
    assert set(ckpt["optimizer"]["state"]["0.weight"]) == {"exp_avg", "exp_avg_sq", "mu_product"}
    m2, opt2, trainer2 = compiled(make, R, GA, rts, state)
    trainer2.load_state_dict(ckpt)
    for x, y in data[3:]:
        trainer.step(x.numpy(), y.numpy())
        trainer2.step(x.numpy(), y.numpy())
    assert_same_training(m2, opt2, m, opt, exact=True)


def test_eager_state_loads_into_compiled_step():
    """torch's own optimizer.load_state_dict (an eager checkpoint) continues compiled."""
    make = OPTIMIZERS["adagrad"]
    data = batches(5)
    m_ref = model()
    opt_ref = make(m_ref.parameters())
    for x, y in data[:2]:
        eager_step(m_ref, opt_ref, x, y)
    m, opt, trainer = compiled(make, R=2, GA=1, rts=16, state="remote")
    m.load_state_dict(m_ref.state_dict())
    opt.load_state_dict(opt_ref.state_dict())
    for x, y in data[2:]:
        trainer.step(x.numpy(), y.numpy())
        eager_step(m_ref, opt_ref, x, y)
    assert_same_training(m, opt, m_ref, opt_ref)


@pytest.mark.parametrize(("R", "GA"), [(1, 1), (2, 2)])
def test_norm_reducing_optimizer_unsharded_matches_eager(R, GA):
    m, opt, trainer = compiled(NormalizedSGD, R, GA)
    m_ref = model()
    opt_ref = NormalizedSGD(m_ref.parameters())
    for x, y in batches():
        trainer.step(x.numpy(), y.numpy())
        eager_step(m_ref, opt_ref, x, y)
    assert_same_training(m, opt, m_ref, opt_ref, exact=R == 1 and GA == 1)


@pytest.mark.parametrize("state", ["on_chip", "remote"])
def test_norm_reducing_optimizer_sharded_matches_eager(state):
    """The norm of a sharded gradient is its shards' partial sums of squares, all-reduced
    (Note [whole-parameter reductions on shards]; LARS/LAMB and padded shards:
    tests/test_compile_norm_optimizers.py; a reduction over one dim is still refused there)."""
    m, opt, trainer = compiled(NormalizedSGD, R=2, rts=16, state=state)
    m_ref = model()
    opt_ref = NormalizedSGD(m_ref.parameters())
    for x, y in batches():
        trainer.step(x.numpy(), y.numpy())
        eager_step(m_ref, opt_ref, x, y)
    assert any(s.sharded for s in trainer._active.slots)
    assert_same_training(m, opt, m_ref, opt_ref)


def test_closure_optimizer_steps_in_torch_with_the_program_as_its_closure():
    # Note [optimizers that take a closure]; more in tests/test_compile_closure.py
    m, m_ref = model(), model()
    opt, opt_ref = torch.optim.LBFGS(m.parameters()), torch.optim.LBFGS(m_ref.parameters())
    trainer = popxl.compile(m, F.mse_loss, opt)
    for x, y in batches():

        def closure(x=x, y=y):
            opt_ref.zero_grad()
            loss = F.mse_loss(m_ref(x), y)
            loss.backward()
            return loss

        assert trainer.step(x.numpy(), y.numpy()) == opt_ref.step(closure).item()
    for p, q in zip(m.parameters(), m_ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_dynamic_loss_scaling_skips_captured_step():
    """An overflowing step leaves the parameters and the captured optimizer's state as they
    were (GradScaler skips optimizer.step())."""
    make = OPTIMIZERS["adamax"]
    m, opt, trainer = compiled(make)
    trainer = popxl.compile(m, F.mse_loss, opt, loss_scaling="dynamic")
    x, y = batches(1)[0]
    trainer.step(x.numpy(), y.numpy())
    before = {
        k: v.clone() for k, v in trainer.state_dict()["optimizer"]["state"]["0.weight"].items()
    }
    w = m[0].weight.detach().clone()
    bad = x.numpy().copy()
    bad[0, 0] = np.inf
    trainer.step(bad, y.numpy())
    assert torch.equal(m[0].weight.detach(), w)
    after = trainer.state_dict()["optimizer"]["state"]["0.weight"]
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert trainer.loss_scale == 2.0**15


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["adadelta", "rmsprop_momentum", "nadam", "adafactor"])
def test_half_precision_matches_eager_bit_for_bit(kind, dtype):
    """16-bit parameters and state: torch's own step rounds where eager rounds. Small integer
    data keep the gradients exact, so only the optimizer's arithmetic is compared."""
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4).to(dtype)
    m_ref = copy.deepcopy(m)
    opt, opt_ref = OPTIMIZERS[kind](m.parameters()), OPTIMIZERS[kind](m_ref.parameters())
    trainer = popxl.compile(m, F.mse_loss, opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randint(-2, 3, (16, 8), generator=g).to(dtype)
        y = torch.randint(-2, 3, (16, 4), generator=g).to(dtype)
        trainer.step(x, y)
        eager_step(m_ref, opt_ref, x, y)
    assert_same_training(m, opt, m_ref, opt_ref, exact=True)


def test_param_groups_with_their_own_values():
    def make(m):
        return torch.optim.RMSprop(
            [{"params": m[0].parameters(), "lr": 3e-3, "weight_decay": 0.1},
             {"params": m[2].parameters(), "momentum": 0.9, "centered": True}],
            lr=1e-2, eps=EPS,
        )  # fmt: skip

    m, m_ref = model(), model()
    opt, opt_ref = make(m), make(m_ref)
    trainer = popxl.compile(m, F.mse_loss, opt, replication_factor=2, gradient_accumulation=2,
                            rts_threshold=16, optimizer_state="remote")  # fmt: skip
    for x, y in batches():
        trainer.step(x.numpy(), y.numpy())
        eager_step(m_ref, opt_ref, x, y)
        for o in (opt, opt_ref):  # a manual LR change of one group
            o.param_groups[1]["lr"] *= 0.5
    assert_same_training(m, opt, m_ref, opt_ref)


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS[1:])
def test_adafactor_factored_state_round_trips(R, GA, rts, state):
    """Adafactor's state of other shapes than the parameter (a matrix's row and column
    variances) is torch's in checkpoints, and an eager optimizer's state continues
    compiled."""
    make = OPTIMIZERS["adafactor"]
    data = batches(6)
    m, opt, trainer = compiled(make, R, GA, rts, state)
    for x, y in data[:2]:
        trainer.step(x.numpy(), y.numpy())
    ckpt = copy.deepcopy(trainer.state_dict())
    shapes = {n: {k: tuple(v.shape) for k, v in st.items()}
              for n, st in ckpt["optimizer"]["state"].items()}  # fmt: skip
    assert shapes["0.weight"] == {"row_var": (32, 1), "col_var": (1, 12)}
    assert shapes["0.bias"] == {"variance": (32,)}
    m2, opt2, trainer2 = compiled(make, R, GA, rts, state)
    trainer2.load_state_dict(ckpt)
    m_ref = model()
    opt_ref = make(m_ref.parameters())
    for x, y in data[:2]:
        eager_step(m_ref, opt_ref, x, y)
    m3, opt3, trainer3 = compiled(make, R, GA, rts, state)
    m3.load_state_dict(m_ref.state_dict())
    opt3.load_state_dict(opt_ref.state_dict())
    for x, y in data[2:]:
        trainer.step(x.numpy(), y.numpy())
        trainer2.step(x.numpy(), y.numpy())
        trainer3.step(x.numpy(), y.numpy())
        eager_step(m_ref, opt_ref, x, y)
    assert_same_training(m2, opt2, m, opt, exact=True)
    assert_same_training(m3, opt3, m_ref, opt_ref)
