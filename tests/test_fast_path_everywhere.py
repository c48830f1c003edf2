"""Every example, benchmark model and the README's programs run on the fast path with nothing
written to stderr: each Session they create reports ``explain() == []`` after it runs (no
fragment under vmap at every step, no op run once per replica), and torch prints no
"performance drop" lines. The examples train a few steps only (accuracy is theirs to test).
The model zoo of benchmarks/bench_generality.py (Hugging Face families and torchvision CNNs)
trains with every fragment explicitly batched (Note [explicit batching]), the ops without a
stacked rule run alone through torch's batching rule, and its models without batch norm or
random draws train to eager torch's numbers that way.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl.runtime import session as _session

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_generality  # noqa: E402
import common  # noqa: E402
from optim_checks import train_both  # noqa: E402


@pytest.fixture
def slow_paths(monkeypatch):
    """What every Session run in the test reported off the fast path: {program: lines}."""
    found: dict[str, list[str]] = {}
    run = _session.Session._run

    def recording(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        lines = self.explain()
        if lines:
            found.setdefault(getattr(self.ir, "name", "ir"), []).extend(lines)
        return out

    monkeypatch.setattr(_session.Session, "_run", recording)
    return found


needs_mnist = pytest.mark.skipif(common.find_mnist() is None, reason="MNIST not found locally")

EXAMPLES = {
    "mnist": ["--quiet", "--max-steps", "3"],
    "mnist_rts": ["--quiet", "--max-steps", "3"],
    "mnist_compile": ["--quiet", "--max-steps", "3", "--no-chart"],  # writes nothing
    "mnist_phased": ["--quiet", "--limit-steps", "3"],
    "mnist_pipelined": ["--quiet", "--limit-batches", "3"],
    "addons_mnist_offchip": ["--limit-batches", "3"],
}


@needs_mnist
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs_on_the_fast_path(example, slow_paths, capfd):
    module = __import__(example)
    module.main(EXAMPLES[example])
    assert slow_paths == {}
    assert "performance drop" not in capfd.readouterr().err


@pytest.mark.parametrize("example", ["remote_buffer", "addons_remote_buffer"])
def test_remote_buffer_examples_run_on_the_fast_path(example, slow_paths, capfd, monkeypatch):
    monkeypatch.setattr(sys, "argv", [example])  # not pytest's arguments
    runpy.run_path(str(ROOT / "examples" / f"{example}.py"), run_name="__main__")
    assert slow_paths == {}
    assert capfd.readouterr().err == ""


def _models():
    import bench_gpt2
    import bench_peers
    import seed

    return {
        "seed": (seed.make_model, lambda n: (np.random.default_rng(0).normal(size=(n, 784))
                                             .astype(np.float32), np.arange(n) % 10),
                 torch.nn.functional.cross_entropy, 4, 2),
        "gpt2": (bench_gpt2.make_model, lambda n: (np.arange(n * 64).reshape(n, 64) % 1024,
                                                   np.arange(n * 64).reshape(n, 64) % 1024),
                 bench_gpt2.lm_loss, 2, 2),
        # Hugging Face GPT-2 with its default config: dropout, use_cache
        "hf_gpt2_default": (bench_peers._hf_gpt2().make_model,
                            lambda n: (np.arange(n * 64).reshape(n, 64) % 1024,
                                       np.arange(n * 64).reshape(n, 64) % 1024),
                            bench_peers._hf_gpt2().loss, 2, 2),
        "dropout_cnn": (bench_peers.DropoutCNN,
                        lambda n: (np.zeros((n, 1, 28, 28), np.float32), np.arange(n) % 10),
                        torch.nn.functional.cross_entropy, 2, 2),
    }  # fmt: skip


@pytest.mark.parametrize("layout", [{}, {"rts_threshold": 512, "optimizer_state": "remote"}],
                         ids=["on-chip", "remote+rts"])  # fmt: skip
@pytest.mark.parametrize("model", ["seed", "gpt2", "hf_gpt2_default", "dropout_cnn"])
def test_benchmark_models_train_on_the_fast_path(model, layout, capfd):
    make, batch, loss_fn, R, GA = _models()[model]
    torch.manual_seed(0)
    m = make()
    trainer = popxl.compile(m, loss_fn, torch.optim.AdamW(m.parameters(), 1e-3),
                            replication_factor=R, gradient_accumulation=GA, **layout)  # fmt: skip
    x, y = batch(R * GA * 2)
    assert np.isfinite(trainer.step(x, y))
    assert trainer.explain() == []
    assert capfd.readouterr().err == ""


# the ops each zoo model runs alone through torch's batching rule (Note [one op through
# torch's batching rule]); a model not listed has a stacked rule for every op
_VMAPPED_OPS = {
    "hf_swin": {"aten.roll.default", "aten.as_strided.default", "aten.index_put.default"},
    "convnext_tiny": {"aten.as_strided.default"},
    "efficientnet_b0": {"aten.new_empty_strided.default"},
}


@pytest.mark.parametrize("model", list(bench_generality.MODELS))
def test_model_zoo_trains_with_every_fragment_explicitly_batched(model, capfd):
    trainer, (x, y) = bench_generality.trainer(model)
    assert np.isfinite(trainer.step(x, y))
    assert bench_generality.fallbacks(trainer) == {}
    assert set(bench_generality.vmapped_ops(trainer)) == _VMAPPED_OPS.get(model, set())
    assert trainer.explain() == []
    assert "performance drop" not in capfd.readouterr().err


# without their random draws (stochastic depth): per-sample models, so R replicas' step on
# the global batch is eager torch's step on it
_DETERMINISTIC = {
    "hf_swin": {"drop_path_rate": 0.0},
    "convnext_tiny": {"stochastic_depth_prob": 0.0},
}


@pytest.mark.parametrize("model", list(_DETERMINISTIC))
def test_models_with_ops_run_through_vmap_alone_match_eager(model):
    spec = bench_generality.MODELS[model]()
    torch.manual_seed(0)
    m = spec.make(**_DETERMINISTIC[model])
    batches = [spec.batch(4), spec.batch(4)]
    trainer = train_both(m, spec.loss, batches, R=2, GA=1, lr=0.05, rtol=1e-4, atol=1e-5)
    assert bench_generality.fallbacks(trainer) == {}
    assert set(bench_generality.vmapped_ops(trainer)) == _VMAPPED_OPS[model]
