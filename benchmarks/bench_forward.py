"""Captured 4-layer MLP forward (batch 256): fast executor versus eager torch, side by side.

Run: ``.venv/bin/python benchmarks/bench_forward.py``. Prints ms per call and the ratio
``eager / executor`` (>= 1 means the executor is at least as fast as eager).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
import torch_popxl.ops as ops  # noqa: E402
from timing import interleaved, rounds_cli  # noqa: E402

BATCH, SIZES = 256, (784, 512, 512, 512, 10)


def build(model: torch.nn.Module):
    ir = popxl.Ir()
    with ir.main_graph:
        x_stream = popxl.h2d_stream((BATCH, SIZES[0]), popxl.float32, "x")
        y = model(ops.host_load(x_stream))
        y_stream = popxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(y_stream, y)
    return ir, x_stream, y_stream


def main(repeats: int = 30) -> float:
    torch.manual_seed(0)
    layers = []
    for a, b in zip(SIZES[:-1], SIZES[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers[:-1])
    ir, x_stream, y_stream = build(model)
    session = popxl.Session(ir, "ipu_model")
    x = np.random.default_rng(0).normal(size=(BATCH, SIZES[0])).astype(np.float32)
    xt = torch.from_numpy(x)
    with session, torch.no_grad():
        out = session.run({x_stream: x})[y_stream]
        np.testing.assert_allclose(out, model(xt).numpy(), rtol=1e-4, atol=1e-5)

        def eager():
            return model(torch.from_numpy(x)).numpy()

        ins = [session._input_tensor(x_stream, x, True)]

        def executor():  # the generated program on the stacked input (what the executor adds)
            return session._executor.run(session._state, "normal", ins, 1)

        def session_run():  # plus host-side work: validating, converting and copying arrays
            return session.run({x_stream: x})[y_stream]

        t = interleaved({"eager": eager, "executor": executor, "session.run": session_run}, repeats)
    ratio = t["eager"] / t["executor"]
    print(f"4-layer MLP forward, batch {BATCH}: eager {t['eager'] * 1e3:.2f} ms, "
          f"executor {t['executor'] * 1e3:.2f} ms, session.run {t['session.run'] * 1e3:.2f} ms; "
          f"ratio eager/executor = {ratio:.3f}, eager/session.run = {t['eager'] / t['session.run']:.3f}")  # fmt: skip
    return ratio


if __name__ == "__main__":
    main(rounds_cli(__doc__, {"rounds": 30}).rounds)
