"""examples/mnist_pipelined.py: the pipelining tutorial's program trains MNIST and prints the
per-IPU memory and the ipu_copy traffic of its pipeline.

The full epoch (2000 steps of 30 samples) reaches 96.9 % but takes minutes on a shared
2-core machine, so the test trains 300 steps; the figures of the report are checked against
hand-computed sizes on random data (no MNIST needed)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import common  # noqa: E402
import mnist_pipelined  # noqa: E402

F32, F16, U32 = 4, 2, 4


@pytest.mark.skipif(
    common.find_mnist() is None,
    reason="MNIST not found locally: set TORCH_POPXL_MNIST_DIR to a directory with the four "
    "MNIST files (tests do not download)",
)
def test_pipelined_mnist_trains_and_prints_the_per_ipu_report(capsys):
    accuracy = mnist_pipelined.main(["--quiet", "--limit-batches", "300"])
    assert accuracy >= 90.0  # 300 of 2000 steps (about 92 %); the full epoch reaches about 97 %
    out = capsys.readouterr().out
    report = out[out.index("Memory per replica") :]
    assert "On chip per IPU (one replica)" in report
    assert "IPU 0" in report and "IPU 1" in report
    assert "IPU links (popxl.ipu placement)" in report and "ipu_copy" in report


def test_the_report_gives_each_ipus_variables_stash_and_the_pipeline_copies():
    opts = mnist_pipelined.parse_args([])  # micro batch 5, 6 micro batches, recomputation
    session, streams, _, loss_stream = mnist_pipelined.train_program(opts)
    rng = np.random.default_rng(0)
    data = rng.normal(size=(6, 5, 784)).astype(np.float32)
    labels = rng.integers(0, 10, (6, 5)).astype(np.int32)
    with session:
        loss = session.run({streams[0]: data, streams[1]: labels})[loss_stream]
    assert loss.shape == (6,) and np.all(np.isfinite(loss))
    report = session.memory_report()

    # Two copies per cycle (forward activations to IPU 1, gradients back to IPU 0) of one
    # [5, 512] float32 micro batch, in every cycle but the last: steps + stages - 2 = 7.
    assert report.op_counts["ipu_copy"] == 2 * 7
    assert report.traffic["ipu_copy"] == 2 * 7 * 5 * 512 * F32

    ipu0 = 784 * 512 + 512 + 512 * 512 + 512  # fc1, fc2 parameters
    ipu1 = 512 * 512 + 512 + 512 * 10 + 10  # fc3, fc4 parameters

    def state(params: int) -> int:
        # weights, gradient accumulators, 2 accumulation counters, Adam moments (float16 first,
        # float32 second) and 4 Adam step counters
        return params * F32 * 2 + 2 * F32 + params * (F16 + F32) + 4 * F32

    # With recomputation the backward needs only the layers' inputs: the image [5, 784] and
    # fc1's output [5, 512], each stashed in 3 slots (stage 2 - stage 0 + 1) with a uint32
    # counter for the stash and one for the restore.
    stash = 3 * 5 * 784 * F32 + 3 * 5 * 512 * F32 + 4 * U32
    per_ipu = {m.ipu: m for m in report.ipu_memory}
    assert per_ipu[0].variable_bytes == state(ipu0) + stash
    assert per_ipu[1].variable_bytes == state(ipu1)
    assert per_ipu[0].peak_intermediate_bytes > 0 and per_ipu[1].peak_intermediate_bytes > 0


def test_the_pipelined_training_steps_match_eager_torch():
    # Two steps of 6 micro batches: every micro batch's loss equals eager torch's on the same
    # weights, and the first step's update equals Adam on the mean of the 6 gradients.
    opts = mnist_pipelined.parse_args([])
    session, streams, variables, loss_stream = mnist_pipelined.train_program(opts)
    rng = np.random.default_rng(1)
    batches = [
        (rng.normal(size=(6, 5, 784)).astype(np.float32), rng.integers(0, 10, (6, 5)).astype(np.int32))
        for _ in range(2)
    ]  # fmt: skip
    with session:
        start = session.get_tensors_data(variables.tensors)
        named = dict(variables.named_tensors)
        params = {k: torch.tensor(start[t]) for k, t in named.items()}
        losses = []
        for i, (data, labels) in enumerate(batches):
            losses.append(session.run({streams[0]: data, streams[1]: labels})[loss_stream])
            if i == 0:
                after_one = {k: session.get_tensor_data(t).copy() for k, t in named.items()}

    def forward(p, x):
        for i in (1, 2, 3):
            x = torch.nn.functional.gelu(
                x @ p[f"fc{i}.weight"] + p[f"fc{i}.bias"], approximate="tanh"
            )
        return x @ p["fc4.weight"] + p["fc4.bias"]

    def step_losses_and_grads(p, data, labels):
        p = {k: v.clone().requires_grad_() for k, v in p.items()}
        out, grads = [], {k: torch.zeros_like(v) for k, v in p.items()}
        for x, y in zip(torch.tensor(data), torch.tensor(labels).long(), strict=True):
            loss = torch.nn.functional.cross_entropy(forward(p, x), y)
            out.append(loss.item())
            for k, g in zip(p, torch.autograd.grad(loss, list(p.values())), strict=True):
                grads[k] += g / len(data)
        return np.array(out), grads

    eager_losses, grads = step_losses_and_grads(params, *batches[0])
    np.testing.assert_allclose(losses[0], eager_losses, rtol=1e-5)
    # Adam's first step, bias corrected: m_hat = g, v_hat = g^2, w -= lr g / (|g| + eps). The
    # first moment is float16 (the tutorial's optimizer): close where |g| is well inside its
    # range (to float16 precision, 0.2 % of a step), within 10 % of a step where it rounds tiny
    # gradients.
    checked = 0
    for k, g in grads.items():
        expected = (params[k] - opts.lr * g / (g.abs() + 1e-5)).numpy()
        np.testing.assert_allclose(after_one[k], expected, atol=opts.lr * 0.1)
        large = (g.abs() > 1e-3).numpy()  # 0.1 g is a normal float16 number
        np.testing.assert_allclose(
            after_one[k][large], expected[large], rtol=0, atol=opts.lr * 2e-3
        )
        checked += int(large.sum())
    assert checked > 1000
    eager_losses, _ = step_losses_and_grads(
        {k: torch.tensor(v) for k, v in after_one.items()}, *batches[1]
    )
    np.testing.assert_allclose(losses[1], eager_losses, rtol=1e-5)
