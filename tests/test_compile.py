"""popxl.compile parity with eager torch: same weights and losses after N steps.

Tolerance: float32 programs whose reductions run in a different order (per replica, per
micro-batch) than eager torch; parameters agree to rtol 2e-4 / atol 2e-5 after a few steps.
"""

import copy
import itertools

import numpy as np
import pytest
import torch

import torch_popxl as popxl

RTOL, ATOL = 2e-4, 2e-5


class TinyTransformerBlock(torch.nn.Module):
    def __init__(self, d=16, heads=2, classes=4):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm1 = torch.nn.LayerNorm(d)
        self.ff = torch.nn.Sequential(
            torch.nn.Linear(d, 32), torch.nn.GELU(), torch.nn.Linear(32, d)
        )
        self.norm2 = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x):
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.norm1(x + a)
        x = self.norm2(x + self.ff(x))
        return self.head(x.mean(dim=1))


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))  # fmt: skip


def cnn():  # no conv bias: BatchNorm makes its gradient exactly zero (Adam would amplify noise)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(4 * 3 * 3, 4),
    )  # fmt: skip


SHAPES = {"mlp": (12,), "cnn": (1, 8, 8), "transformer": (5, 16)}
MODELS = {"mlp": mlp, "cnn": cnn, "transformer": TinyTransformerBlock}


def _batches(kind, n_steps, batch, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(batch, *SHAPES[kind])).astype(np.float32), rng.integers(0, 4, batch))
            for _ in range(n_steps)]  # fmt: skip


def _eager_steps(model, opt, batches, R, GA):
    """Eager torch on the same schedule: each (replica, micro-batch) chunk separately, mean of
    their gradients, one optimizer step (identical to the global batch except for BatchNorm)."""
    losses = []
    for x, y in batches:
        opt.zero_grad()
        chunks = R * GA
        total = 0.0
        for xc, yc in zip(np.split(x, chunks), np.split(y, chunks), strict=True):
            loss = torch.nn.functional.cross_entropy(
                model(torch.from_numpy(xc)), torch.from_numpy(yc)
            )
            (loss / chunks).backward()
            total += loss.item() / chunks
        opt.step()
        losses.append(total)
    return losses


def _assert_same_params(trained, ref):
    for (n, p), (_, q) in zip(trained.named_parameters(), ref.named_parameters(), strict=True):
        np.testing.assert_allclose(
            p.detach().numpy(), q.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=n
        )


def _parity(kind, R, GA, rts, state, make_opt, steps=3, batch=16):
    torch.manual_seed(0)
    model = MODELS[kind]()
    ref = copy.deepcopy(model)
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy, make_opt(model.parameters()),
                            replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if rts else None, optimizer_state=state)  # fmt: skip
    batches = _batches(kind, steps, batch)
    losses = [trainer.step(x, y) for x, y in batches]
    ref_losses = _eager_steps(ref, make_opt(ref.parameters()), batches, R, GA)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    _assert_same_params(model, ref)  # model parameters reflect training (lazy sync)
    return trainer


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


LAYOUTS = [c for c in itertools.product((1, 2, 4), (1, 4), (False, True), ("on_chip", "remote"))
           if not (c[0] == 1 and c[2])]  # RTS needs replicas  # fmt: skip


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# The transformer trains with SGD, not Adam: the attention key bias has a mathematically zero
# gradient (softmax is shift invariant), and Adam would turn its rounding noise into
# full-size steps. The CNN's conv has no bias for the same reason (BatchNorm follows it).
OPTIMIZER_FOR = {"mlp": adam, "cnn": adam, "transformer": sgd_momentum}


@pytest.mark.parametrize("R,GA,rts,state", LAYOUTS)
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_model_matches_eager_for_every_layout(kind, R, GA, rts, state):
    _parity(
        kind,
        R,
        GA,
        rts,
        state,
        OPTIMIZER_FOR[kind],
        batch=16 if kind != "transformer" else 8 * max(R, 1),
    )


@pytest.mark.parametrize("GA", [1, 2])
def test_cnn_with_batchnorm_matches_eager_including_running_stats(GA):
    trainer = _parity("cnn", 1, GA, False, "on_chip", adam)
    ref_model = trainer.model
    assert ref_model[1].num_batches_tracked.item() == 3 * GA


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.3),
    lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2),
    lambda p: torch.optim.AdamW(p, lr=1e-2),
], ids=["sgd", "sgd_momentum_wd", "sgd_nesterov", "sgd_dampening", "adam_wd", "adamw"])  # fmt: skip
def test_optimizer_formulas_match_torch(make_opt):
    _parity("mlp", 2, 2, True, "on_chip", make_opt, steps=4)


