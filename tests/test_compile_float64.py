"""Note [float64 models] (compile_common.py): a model that holds float64 tensors computes in
float64 through ``popxl.compile`` as eager torch does: its inputs, its loss's bookkeeping, its
gradient reductions (Note [float64 collectives]) and its optimizer's scalars stay float64.

Claims: ``test_float64_efficientnet_trains_as_eager_float64`` (torchvision's EfficientNet
blocks, squeeze-excitation included, at R = 2: every step's loss and the final weights equal
eager float64's to 1e-12, which float32 anywhere on the path would miss by orders of
magnitude); ``test_float64_inference_matches_eager_float64``; and a float32 model keeps
narrowing numpy's float64 data to float32.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_popxl as popxl

torchvision = pytest.importorskip("torchvision")
from torchvision.models import efficientnet as _effnet  # noqa: E402

TOL = {"rtol": 1e-12, "atol": 1e-12}  # float64 rounding, summed in other orders


def _small_efficientnet() -> torch.nn.Module:
    """torchvision's EfficientNet with two of b0's MBConv stages (depthwise convolutions,
    squeeze-excitation, SiLU, batch norm), small enough for a test."""
    torch.manual_seed(0)
    stages = [_effnet.MBConvConfig(1, 3, 1, 32, 16, 1), _effnet.MBConvConfig(6, 3, 2, 16, 24, 1)]
    return _effnet.EfficientNet(stages, dropout=0.0, stochastic_depth_prob=0.0, num_classes=10)


def _eager_step(model, opt, x, y, R: int, loss_fn) -> float:
    """One eager step of the replicated program: each replica's batch norm sees its own
    micro-batch, the loss is the global batch's (Note [exact losses over micro-batches])."""
    opt.zero_grad()
    loss = loss_fn(torch.cat([model(xc) for xc in x.chunk(R)]), y)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("ignore_index", [-100, 0], ids=["mean", "counted_mean"])
def test_float64_efficientnet_trains_as_eager_float64(ignore_index):
    R, steps = 2, 3
    model = _small_efficientnet().double()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, R * 4, 3, 16, 16, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (steps, R * 4), generator=g)

    def loss_fn(out, t):
        return F.cross_entropy(out, t, ignore_index=ignore_index)

    trainer = popxl.compile(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1,
                                                            momentum=0.9),
                            replication_factor=R)  # fmt: skip
    opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        got = trainer.step(x[s], y[s])
        want = _eager_step(eager, opt, x[s], y[s], R, loss_fn)
        assert got == pytest.approx(want, rel=1e-12), s
    trainer.sync_weights()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert p.dtype == torch.float64, name
        torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=name)


def test_float64_inference_matches_eager_float64():
    model = _small_efficientnet().double().eval()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = popxl.compile(model, replication_factor=2)(x)
    with torch.no_grad():
        want = model(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, **TOL)


def test_a_float32_model_narrows_numpy_float64_data():
    # numpy's default float64 data trains a float32 model as its float32 values do
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    eager = copy.deepcopy(model)
    x = np.random.default_rng(0).normal(size=(4, 3))
    y = np.array([0, 1, 1, 0])
    trainer = popxl.compile(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    got = trainer.step(x, y)
    want = F.cross_entropy(eager(torch.from_numpy(x).float()), torch.from_numpy(y))
    assert got == pytest.approx(want.item(), rel=1e-6)
