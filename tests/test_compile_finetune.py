"""Fine-tuning with popxl.compile: frozen parameters stay untouched, the rest trains as eager.

A parameter with ``requires_grad=False`` or outside the optimizer gets no gradient, no
accumulator and no optimizer state (torch's optimizers skip a parameter whose grad is None);
the compiled step must do the same and train the others as the eager loop on the global batch.

Tolerance: float32 sums in another order (per replica, per micro-batch): rtol 1e-5 / atol 1e-6
after 3 steps of SGD with momentum (Adam would amplify rounding where a gradient is about 0).
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_popxl as popxl

RTOL, ATOL = 1e-5, 1e-6
LAYOUTS = [(1, 1, False, "on_chip"), (2, 2, True, "remote"), (4, 1, True, "on_chip"),
           (1, 4, False, "remote")]  # fmt: skip


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 16), torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )  # fmt: skip


def freeze(m, how):
    """Freezes the first layer (a backbone) the way fine-tuning scripts do; the optimizer."""
    if how == "requires_grad_false":  # frozen, yet still in the optimizer
        m[0].requires_grad_(False)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    if how == "not_in_optimizer":  # trainable, but the optimizer never steps it
        return torch.optim.SGD(list(m[2:].parameters()), lr=0.05, momentum=0.9)
    assert how == "both"
    m[0].requires_grad_(False)
    return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


def batches(n=3, size=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 12, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(n)]  # fmt: skip


def eager_step(m, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("how", ["requires_grad_false", "not_in_optimizer", "both"])
@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_frozen_parameters_stay_untouched_and_the_rest_trains_as_eager(how, R, GA, rts, state):
    m, ref = model(), model()
    opt, ref_opt = freeze(m, how), freeze(ref, how)
    frozen = {n: p.detach().clone() for n, p in m.named_parameters() if n.startswith("0.")}
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if rts else None, optimizer_state=state)  # fmt: skip
    for x, y in batches():
        assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=RTOL)
    for n, p in m.named_parameters():
        if n in frozen:
            assert torch.equal(p.detach(), frozen[n]), n
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, err_msg=n)
    # optimizer state: none for the frozen layer, eager's momentum for the others
    names = {id(p): n for n, p in m.named_parameters()}
    assert sorted(names[id(p)] for p in opt.state) == ["2.bias", "2.weight", "4.bias", "4.weight"]
    ref_params = dict(ref.named_parameters())
    for p, st in opt.state.items():
        want = ref_opt.state[ref_params[names[id(p)]]]["momentum_buffer"]
        np.testing.assert_allclose(st["momentum_buffer"], want, rtol=RTOL, atol=ATOL)
    # no accumulator or state for the frozen layer in the program
    assert [s.name for s in trainer._active.slots] == ["2.weight", "2.bias", "4.weight", "4.bias"]
    assert not any(v.name.startswith(("accum/0.", "momentum_buffer/0."))
                   for v in trainer.ir.main_graph.variables)  # fmt: skip


def test_the_memory_report_holds_no_accumulator_or_state_for_frozen_parameters():
    def report(how):
        m = model()
        opt = freeze(m, how) if how else torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        t = popxl.compile(m, F.cross_entropy, opt, replication_factor=2, gradient_accumulation=2)
        t.plan(*batches(1)[0])
        return t.memory_report()

    full, frozen = report(None), report("requires_grad_false")
    first_layer = (12 * 32 + 32) * 4  # float32 bytes
    # its accumulator, momentum buffer and .grad are gone, its weights stay; no gradient
    # intermediates for it either
    assert full.variable_bytes - frozen.variable_bytes == 3 * first_layer
    assert frozen.peak_intermediate_bytes < full.peak_intermediate_bytes


def test_unfreezing_after_steps_trains_as_eager_and_so_does_a_new_optimizer():
    """torch starts the unfrozen backbone's momentum buffer from its first gradient while the
    head's goes on (Note [parameters stepped fewer times]); a new optimizer compiled again
    starts every buffer afresh. Both as eager."""
    m, ref = model(), model()
    opt, ref_opt = freeze(m, "requires_grad_false"), freeze(ref, "requires_grad_false")
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=2, gradient_accumulation=2)
    data = batches(6)
    for x, y in data[:2]:
        trainer.step(x, y)
        eager_step(ref, ref_opt, x, y)
    m[0].requires_grad_(True)
    ref[0].requires_grad_(True)
    for x, y in data[2:4]:
        assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=RTOL)
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, err_msg=n)
        np.testing.assert_allclose(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[q]["momentum_buffer"], rtol=RTOL, atol=ATOL,
                                   err_msg=n)  # fmt: skip
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=2, gradient_accumulation=2)
    for x, y in data[4:]:
        assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=RTOL)
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, err_msg=n)


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS[:2])
def test_max_grad_norm_clips_the_optimizers_parameters(R, GA, rts, state):
    """``max_grad_norm`` is ``clip_grad_norm_`` over the optimizer's parameters: a trainable
    layer outside the optimizer is frozen (no gradient), so its gradient is not in the norm,
    which eager's ``clip_grad_norm_(model.parameters())`` would count (a larger norm: the
    first assert shows the two differ). Bit for bit at R=1."""
    from torch_popxl.runtime import gemm

    m, ref = model(), model()
    opt, ref_opt = freeze(m, "not_in_optimizer"), freeze(ref, "not_in_optimizer")
    trained = [p for g in ref_opt.param_groups for p in g["params"]]
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R,
                            gradient_accumulation=GA, rts_threshold=64 if rts else None,
                            optimizer_state=state, max_grad_norm=0.1)  # fmt: skip
    exact = R == 1 and GA == 1
    with gemm.using("aten"):  # torch's matmul: the same gradients as eager at R=1
        for x, y in batches():
            trainer.step(x.numpy(), y.numpy())
            ref_opt.zero_grad()
            ref.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            everything = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
            norm = torch.nn.utils.clip_grad_norm_(trained, 0.1)
            assert everything.item() > norm.item() > 0.1  # the frozen layer's gradient counts
            ref_opt.step()
            if exact:
                assert trainer.last_grad_norm == norm.item()
            else:
                assert trainer.last_grad_norm == pytest.approx(norm.item(), rel=1e-5)
    kw = {"rtol": 0, "atol": 0} if exact else {"rtol": RTOL, "atol": ATOL}
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), **kw, msg=n)
    # frozen (Note [frozen parameters]): no gradient is computed for it, where eager backward()
    # would fill one the optimizer never reads
    assert m[0].weight.grad is None


class WithUnused(torch.nn.Module):
    """A model with a layer its forward never runs (an auxiliary head, a leftover layer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = model()
        self.aux = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_a_parameter_the_loss_does_not_reach_keeps_no_grad_and_no_state_as_in_eager(R, GA, rts,
                                                                                   state):  # fmt: skip
    # Note [parameters without a gradient]: AdamW with weight decay would move the unused
    # layer if the program updated it; eager leaves it as it is, grad None, no state.
    m, ref = WithUnused(), WithUnused()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if rts else None, optimizer_state=state)  # fmt: skip
    for x, y in batches():
        assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=RTOL)
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        # Adam normalises gradients: rounding where one is about 0 is amplified
        np.testing.assert_allclose(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, err_msg=n)
        assert (p.grad is None) == (q.grad is None), n
    assert torch.equal(m.aux.weight, ref.aux.weight) and m.aux.weight.grad is None
    assert m.aux.weight not in opt.state and len(opt.state) == len(ref_opt.state) == 6
    # the checkpoint round trip keeps the layer out of the state, and training goes on
    trainer.load_state_dict(trainer.state_dict())
    x, y = batches(1)[0]
    assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=RTOL)


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS[:2])
def test_state_of_layers_frozen_after_eager_training_is_kept_as_eager_keeps_it(R, GA, rts, state):
    """Note [state of parameters the program does not train]: a model trained eagerly with Adam,
    then fine-tuned with its first layer frozen, keeps that layer's Adam state untouched (the
    same tensors) beside the trained layers' state, as the eager loop does."""
    m, ref = model(), model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    data = batches(4)
    for x, y in data[:2]:  # eager pre-training of both
        eager_step(m, opt, x, y)
        eager_step(ref, ref_opt, x, y)
    m[0].requires_grad_(False)
    ref[0].requires_grad_(False)
    kept = {id(p): (opt.state[p], {k: v.clone() for k, v in opt.state[p].items()})
            for p in m[0].parameters()}  # fmt: skip
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if rts else None, optimizer_state=state)  # fmt: skip
    for x, y in data[2:]:
        assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=1e-4)
    ref_params = dict(ref.named_parameters())
    assert len(opt.state) == len(ref_opt.state) == 6
    for n, p in m.named_parameters():
        want = ref_opt.state[ref_params[n]]
        assert sorted(opt.state[p]) == sorted(want), n
        for k, v in want.items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=1e-4, atol=1e-6, msg=n + k)
        if id(p) in kept:  # the user's own dict and tensors, unchanged
            entry, before = kept[id(p)]
            assert opt.state[p] is entry
            for k, v in before.items():
                assert torch.equal(entry[k], v), (n, k)


def test_adagrad_state_made_by_its_constructor_for_an_unused_layer_is_kept():
    """torch's Adagrad makes state for every parameter in its constructor; a layer the loss does
    not reach (Note [parameters without a gradient]) keeps it as the eager loop does."""

    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(12, 4), torch.nn.Linear(12, 4)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    m = WithUnused()
    ref = copy.deepcopy(m)
    opt = torch.optim.Adagrad(m.parameters(), lr=0.1, initial_accumulator_value=0.5)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, initial_accumulator_value=0.5)
    trainer = popxl.compile(m, F.cross_entropy, opt)
    for x, y in batches(2):
        assert trainer.step(x, y) == pytest.approx(eager_step(ref, ref_opt, x, y), rel=1e-5)
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for i, entry in want.items():
        for k, v in entry.items():
            torch.testing.assert_close(got[i][k], v, rtol=1e-5, atol=1e-6, msg=f"{i} {k}")