def test_state_dict_round_trip_restores_training_exactly():
    torch.manual_seed(0)
    batches = _batches("mlp", 4, 16)

    def trainer_for(model):
        return popxl.compile(model, torch.nn.functional.cross_entropy, adam(model.parameters()),
                             replication_factor=4, rts_threshold=64, optimizer_state="remote")  # fmt: skip

    a = trainer_for(mlp())
    for x, y in batches[:2]:
        a.step(x, y)
    ckpt = a.state_dict()
    assert ckpt["optimizer"]["step"] == 2
    assert ckpt["optimizer"]["state"]["0.weight"]["exp_avg"].shape == (32, 12)  # unsharded
    later_a = [a.step(x, y) for x, y in batches[2:]]

    b = trainer_for(mlp())
    b.step(*batches[0])  # build, then restore the checkpoint over it
    b.load_state_dict(ckpt)
    later_b = [b.step(x, y) for x, y in batches[2:]]
    assert later_a == later_b
    _assert_same_params(a.model, b.model)

    c = trainer_for(mlp())
    c.load_state_dict(ckpt)  # before the first step: applied when the program is built
    later_c = [c.step(x, y) for x, y in batches[2:]]
    assert later_a == later_c
    _assert_same_params(a.model, c.model)


def test_memory_report_shows_sharding_and_offchip_savings_and_matches_allocations():
    def build(rts, state):
        torch.manual_seed(0)
        model = mlp()
        t = popxl.compile(model, torch.nn.functional.cross_entropy, adam(model.parameters()),
                          replication_factor=4, rts_threshold=64 if rts else None, optimizer_state=state)  # fmt: skip
        t.step(*_batches("mlp", 1, 16)[0])
        return t, t.memory_report()

    (_, on_chip), (t_sharded, sharded), (t_off, offchip) = (
        build(False, "on_chip"),
        build(True, "on_chip"),
        build(True, "remote"),
    )
    assert sharded.on_chip_bytes < on_chip.on_chip_bytes
    assert offchip.on_chip_bytes < sharded.on_chip_bytes
    assert offchip.streaming_bytes > 0 and on_chip.streaming_bytes == 0
    # The report's per-replica figures are the simulator's real allocations divided by R.
    state = t_sharded.session._state
    shard_bytes = sum(t.numel() * t.element_size() for t in state.persistent.values())
    assert sharded.rts_shard_bytes * 4 == shard_bytes
    buffers = t_off.session._state.buffers.values()
    assert offchip.streaming_bytes * 4 == sum(b.numel() * b.element_size() for b in buffers)


def test_inference_program_matches_eager_and_splits_over_replicas():
    torch.manual_seed(0)
    model = mlp().eval()
    x = np.random.default_rng(0).normal(size=(8, 12)).astype(np.float32)
    for R in (1, 4):
        out = popxl.compile(model, replication_factor=R)(x)
        np.testing.assert_allclose(
            out.numpy(), model(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6
        )


def test_bad_input_gives_clear_errors():
    model = mlp()
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer"):
        popxl.compile(model, torch.nn.functional.cross_entropy, object())
    with pytest.raises(ValueError, match="optimizer_state"):
        popxl.compile(
            model,
            torch.nn.functional.cross_entropy,
            adam(model.parameters()),
            optimizer_state="disk",
        )
    with pytest.raises(ValueError, match="a loss_fn without an optimizer"):
        popxl.compile(model, torch.nn.functional.cross_entropy)
    # 13 samples on 2 replicas are padded (Note [padded rows]), which BatchNorm in training
    # mode would see (12 would run as 2 x 2 micro-batches of 3)
    normed = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.BatchNorm1d(8),
                                 torch.nn.Linear(8, 4))  # fmt: skip
    t = popxl.compile(normed, torch.nn.functional.cross_entropy, adam(normed.parameters()),
                      replication_factor=2, gradient_accumulation=4)  # fmt: skip
    x, y = _batches("mlp", 1, 13)[0]
    with pytest.raises(ValueError, match="13 samples does not split into equal shares for the "
                       "replication_factor = 2 replicas"):  # fmt: skip
        t.step(x, y)

    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(12, 4)

        def forward(self, x):
            y = self.lin(x)
            return y * y.unique().numel()  # a data-dependent shape

    m = DataDependent()
    t = popxl.compile(m, torch.nn.functional.cross_entropy, adam(m.parameters()))
    with pytest.raises(popxl.errors.DataDependentError, match="torch.where"):
        t.step(*_batches("mlp", 1, 8)[0])
