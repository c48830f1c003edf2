"""Note [optimizer arithmetic as torch rounds it]: given the same gradients, a compiled
optimizer step equals eager torch's bit for bit (SGD with momentum, dampening, Nesterov and
weight decay; Adam with L2 weight decay; AdamW), for float32 and 16-bit parameters, with 1 or
2 replicas, explicitly batched or under vmap; and the scalar-tensor ops it uses equal torch's
in-place ops with a Python number."""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl.opdefs import scalar_tensor
from torch_popxl.runtime import explicit as _explicit
from torch_popxl.runtime import gemm

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, 1e-2),
    "adam_l2": lambda ps: torch.optim.Adam(ps, 1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, 3e-3, weight_decay=0.05, eps=1e-6),
    "sgd": lambda ps: torch.optim.SGD(ps, 0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, 1e-2, momentum=0.9),
    "sgd_nesterov_wd": lambda ps: torch.optim.SGD(
        ps, 1e-2, momentum=0.9, nesterov=True, weight_decay=0.01
    ),  # fmt: skip
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, 1e-2, momentum=0.8, dampening=0.3),
}


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Linear(48, 32).to(dtype)


def _loss(out, target):
    # A mean over 2^k elements of small integers times integer inputs: every gradient is a
    # short binary fraction, exact in any summation order (and in bf16 / fp16 for these sizes),
    # so the optimizers see identical gradients and only their arithmetic is compared.
    return (out * target).mean()


def _data(dtype, steps=4):
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        x = rng.integers(-3, 4, size=(16, 48)).astype(np.float32)
        y = rng.integers(-2, 3, size=(16, 32)).astype(np.float32)
        batches.append((x, y))
    return batches


def _compare(kind, dtype, R):
    compiled, eager = _model(dtype), _model(dtype)
    trainer = popxl.compile(compiled, _loss, OPTIMIZERS[kind](compiled.parameters()),
                            replication_factor=R)  # fmt: skip
    opt = OPTIMIZERS[kind](eager.parameters())
    for x, y in _data(dtype):
        trainer.step(x.astype(_np(dtype)), y.astype(_np(dtype)))
        opt.zero_grad()
        _loss(eager(torch.from_numpy(x).to(dtype)), torch.from_numpy(y).to(dtype)).backward()
        opt.step()
    for got, want in zip(compiled.parameters(), eager.parameters(), strict=True):
        # (fp16 Adam: eps=1e-8 is 0 in float16, so a zero gradient gives 0/0 in both)
        torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=0, equal_nan=True)
    return trainer


def _np(dtype):
    return np.float32 if dtype == torch.float32 else np.float16 if dtype == torch.float16 else None


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("R", [1, 2])
def test_the_compiled_update_equals_eager_bit_for_bit(kind, R):
    trainer = _compare(kind, torch.float32, R)
    if R > 1:
        assert all(fn.explicit for fn in trainer.session._executor.fns.values())


@pytest.mark.parametrize("kind", ["adam_l2", "adamw", "sgd_nesterov_wd"])
def test_the_compiled_update_under_vmap_equals_eager_bit_for_bit(kind, monkeypatch):
    monkeypatch.setattr(_explicit, "vmap_reason", lambda *a: "forced by the test")
    trainer = _compare(kind, torch.float32, 2)
    assert not any(fn.explicit for fn in trainer.session._executor.fns.values())


@pytest.mark.parametrize("kind", ["adam_l2", "adamw", "sgd_nesterov_wd"])
def test_the_compiled_16_bit_update_equals_eager_bit_for_bit(kind):
    _compare(kind, torch.float16, 1)


# ---- the scalar-tensor ops -------------------------------------------------------------------

OPS = {
    "addcmul": (scalar_tensor.addcmul_value_, lambda s, a, b, v: s.addcmul_(a, b, value=v), 3),
    "addcdiv": (scalar_tensor.addcdiv_value_, lambda s, a, b, v: s.addcdiv_(a, b, value=v), 3),
    "add": (scalar_tensor.add_alpha_, lambda s, a, v: s.add_(a, alpha=v), 2),
}


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_op_equals_torchs_in_place_op_with_a_number(name, dtype):
    op, eager, n = OPS[name]
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(1000, generator=g).to(dtype) + (3 if i == n - 1 else 0)
               for i in range(n)]  # fmt: skip
    value = torch.tensor(-0.0123, dtype=torch.float32)
    want = tensors[0].clone()
    eager(want, *tensors[1:], value.item())
    got = tensors[0].clone()
    op(got, *tensors[1:], value)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(OPS))
def test_under_vmap_a_shared_or_per_replica_scalar_updates_each_row(name):
    op, eager, n = OPS[name]
    g = torch.Generator().manual_seed(2)
    rows = [torch.randn(3, 5, 4, generator=g) + (3 if i == n - 1 else 0) for i in range(n)]
    shared = torch.randn(4, generator=g)  # replica-invariant, broadcast over rows and dim 0
    for values in (torch.tensor(0.5), torch.tensor([0.5, -1.0, 2.0])):
        got = rows[0].clone()

        def f(s, *rest):
            op(s, *rest)
            return s

        in_dims = (0, *[0] * (n - 2), None, 0 if values.dim() else None)
        torch.func.vmap(f, in_dims=in_dims)(got, *rows[1 : n - 1], shared, values)
        for r in range(3):
            want = rows[0][r].clone()
            v = values[r] if values.dim() else values
            eager(want, *[t[r] for t in rows[1 : n - 1]], shared, v.item())
            assert torch.equal(got[r], want)


def test_a_scalar_of_several_elements_is_refused_with_its_shape():
    with pytest.raises(ValueError, match=r"one-element scalar tensor, got shape \(2,\)"):
        scalar_tensor.add_alpha_(torch.zeros(3), torch.ones(3), torch.ones(2))


def test_under_vmap_a_shared_target_with_a_per_replica_update_is_refused():
    def f(s, o):
        scalar_tensor.add_alpha_(s, o, torch.tensor(1.0))
        return s

    with pytest.raises(ValueError, match="same on every replica but the update differs"):
        torch.func.vmap(f, in_dims=(None, 0))(torch.zeros(4), torch.ones(2, 4))


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd_nesterov_wd"])
def test_one_replica_training_equals_the_eager_loop_bit_for_bit(kind):
    """With one replica and no accumulation the compiled step runs eager's very ops in eager's
    order: an MLP with GELU and cross-entropy trains to the same bits, with torch's own matmul
    kernel (``gemm.using("aten")``; oneDNN's differs in rounding, Note [gemm kernel])."""

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(40, 128), torch.nn.GELU(), torch.nn.Linear(128, 5)
        )

    rng = np.random.default_rng(0)
    compiled, eager = mlp(), mlp()
    loss = torch.nn.functional.cross_entropy
    trainer = popxl.compile(compiled, loss, OPTIMIZERS[kind](compiled.parameters()))
    opt = OPTIMIZERS[kind](eager.parameters())
    for _ in range(3):
        x = rng.normal(size=(32, 40)).astype(np.float32)
        y = rng.integers(0, 5, 32)
        with gemm.using("aten"):
            got = trainer.step(x, y)
        opt.zero_grad()
        want = loss(eager(torch.from_numpy(x)), torch.from_numpy(y))
        want.backward()
        opt.step()
        assert got == want.item()
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
