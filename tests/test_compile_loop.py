"""The loop around a compiled step is the eager loop's: ``p.grad``, outputs, models that
return their own loss.

After ``trainer.step`` every trained parameter's ``.grad`` holds the gradient eager torch holds
after ``backward()`` (clipped, where ``max_grad_norm`` clips, as after ``clip_grad_norm_``);
``return_outputs=True`` gives the model's outputs of the global batch; with ``loss_fn=None``
the model's own loss (a tensor or an output with ``.loss``) is trained.

Tolerance: float32 sums in another order (per replica, per micro-batch): rtol 1e-5 / atol 1e-6
after a few steps of SGD with momentum (Adam would amplify rounding where a gradient is ~0).
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


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def batches(n=3, size=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 12, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(n)]  # fmt: skip


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def close(a, b, what=""):
    np.testing.assert_allclose(torch.as_tensor(a).detach(), torch.as_tensor(b).detach(),
                               rtol=RTOL, atol=ATOL, err_msg=what)  # fmt: skip


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_p_grad_holds_eagers_gradient_after_a_step(R, GA, rts, state, clip):
    m, ref = mlp(), mlp()
    opt, ref_opt = sgd(m), sgd(ref)
    m[0].requires_grad_(False)  # frozen: no gradient, as in eager
    ref[0].requires_grad_(False)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if rts else None, optimizer_state=state,
                            max_grad_norm=clip)  # fmt: skip
    for x, y in batches():
        trainer.step(x, y)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None, n
            else:
                close(p.grad, q.grad, n)
    # the usual logging reads work on them
    norm = torch.nn.utils.get_total_norm([p.grad for p in m.parameters() if p.grad is not None])
    ref_norm = torch.nn.utils.get_total_norm(
        [p.grad for p in ref.parameters() if p.grad is not None]
    )
    close(norm, ref_norm)


def test_p_grad_after_zero_grad_and_with_keep_grads_off():
    m = mlp()
    opt = sgd(m)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=2)
    x, y = batches(1)[0]
    trainer.step(x, y)
    opt.zero_grad()  # set_to_none: the next step sets them again
    assert all(p.grad is None for p in m.parameters())
    trainer.step(x, y)
    assert all(p.grad is not None for p in m.parameters())
    m2 = mlp()
    trainer = popxl.compile(m2, F.cross_entropy, sgd(m2), replication_factor=2, keep_grads=False)
    trainer.step(x, y)
    assert all(p.grad is None for p in m2.parameters())
    assert not any(v.name.startswith("grad/") for v in trainer.ir.main_graph.variables)


@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_return_outputs_gives_the_global_batchs_outputs_for_training_accuracy(R, GA, rts, state):
    m, ref = mlp(), mlp()
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if rts else None, optimizer_state=state,
                            return_outputs=True)  # fmt: skip
    for x, y in batches():
        loss, logits = trainer.step(x, y)
        ref_opt.zero_grad()
        ref_logits = ref(x)  # the outputs before the update, as the step computes them
        ref_loss = F.cross_entropy(ref_logits, y)
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=RTOL)
        assert logits.shape == (16, 4)
        close(logits, ref_logits)
        assert torch.equal(logits.argmax(1) == y, ref_logits.argmax(1) == y)


class ReturnsItsLoss(torch.nn.Module):
    """A language model as Hugging Face writes one: labels in, ``.loss`` out (a token mean
    over the labels that are not -100), or the loss tensor alone (PopTorch style)."""

    def __init__(self, as_tensor=False):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 8)
        self.head = torch.nn.Linear(8, 7)
        self.as_tensor = as_tensor

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
        if self.as_tensor:
            return loss

        class Output(dict):
            __getattr__ = dict.__getitem__

        return Output(loss=loss, logits=logits)


def token_batches(n=3, size=8, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 7, (size, 5), generator=g)
        labels = x.clone()
        labels[torch.rand(size, 5, generator=g) < 0.4] = -100  # padding, unevenly spread
        out.append((x, labels))
    return out


@pytest.mark.parametrize("as_tensor", [False, True], ids=["output_with_loss", "tensor"])
@pytest.mark.parametrize(("R", "GA", "rts", "state"), LAYOUTS)
def test_a_model_that_returns_its_loss_trains_with_loss_fn_none(R, GA, rts, state, as_tensor):
    torch.manual_seed(0)
    m = ReturnsItsLoss(as_tensor)
    ref = copy.deepcopy(m)
    opt, ref_opt = sgd(m), sgd(ref)
    trainer = popxl.compile(m, None, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=32 if rts else None, optimizer_state=state)  # fmt: skip
    assert isinstance(trainer, popxl.Trainer)
    for x, labels in token_batches():
        loss = trainer.step({"input_ids": x, "labels": labels})
        ref_opt.zero_grad()
        out = ref(x, labels)
        ref_loss = out if as_tensor else out.loss
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=RTOL)
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        close(p, q, n)
        close(p.grad, q.grad, n)


def test_loss_fn_none_without_an_optimizer_is_still_inference():
    m = mlp().eval()
    infer = popxl.compile(m)
    x = torch.randn(5, 12)
    close(infer(x), m(x))
    with pytest.raises(ValueError, match="a loss_fn without an optimizer"):
        popxl.compile(m, F.cross_entropy)


def test_a_model_without_a_loss_says_how_to_give_one():
    m = mlp()
    trainer = popxl.compile(m, None, sgd(m), replication_factor=2)
    x, _ = batches(1)[0]
    with pytest.raises(ValueError, match="scalar tensor"):
        trainer.step(x)


class Tokens(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 8)
        self.head = torch.nn.Linear(8, 7)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def shifted_token_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))


def test_a_step_prints_nothing_to_stderr(capfd):
    """An op without a batching rule runs per replica under vmap (here: the token loss over
    shifted labels puts the model's matmuls there); torch's C++ warning about it ("There is
    a performance drop ...") must not reach the user's stderr, step after step."""
    torch.manual_seed(0)
    m = Tokens()
    trainer = popxl.compile(m, shifted_token_loss, sgd(m), replication_factor=2,
                            gradient_accumulation=2)  # fmt: skip
    infer = popxl.compile(m, replication_factor=2)
    capfd.readouterr()
    for x, labels in token_batches():
        m.train()
        trainer.step(x, labels)
        m.eval()
        infer(x)
    out, err = capfd.readouterr()
    assert err == "" and out == ""


# ---- max_grad_norm: clip_grad_norm_ step by step, the total norm for logging ----------------


def adam(m):
    return torch.optim.Adam(m.parameters(), lr=1e-2)


@pytest.mark.parametrize(("R", "GA", "rts", "state"), [(1, 1, False, "on_chip"),
                                                       (1, 1, False, "remote"), *LAYOUTS[1:]])  # fmt: skip
def test_max_grad_norm_is_clip_grad_norm_and_its_total_norm_is_logged(R, GA, rts, state):
    """Over 12 Adam steps (which amplify any rounding difference in the clipped gradient):
    at R=1 bit for bit as eager's clip_grad_norm_ (weights, state, p.grad and the total norm it
    returns); with replicas and micro-batches, to summation order. The clip is active."""
    from torch_popxl.runtime import gemm

    m, ref = mlp(), mlp()
    opt, ref_opt = adam(m), adam(ref)
    trainer = popxl.compile(m, F.cross_entropy, opt, replication_factor=R, gradient_accumulation=GA,
                            rts_threshold=64 if rts else None, optimizer_state=state,
                            max_grad_norm=0.3)  # fmt: skip
    assert trainer.last_grad_norm is None
    exact = R == 1 and GA == 1
    clipped = 0
    with gemm.using("aten"):  # torch's matmul: the same gradients as eager at R=1
        for x, y in batches(12):
            trainer.step(x, y)
            ref_opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
            ref_opt.step()
            clipped += ref_norm.item() > 0.3
            if exact:
                assert trainer.last_grad_norm == ref_norm.item()
            else:
                assert trainer.last_grad_norm == pytest.approx(ref_norm.item(), rel=1e-5)
    assert clipped >= 6  # the clip was active on most steps
    check = torch.testing.assert_close
    kw = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        check(p.detach(), q.detach(), **kw, msg=n)
        check(p.grad, q.grad, **kw, msg=n)
        for k, v in ref_opt.state[q].items():
            check(opt.state[p][k], v, **kw, msg=f"{n}.{k}")


def test_last_grad_norm_is_none_without_max_grad_norm():
    m = mlp()
    trainer = popxl.compile(m, F.cross_entropy, sgd(m))
    trainer.step(*batches(1)[0])
    assert trainer.last_grad_norm is None
