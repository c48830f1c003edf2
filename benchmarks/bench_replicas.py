"""R=4 replicas of a 4-layer MLP training step (micro-batch 8 each) versus eager torch on the
same global batch of 32, side by side.

The simulated step: forward, autodiff backward, mean all-reduce of every gradient across the
replicas, SGD update. The eager step: forward on the 32 samples, backward, SGD.
Prints ms per step and the ratio ``eager / simulator`` (>= 1: the simulator is as fast).
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
from torch_popxl.transforms import autodiff  # noqa: E402

SIZES = (784, 512, 512, 512, 10)
R, MICRO, LR = 4, 8, 0.01


def build(w_init):
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        ws = [popxl.variable(w, name=f"w{i}") for i, w in enumerate(w_init)]
        xs = popxl.h2d_stream((MICRO, SIZES[0]), popxl.float32, "x")
        ls = popxl.h2d_stream((MICRO,), popxl.int32, "labels")

        def net(x, *ws):
            for i, w in enumerate(ws):
                x = x @ w
                if i < len(ws) - 1:
                    x = torch.nn.functional.gelu(x)
            return x

        fwd = ir.create_graph(net, popxl.TensorSpec((MICRO, SIZES[0]), popxl.float32), *ws)
        bwd = autodiff(fwd, grads_provided=fwd.outputs[:1], grads_required=list(fwd.inputs[1:]))
        info = ops.call_with_info(fwd, ops.host_load(xs), *ws)
        loss, dy = ops.nll_loss_with_softmax_grad(
            ops.softmax(info.outputs[0], axis=1), ops.host_load(ls)
        )
        grads = ops.call(bwd.graph, dy, inputs_dict=bwd.inputs_dict(info))
        for w, g in zip(ws, grads, strict=True):
            ops.scaled_add_(w, ops.collectives.replicated_all_reduce(g, op="mean"), b=-LR)
        out = popxl.d2h_stream(loss.shape, loss.dtype, "loss")
        ops.host_store(out, loss)
    return ir, xs, ls


def main(repeats: int = 20) -> float:
    rng = np.random.default_rng(0)
    w_init = [
        rng.normal(size=(a, b)).astype(np.float32) * 0.05
        for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)
    ]
    x = rng.normal(size=(R * MICRO, SIZES[0])).astype(np.float32)
    y = rng.integers(0, 10, size=R * MICRO).astype(np.int32)
    ir, xs, ls = build(w_init)
    session = popxl.Session(ir, "ipu_hw")
    params = [torch.tensor(w, requires_grad=True) for w in w_init]
    opt = torch.optim.SGD(params, lr=LR)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()

    def eager():
        opt.zero_grad()
        h = xt
        for i, w in enumerate(params):
            h = h @ w
            if i < len(params) - 1:
                h = torch.nn.functional.gelu(h)
        torch.nn.functional.cross_entropy(h, yt).backward()
        opt.step()

    inputs = {xs: x.reshape(R, MICRO, -1), ls: y.reshape(R, MICRO)}
    with session:
        t = interleaved({"eager": eager, "simulator": lambda: session.run(inputs)}, repeats)
    ratio = t["eager"] / t["simulator"]
    print(f"training step, {R} replicas x micro-batch {MICRO} vs eager batch {R * MICRO}: "
          f"eager {t['eager'] * 1e3:.2f} ms, simulator {t['simulator'] * 1e3:.2f} ms, "
          f"ratio eager/simulator = {ratio:.3f}")  # fmt: skip
    return ratio


if __name__ == "__main__":
    main(rounds_cli(__doc__, {"rounds": 20}).rounds)
