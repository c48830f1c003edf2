"""AdamOptimizerStep numerics as upstream (popxl-addons 3.4 optimizers/adam.py) against a
hand-written numpy Adam: default float16 first moment, bias correction, decoupled weight decay,
loss scaling and global-norm clipping, over several steps."""

from __future__ import annotations

import numpy as np
import pytest

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.addons.optimizers.adam import AdamOptimizerStep


def numpy_adam(w, grads, *, lr, beta1=0.9, beta2=0.999, eps=1e-5, weight_decay=1e-2,
               first_order_dtype=np.float16, bias_correction=True, loss_scaling=1.0,
               global_norm=None, global_norm_max=None):  # fmt: skip
    """Upstream's step, written out; the first moment is stored in ``first_order_dtype``."""
    w = w.astype(np.float32).copy()
    m = np.zeros_like(w, dtype=first_order_dtype)
    v = np.zeros_like(w, dtype=np.float32)
    t = 0
    for g, norm in zip(grads, global_norm or [None] * len(grads), strict=True):
        g = g.astype(np.float32) / np.float32(loss_scaling)
        if norm is not None:
            g = g * np.float32(global_norm_max / max(norm, global_norm_max))
        # The moving average runs in the moment's dtype: the gradient is cast to it, and
        # `m * beta1` is rounded before `(1 - beta1) * g` is added (one rounding per op).
        f32 = np.float32
        gm = g.astype(first_order_dtype).astype(f32)
        m = (m.astype(f32) * f32(beta1)).astype(first_order_dtype)
        m = (m.astype(f32) + (f32(1) - f32(beta1)) * gm).astype(first_order_dtype)
        v = (beta2 * v + (1 - beta2) * g * g).astype(np.float32)
        mc, vc = m.astype(np.float32), v
        if bias_correction:
            t += 1
            mc, vc = mc / (1 - beta1**t), vc / (1 - beta2**t)
        w = (w - lr * (mc / (np.sqrt(vc) + eps) + weight_decay * w)).astype(np.float32)
    return w, m, v, t


def _train(w0, grads, norms=None, **kw):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        w = popxl.variable(w0, name="w")
        gs = popxl.h2d_stream(w0.shape, popxl.float32, "g")
        g = ops.host_load(gs, "g")
        extra = {}
        if norms is not None:
            ns = popxl.h2d_stream((), popxl.float32, "norm")
            extra["global_norm"] = ops.host_load(ns, "norm")
        facts, step = AdamOptimizerStep().create_graph(w, g.spec, **kw, **extra)
        state = facts.init()
        step.bind(state).call(w, g, *extra.values())  # tensor arguments, in signature order
    with popxl.Session(ir, "ipu_model") as session:
        for i, gd in enumerate(grads):
            feed = {gs: gd}
            if norms is not None:
                feed[ns] = np.float32(norms[i])
            session.run(feed)
        got = session.get_tensors_data([w, *state.tensors])
    return got[w], {k: got[t] for k, t in state.to_dict().items()}


@pytest.mark.parametrize("case", [
    dict(lr=0.01),
    dict(lr=0.05, weight_decay=0.0, first_order_dtype=popxl.float32),
    dict(lr=0.02, bias_correction=False, beta1=0.8, beta2=0.99, eps=1e-3),
    dict(lr=0.01, loss_scaling=128.0),
    dict(lr=0.01, global_norm_max=0.5),
], ids=["defaults", "fp32_first_moment", "no_bias_correction", "loss_scaling", "global_norm"])  # fmt: skip
def test_adam_optimizer_step_matches_numpy_adam_over_five_steps(case):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 4)).astype(np.float32)
    scale = case.get("loss_scaling", 1.0)
    grads = [(rng.normal(size=(3, 4)) * scale).astype(np.float32) for _ in range(5)]
    norms = [float(n) for n in rng.uniform(0.2, 2.0, 5)] if "global_norm_max" in case else None
    got_w, state = _train(w0, grads, norms, **case)
    np_case = {k: v for k, v in case.items() if k != "first_order_dtype"}
    fod = np.float32 if case.get("first_order_dtype") is popxl.float32 else np.float16
    want_w, want_m, want_v, t = numpy_adam(w0, grads, first_order_dtype=fod,
                                           global_norm=norms, **np_case)  # fmt: skip
    # The default keeps the first moment in float16, as upstream does.
    assert state["first_order"].dtype == fod and state["second_order"].dtype == np.float32
    rtol = 1e-3 if fod is np.float16 else 1e-5
    # float16 moments: within two float16 ulps (the order of roundings differs slightly).
    np.testing.assert_allclose(state["first_order"].astype(np.float32), want_m.astype(np.float32),
                               rtol=2 * rtol, atol=2 * 2.0**-11)  # fmt: skip
    # numpy forms the moving averages in float64 before rounding: a few ulp apart.
    np.testing.assert_allclose(state["second_order"], want_v, rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(got_w, want_w, rtol=rtol, atol=1e-4)
    if case.get("bias_correction", True):
        assert state["step"] == t == 5
    else:
        assert "step" not in state


def test_adam_global_norm_needs_global_norm_max():
    ir = popxl.Ir()
    with ir.main_graph:
        w = popxl.variable(np.zeros(3, np.float32))
        norm = popxl.constant(np.float32(1.0))
        with pytest.raises(ValueError, match="global_norm_max"):
            AdamOptimizerStep().create_graph(w, w.spec, lr=0.1, global_norm=norm)
