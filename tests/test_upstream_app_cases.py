"""Capture and autodiff cases Graphcore's PopXL applications rely on (nlp/gpt3_2.7B TP, BERT,
GPT-3 175B), each as upstream PopXL defines it, checked against eager torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.transforms import autodiff

RNG = np.random.default_rng(0)


def _run(ir, executor):
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        return session.run()


def _store(t):
    s = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(s, t)
    return s


# ---- (a) autodiff of a graph whose calls compute values the gradient needs -----------------
# Upstream (popart python/popxl/popxl/transforms/autodiff.py, PopART's Autodiff) differentiates
# a called graph along with its caller: values computed inside the callee that the gradient
# needs become callee outputs (and so call outputs) that the gradient graph takes as Fwd inputs.
# GPT-3 2.7B TP's model graph calls its layer graphs this way.


def _inner(x: popxl.Tensor, w: popxl.Tensor) -> popxl.Tensor:
    return ops.gelu(x @ w)


def _nested(x: popxl.Tensor, w: popxl.Tensor) -> popxl.Tensor:
    g = popxl.gcg().ir.create_graph(_inner, x, w)
    (y,) = ops.call(g, x, w)
    return ops.tanh(y) * y


def _outer(x: popxl.Tensor, w: popxl.Tensor, v: popxl.Tensor) -> popxl.Tensor:
    ir = popxl.gcg().ir
    inner = ir.create_graph(_inner, x, w)
    (h,) = ops.call(inner, x, w)  # one call site ...
    (h2,) = ops.call(inner, h, v)  # ... and a second of the same graph
    nested = ir.create_graph(_nested, h2, v)  # and a callee two levels deep
    (y,) = ops.call(nested, h2, v)
    return ops.reduce_sum(ops.gelu(y) * h)


def _torch_outer(x, w, v):
    gelu = lambda t: torch.nn.functional.gelu(t, approximate="tanh")  # noqa: E731  (popxl gelu)
    h = gelu(x @ w)
    h2 = gelu(h @ v)
    z = gelu(h2 @ v)
    y = torch.tanh(z) * z
    return (gelu(y) * h).sum()


@pytest.mark.parametrize(
    "autodiff_first", [True, False], ids=["autodiff-then-call", "call-then-autodiff"]
)
@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_autodiff_reads_values_computed_inside_called_graphs(executor, autodiff_first):
    x = RNG.normal(size=(4, 8)).astype(np.float32)
    w = RNG.normal(size=(8, 8)).astype(np.float32) * 0.3
    v = RNG.normal(size=(8, 8)).astype(np.float32) * 0.3
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        ts = [popxl.variable(a, name=n) for a, n in ((x, "x"), (w, "w"), (v, "v"))]
        fwd = ir.create_graph(_outer, *[t.spec for t in ts])
        if autodiff_first:  # as the apps: create_graph, autodiff, then the calls
            bwd = autodiff(fwd)
            info = ops.call_with_info(fwd, *ts)
        else:  # the call site gets the new outputs when autodiff adds them
            info = ops.call_with_info(fwd, *ts)
            bwd = autodiff(fwd)
        grads = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
        streams = [_store(t) for t in (info.outputs[0], *grads)]
    out = _run(ir, executor)

    xs = [torch.tensor(a, requires_grad=True) for a in (x, w, v)]
    y = _torch_outer(*xs)
    y.backward()
    np.testing.assert_allclose(out[streams[0]], y.detach().numpy(), rtol=1e-5)
    for s, ref in zip(streams[1:], xs, strict=True):
        np.testing.assert_allclose(out[s], ref.grad.numpy(), rtol=1e-4, atol=1e-5)
