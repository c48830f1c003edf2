"""Note [Adam chain in three passes] (csrc/adam.cpp): ``torch_popxl::adam_chain_`` equals eager
torch's single-tensor Adam step bit for bit, whatever the tensor size (vectorised body and
tail), the lerp branch (1 - beta1 below or above 0.5), the thread count and the layout (the
three-pass kernel and the chain it falls back to); the compiled Adam step's equality with eager
torch is tests/test_compile_optimizer_exact.py's."""

import pytest
import torch

from torch_popxl.opdefs import scalar_tensor


def _scalars(lr, b1, b2, eps, step):
    """The compiled step's per-group scalars (``compile_updates._group_scalars``)."""
    t = torch.tensor(float(step), dtype=torch.float64)
    lr_, b1_, b2_, eps_ = (torch.tensor(x, dtype=torch.float64) for x in (lr, b1, b2, eps))
    step_size = lr_ / (1.0 - torch.pow(b1_, t))
    bc2_sqrt = torch.sqrt(1.0 - torch.pow(b2_, t))
    return [x.float() for x in (1.0 - b1_, b2_, 1.0 - b2_, step_size, bc2_sqrt, eps_)]


def _eager(p, g, m, v, lr, b1, b2, eps, step):
    """torch.optim.Adam's step (the default single-tensor chain on CPU) from this state."""
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.Adam([param], lr=lr, betas=(b1, b2), eps=eps)
    param.grad = g.clone()
    opt.state[param] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(),
                        "exp_avg_sq": v.clone()}  # fmt: skip
    opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def _state(n, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    g[::7] = 0.0
    g[3::11] *= 1e4
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-5
    return p, g, m, v


HYPER = [(1e-3, 0.9, 0.999, 1e-8, 1), (1e-3, 0.9, 0.999, 1e-8, 9), (0.1, 0.3, 0.99, 1e-6, 3)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 5120, 40010, 70001])
@pytest.mark.parametrize("hyper", HYPER, ids=["step1", "step9", "lerp_weight_0.7"])
def test_kernel_equals_eager_adam_bit_for_bit(n, hyper, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p, g, m, v = _state(n, seed=n)
        want = _eager(p, g, m, v, *hyper)
        got = [p.clone(), m.clone(), v.clone()]
        scalar_tensor.adam_chain(got[0], g, got[1], got[2], *_scalars(*hyper))
    finally:
        torch.set_num_threads(before)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want, strict=True):
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item():.3e}"


def test_non_contiguous_and_several_parameters_equal_eager():
    """Two list elements, one of them transposed views (the chain's path), one contiguous."""
    hyper = HYPER[1]
    p1, g1, m1, v1 = (t.reshape(40, 30) for t in _state(1200, seed=1))
    p2, g2, m2, v2 = _state(777, seed=2)
    want1 = _eager(p1.t(), g1.t(), m1.t(), v1.t(), *hyper)
    want2 = _eager(p2, g2, m2, v2, *hyper)
    ps, ms, vs = ([a.clone().t(), b.clone()] for a, b in ((p1, p2), (m1, m2), (v1, v2)))
    torch.ops.torch_popxl.adam_chain_(ps, [g1.t(), g2], ms, vs, *_scalars(*hyper))
    for got, want in ((ps[0], want1[0]), (ms[0], want1[1]), (vs[0], want1[2]),
                      (ps[1], want2[0]), (ms[1], want2[1]), (vs[1], want2[2])):  # fmt: skip
        assert torch.equal(got, want)


def test_bad_scalar_and_list_lengths_are_refused_before_anything_changes():
    p, g, m, v = _state(16, seed=3)
    kept = [p.clone(), m.clone(), v.clone()]
    scalars = _scalars(*HYPER[0])
    with pytest.raises(ValueError, match=r"one_minus_beta1 must be a one-element tensor.*\[2\]"):
        scalar_tensor.adam_chain(p, g, m, v, torch.ones(2), *scalars[1:])
    with pytest.raises(ValueError, match="as many gradients, exp_avgs and exp_avg_sqs"):
        torch.ops.torch_popxl.adam_chain_([p], [g, g], [m], [v], *scalars)
    for a, b in zip((p, m, v), kept, strict=True):
        assert torch.equal(a, b)
