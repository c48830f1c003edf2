"""Optimizers whose update reduces over a whole parameter (LARS/LAMB trust ratios) with
replicated tensor sharding (Note [whole-parameter reductions on shards]): each replica's shard
gives a partial result, all-reduced over the sharding group, so the compiled step trains as
the eager loop on the global batch, padded shards included.

Tolerances: the norms are float32 sums in another order than torch's (partials per shard, and
the gradients are sums over replicas and micro-batches), ~1e-7 relative; the trust ratio
carries that into the update: rtol 1e-5 / atol 1e-6 as the other captured optimizers'.
"""

import pytest
import torch
import torch.nn.functional as F
from optim_checks import assert_same_training, eager_step

import torch_popxl as popxl

STEPS = 3


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's update scaled by the trust ratio ||p|| / ||update||."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})  # fmt: skip

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm = p.norm()
                u_norm = torch.linalg.vector_norm(update)
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
                p.add_(update * trust, alpha=-group["lr"])


class Lars(torch.optim.Optimizer):
    """LARS: momentum SGD with the layer-wise rate eta ||p|| / (||g|| + wd ||p||), and a
    scale from the mean of |g - 0.5| (non-zero on padding: the padding must not count)."""

    def __init__(self, params, lr=1e-1, momentum=0.9, eta=1e-2, weight_decay=1e-3):
        super().__init__(params, {"lr": lr, "momentum": momentum, "eta": eta,
                                  "weight_decay": weight_decay})  # fmt: skip

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                g = p.grad
                w_norm = p.pow(2).sum().sqrt()
                g_norm = torch.linalg.vector_norm(g, 2)
                local = group["eta"] * w_norm / (g_norm + group["weight_decay"] * w_norm + 1e-8)
                scale = 1.0 / (1.0 + (g - 0.5).abs().mean())
                d = (g + group["weight_decay"] * p) * local * scale
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(d)
                p.add_(buf, alpha=-group["lr"])


class RowNormalized(torch.optim.Optimizer):
    """Normalises each row of a 2-D parameter's gradient: a reduction over one dim."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad
                    norm = g.norm(dim=-1, keepdim=True) if g.dim() > 1 else g.norm()
                    p.add_(g / (norm + 1e-6), alpha=-group["lr"])


class EveryReduction(torch.optim.Optimizer):
    """Scales the gradient step by every full reduction the shards rewrite (a dot product, max
    and min, mean, sum over all dims with keepdim, 1-, 3- and inf-norms), each of a shifted
    tensor that is non-zero on padding, so a padding element that counted would show."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                terms = [
                    torch.dot((g + 1).flatten(), (g + 1).flatten()) / 100,
                    (-(p.abs()) - 1).amax(),
                    (p.abs() + 1).amin(),
                    (g - 1).max(),
                    (p + 1).mean(),
                    torch.linalg.vector_norm(g - 1, 1) / 100,
                    torch.linalg.vector_norm(g - 1, float("inf")),
                    torch.linalg.vector_norm(g + 1, 3) / 100,
                ]
                total = (g - 1).square().sum(dim=tuple(range(g.dim())), keepdim=True)
                scale = sum(terms) / (1 + total.sqrt())
                p.add_(g * scale, alpha=-group["lr"])


OPTIMIZERS = {"lamb": Lamb, "lars": Lars, "every_reduction": EveryReduction}


def model():
    # 7 and 3 outputs: every parameter's shards are padded at R=2 (84 = 4 x 21 is not at R=4,
    # 7, 21 and 3 are)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def batches(n=STEPS, size=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 12, generator=g), torch.randn(size, 3, generator=g))
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("state", ["on_chip", "remote"])
@pytest.mark.parametrize(("R", "GA"), [(2, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_whole_parameter_norms_on_shards_match_eager(kind, R, GA, state):
    make = OPTIMIZERS[kind]
    m = model()
    opt = make(m.parameters())
    trainer = popxl.compile(m, F.mse_loss, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=1, optimizer_state=state)  # fmt: skip
    m_ref = model()
    opt_ref = make(m_ref.parameters())
    for x, y in batches():
        loss = trainer.step(x.numpy(), y.numpy())
        loss_ref = eager_step(m_ref, opt_ref, x, y)
        assert loss == pytest.approx(loss_ref, rel=1e-5)
    assert all(s.sharded for s in trainer._active.slots)  # every parameter, padded ones too
    assert_same_training(m, opt, m_ref, opt_ref)


@pytest.mark.parametrize("state", ["on_chip", "remote"])
def test_reduction_over_one_dim_updates_the_parameter_whole(state):
    """A row norm mixes elements that different shards would hold: that matrix is not
    sharded (its gradient all-reduced, its state whole) and trains as eager; the biases,
    normalised by a full norm, are still sharded (Note [steps on whole parameters])."""
    _matrices_whole_biases_sharded(RowNormalized, R=2, GA=1, state=state)


def _matrices_whole_biases_sharded(make, R, GA, state):
    """``make``'s optimizer trained under RTS against eager: the weight matrices are updated
    whole, the biases sharded, and everything trains as eager."""
    m, m_ref = model(), model()
    opt, opt_ref = make(m.parameters()), make(m_ref.parameters())
    trainer = popxl.compile(m, F.mse_loss, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=1, optimizer_state=state)  # fmt: skip
    for x, y in batches():
        trainer.step(x.numpy(), y.numpy())
        eager_step(m_ref, opt_ref, x, y)
    sharded = {s.name: s.sharded for s in trainer._active.slots}
    assert sharded == {"0.weight": False, "0.bias": True, "2.weight": False, "2.bias": True}
    assert_same_training(m, opt, m_ref, opt_ref)


@pytest.mark.parametrize(("R", "GA"), [(2, 2), (4, 1)])
def test_adafactor_vectors_on_padded_shards_match_eager(R, GA):
    """Adafactor's vector update divides norms by ``p.numel() ** 0.5`` (an RMS): on a padded
    shard ``numel()`` is the parameter's, the norms all-reduced with padding excluded; its
    matrices (row and column variances) are updated whole."""
    _matrices_whole_biases_sharded(torch.optim.Adafactor, R=R, GA=GA, state="remote")


def test_bfloat16_norms_on_shards_match_eager():
    """16-bit shards: the partials and the all-reduce run in float32 (as torch accumulates a
    bfloat16 norm), rounded once. lr=0.1 moves the weights by ~50 bfloat16 ulps over the steps;
    they stay within 2 ulps of eager's (measured 1.5; shard-local norms without the all-reduce
    are 4-18 ulps off)."""
    m = model().to(torch.bfloat16)
    opt = Lamb(m.parameters(), lr=0.1)
    trainer = popxl.compile(m, F.mse_loss, opt, replication_factor=2, rts_threshold=1)
    m_ref = model().to(torch.bfloat16)
    opt_ref = Lamb(m_ref.parameters(), lr=0.1)
    for x, y in batches():
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
        trainer.step(x, y)
        eager_step(m_ref, opt_ref, x, y)
    assert all(s.sharded for s in trainer._active.slots)
    for (name, p), q in zip(m.named_parameters(), m_ref.parameters(), strict=True):
        ulp = q.detach().float().abs().max().item() * 2**-8
        diff = (p.detach().float() - q.detach().float()).abs().max().item()
        assert diff <= 2 * ulp, (name, diff, ulp)
