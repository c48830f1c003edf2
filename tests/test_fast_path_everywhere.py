"""Every example, benchmark model and the README's programs run on the fast path with nothing
written to stderr: each Session they create reports ``explain() == []`` after it runs (no
fragment under vmap at every step, no op run once per replica), and torch prints no
"performance drop" lines. The examples train a few steps only (accuracy is theirs to test).
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

import common  # noqa: E402


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
