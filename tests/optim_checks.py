"""Helpers the optimizer tests share: one eager training step, and the comparison of a compiled
trainer's weights and optimizer state with eager torch's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

RTOL, ATOL = 1e-5, 1e-6


def eager_step(m, opt, x, y) -> float:
    opt.zero_grad()
    loss = F.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def assert_same_training(m, opt, m_ref, opt_ref, exact: bool = False) -> None:
    """Weights, the last step's ``p.grad`` and every optimizer state tensor equal eager's (bit
    for bit when ``exact``)."""
    check = torch.testing.assert_close
    kw = {"rtol": 0, "atol": 0} if exact else {"rtol": RTOL, "atol": ATOL}
    for (name, p), q in zip(m.named_parameters(), m_ref.parameters(), strict=True):
        check(p.detach(), q.detach(), **kw, msg=lambda s, n=name: f"{n}: {s}")
        check(p.grad, q.grad, **kw, msg=lambda s, n=name: f"{n}.grad: {s}")
        assert sorted(opt.state[p]) == sorted(opt_ref.state[q]), name
        for k, v in opt_ref.state[q].items():
            # state is not scaled by lr (RMSprop's buffer of g / sqrt(v) reaches ~10): its
            # absolute tolerance scales with its magnitude
            kw_state = dict(kw, atol=kw["atol"] * max(1.0, v.abs().max().item()))
            check(opt.state[p][k], v, **kw_state, msg=lambda s, n=f"{name}.{k}": f"{n}: {s}")
