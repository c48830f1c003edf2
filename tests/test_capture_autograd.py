"""Autograd's rules in captured code, as eager torch applies them: custom
``torch.autograd.Function``s use their own ``backward`` (Note [custom autograd Functions]),
ops under ``torch.no_grad()`` pass no gradient (Note [no_grad in captured code]); popxl.compile
trains as eager torch does, and ``autodiff`` of a graph gives the gradients torch.autograd
gives."""

import copy

import pytest
import torch
import torch.nn.functional as F
from optim_checks import per_replica_eager_step, train_both
from test_autodiff import assert_grads_match_torch

import torch_popxl as popxl
from torch_popxl.capture import call_torch
from torch_popxl.errors import PopXLError


class StraightThrough(torch.autograd.Function):
    """Rounds to quarters; the gradient passes as if it were the identity."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


# held bound, as programs often do: torch's C++ apply, which capture cannot replace
quarter_round = StraightThrough.apply
_OWN_FORWARD = StraightThrough.__dict__["forward"]


class Reversal(torch.autograd.Function):
    """Returns its argument; scales the gradient by ``-k`` (a non-tensor argument)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x

    @staticmethod
    def backward(ctx, g):
        return -ctx.k * g, None


class ScaledLinear(torch.autograd.Function):
    """``x @ w.T * s + b`` in the setup_context style, saving inputs and an intermediate; the
    bias gradient is returned unreduced (autograd sums it to the bias's shape)."""

    @staticmethod
    def forward(x, w, b, s):
        h = x @ w.t()
        return h * s + b, h

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, _, s = inputs
        ctx.save_for_backward(x, w, output[1])
        ctx.s = s
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g, _):
        x, w, h = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = (g * ctx.s) @ w
        if ctx.needs_input_grad[1]:
            gw = (g * ctx.s).t() @ x
        # a gradient that is off by a multiple of the (detached) intermediate, only to read it
        return gx, gw, g + 0 * h.sum(), None


class SquaredError(torch.autograd.Function):
    """A loss with a hand-written backward (mean of squares over the batch)."""

    @staticmethod
    def forward(ctx, pred, target):
        diff = pred - target
        ctx.save_for_backward(diff)
        return (diff * diff).mean()

    @staticmethod
    def backward(ctx, g):
        (diff,) = ctx.saved_tensors
        return g * 2 * diff / diff.numel(), None


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 16)
        self.w = torch.nn.Parameter(torch.randn(8, 16) * 0.3)
        self.b = torch.nn.Parameter(torch.zeros(8))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = quarter_round(torch.tanh(self.a(x)))
        h = Reversal.apply(h, 0.5)
        h, _ = ScaledLinear.apply(h, self.w, self.b, 1.5)
        return self.head(F.silu(h))


def _batches(n, rows=8):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 12, generator=g), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize(("R", "GA", "kw"), [(1, 1, {}), (2, 2, {}),
                                             (2, 2, {"rts_threshold": 16,
                                                     "optimizer_state": "remote"})])  # fmt: skip
def test_compiled_training_uses_each_functions_backward(R, GA, kw):
    torch.manual_seed(0)
    model = Net()
    # Differentiating the ops instead gives the first layer no gradient (round), the wrong
    # sign before the reversal and another bias gradient: the comparison fails on all three.
    train_both(model, F.cross_entropy, _batches(3), R, GA, rtol=1e-4, atol=1e-5,
               optimizer=torch.optim.Adam, lr=1e-2, **kw)  # fmt: skip
    assert model.a.weight.grad.abs().sum() > 0
    # the Function is as the program defined it once capture is over
    assert StraightThrough.__dict__["forward"] is _OWN_FORWARD
    assert "setup_context" not in StraightThrough.__dict__


def test_a_loss_function_with_its_own_backward_splits_over_micro_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    batches = [(x, torch.nn.functional.one_hot(y, 3).float()) for x, y in _batches(2)]
    train_both(model, SquaredError.apply, batches, 2, 2, rtol=1e-5, atol=1e-6)


def test_a_weight_read_by_closure_gets_no_gradient_as_in_eager():
    class Closure(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(12, 12)
            self.head = torch.nn.Linear(12, 3)

        def forward(self, x):
            inner = self.inner

            class Apply(torch.autograd.Function):
                @staticmethod
                def forward(ctx, t):
                    return torch.relu(inner(t)) + t

                @staticmethod
                def backward(ctx, g):
                    return g

            return self.head(Apply.apply(x))

    torch.manual_seed(0)
    model = Closure()
    eager = copy.deepcopy(model)
    x, y = _batches(1)[0]
    F.cross_entropy(eager(x), y).backward()
    assert eager.inner.weight.grad is None  # torch: the forward ran without grad
    trainer = popxl.compile(model, F.cross_entropy,
                            torch.optim.SGD(model.parameters(), lr=0.1), replication_factor=2)  # fmt: skip
    loss = trainer.step(x, y)
    assert model.inner.weight.grad is None or not model.inner.weight.grad.any()
    torch.testing.assert_close(model.head.weight.grad, eager.head.weight.grad)
    assert loss == pytest.approx(F.cross_entropy(eager(x), y).item(), rel=1e-6)


def _scaled_tanh(x, w, b):
    h, _ = ScaledLinear.apply(x, w, b, 0.5)
    return StraightThrough.apply(torch.tanh(h)) * 2


@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_autodiff_of_a_graph_applying_a_function(executor):
    def fn(x, w, b):  # torch code on popxl handles, captured as one call
        return call_torch(_scaled_tanh, (x, w, b), {})

    assert_grads_match_torch(fn, _scaled_tanh, [(5, 4), (3, 4), (3,)], (5, 3), executor, 0)


def test_inference_runs_a_functions_forward():
    torch.manual_seed(0)
    model = Net().eval()
    x, _ = _batches(1)[0]
    infer = popxl.compile(model, replication_factor=2)
    torch.testing.assert_close(infer(x), model(x), rtol=1e-5, atol=1e-6)


def test_backward_returning_the_wrong_number_of_gradients_is_refused():
    class TooFew(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x * y

        @staticmethod
        def backward(ctx, g):
            return g

    class Model(torch.nn.Linear):
        def forward(self, x):
            return TooFew.apply(super().forward(x), x)

    model = Model(4, 4)
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(PopXLError, match=r"TooFewBackward returned an incorrect number"):
        trainer.step(torch.randn(2, 4), torch.randn(2, 4))
    for k, v in model.state_dict().items():  # nothing the user owns changed
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    # eager torch's message is the same
    with pytest.raises(RuntimeError, match=r"TooFewBackward returned an incorrect number"):
        model(torch.randn(2, 4)).sum().backward()


class NoGradScale(torch.nn.Module):
    """Divides by a scale computed under no_grad, adds a detached term."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(12, 16), torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            scale = h.abs().amax(dim=1, keepdim=True) + 1
        return self.b(h / scale + h.detach() * 0.1)


@pytest.mark.parametrize(("R", "GA"), [(1, 1), (2, 2)])
def test_ops_under_no_grad_pass_no_gradient(R, GA):
    # differentiating through the scale changes the first layer's gradient by ~1e-4 relative
    torch.manual_seed(0)
    train_both(NoGradScale(), F.cross_entropy, _batches(3), R, GA, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("R", "GA"), [(1, 1), (2, 1)])
def test_spectral_norm_power_iteration_under_no_grad_trains_as_eager(R, GA):
    # The power iteration writes its buffers in place under no_grad (out= ops autograd refuses
    # to differentiate). Buffers are per replica and updated once per micro-batch (as batch
    # norm's: docs/compile.md), so with GA = 1 a step is eager's.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(12, 16)),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
    )
    train_both(model, F.cross_entropy, _batches(3), R, GA, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("frozen", [False, True])
def test_a_forward_writing_a_parameter_in_place_is_refused_with_nothing_changed(frozen):
    # nn.EmbeddingBag(max_norm=...) renormalises the rows it reads in place under no_grad:
    # eager then trains the renormalised rows; the compiled step would train the old ones.
    # (nn.Embedding(max_norm=...) is followed: Note [embedding rows renormalised])
    class Renormed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.EmbeddingBag(20, 8, max_norm=1.0)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, ids):
            return self.head(self.emb(ids))

    torch.manual_seed(0)
    model = Renormed()
    model.emb.requires_grad_(not frozen)  # a frozen table is renormalised in eager too
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"writes the parameters \['emb.weight'\] in place"):
        trainer.step(torch.randint(0, 20, (8, 5)), torch.randint(0, 3, (8,)))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["hook", "pre_hook"])
def test_module_backward_hooks_are_refused_with_nothing_changed(kind):
    # eager runs them (they scale this layer's input gradient); the compiled step would not
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    if kind == "hook":
        model[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    else:
        model[2].register_full_backward_pre_hook(lambda m, go: (go[0] * 0.5,))
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"modules \['2'\] have backward hooks"):
        trainer.step(*_batches(1)[0])
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_layers_train_as_eager(reentrant):
    # torch's reentrant checkpoint runs its forward under no_grad (and recomputes in backward):
    # its ops are differentiated, not taken for the program's own no_grad
    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.mid, self.b = (torch.nn.Linear(12, 16), torch.nn.Linear(16, 16),
                                        torch.nn.Linear(16, 3))  # fmt: skip

        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(lambda t: F.gelu(self.mid(t)), self.a(x),
                                                  use_reentrant=reentrant)  # fmt: skip
            return self.b(h)

    torch.manual_seed(0)
    model = Checkpointed()
    train_both(model, F.cross_entropy, _batches(3), 2, 2, rtol=1e-5, atol=1e-6)
    assert model.mid.weight.grad is not None


@pytest.mark.parametrize("guarded", [True, False])
def test_tensor_hooks_registered_in_forward_change_the_gradient_as_in_eager(guarded):
    # Note [requires_grad in captured code]: captured tensors that depend on trained weights
    # require grad, so a guarded hook is registered too, and autodiff runs it
    class Hooked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(12, 16), torch.nn.Linear(16, 3)

        def forward(self, x):
            h = torch.relu(self.a(x))
            if h.requires_grad or not guarded:
                h.register_hook(lambda g: g * 0.5 + 0.01)
            return self.b(h)

    torch.manual_seed(0)
    train_both(Hooked(), F.cross_entropy, _batches(3), 2, 2, rtol=1e-5, atol=1e-6)


# ---- second-order gradients (Note [saved results in second-order gradients]) ----------------


class InputGradientPenalty(torch.nn.Module):
    """A critic whose output carries a penalty on the norm of its input gradient (WGAN-GP,
    physics losses on input derivatives): ``torch.autograd.grad(..., create_graph=True)`` in
    ``forward``, through activations whose backward reads their own saved result (tanh,
    sigmoid, softmax) or their input (GELU). ``cut`` detaches the gradient before the penalty,
    which must then pass no second-order gradient, as in eager torch."""

    def __init__(self, act: torch.nn.Module, cut: bool = False):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), act, torch.nn.Linear(16, 1))
        self.cut = cut

    def forward(self, x):
        x = x.requires_grad_(True)
        out = self.body(x)
        (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        if self.cut:
            grad = grad.detach()
        return out + 0.5 * (grad.norm(dim=1, keepdim=True) - 1) ** 2


@pytest.mark.parametrize(
    "act",
    [torch.nn.Tanh(), torch.nn.Sigmoid(), torch.nn.GELU(), torch.nn.Softmax(-1)],
    ids=["tanh", "sigmoid", "gelu", "softmax"],
)
@pytest.mark.parametrize(("R", "GA"), [(1, 1), (2, 2)])
def test_input_gradient_penalty_trains_as_eager(act, R, GA):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
    train_both(InputGradientPenalty(act), F.mse_loss, batches, R, GA, rtol=1e-4, atol=1e-6)


def test_a_detached_input_gradient_passes_no_second_order_gradient():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
    train_both(InputGradientPenalty(torch.nn.Tanh(), cut=True), F.mse_loss, batches, 1, 1,
               rtol=1e-4, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("R, GA", [(1, 1), (1, 2), (2, 2)])
def test_batch_norm_with_a_cumulative_average_trains_as_eager(R, GA):
    """momentum=None (the running statistics a cumulative average, each batch weighted by 1 /
    num_batches_tracked, read as a Python number) trains as eager torch run on each replica's
    micro-batches in order (Note [per-replica batch statistics]; Note [cumulative batch
    norm]): every step's loss, the weights, running_mean / running_var (float64 blends of
    float32 statistics: rtol 1e-6) and num_batches_tracked after four steps (was refused)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16, momentum=None),
                                torch.nn.ReLU(), torch.nn.Linear(16, 3))  # fmt: skip
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    trainer = popxl.compile(model, F.cross_entropy, opt, replication_factor=R,
                            gradient_accumulation=GA)  # fmt: skip
    eager = per_replica_eager_step(ref, ref_opt, F.cross_entropy, R, GA)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(16, 12, generator=g) * 3 + 1, torch.randint(0, 3, (16,), generator=g)
        torch.testing.assert_close(torch.tensor(trainer.step(x, y)), torch.tensor(eager(x, y)),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    state, want = model.state_dict(), ref.state_dict()
    assert int(state["1.num_batches_tracked"]) == int(want["1.num_batches_tracked"]) == 4 * GA
    for k in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(state[k], want[k], rtol=1e-6, atol=1e-7)
    for k in ("0.weight", "3.weight"):
        torch.testing.assert_close(state[k], want[k], rtol=1e-5, atol=1e-6)
    model.eval()  # evaluation reads the running statistics
    evaluate = popxl.compile(model)
    x = torch.randn(8, 12)
    torch.testing.assert_close(evaluate(x), model(x), rtol=1e-5, atol=1e-6)


def test_batch_norm_with_a_cumulative_average_in_a_train_mode_inference_program_is_eager():
    """An inference program of a module in train mode normalises with the batch's statistics
    and folds them into the cumulative average as eager does, call after call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6, momentum=None))
    ref = copy.deepcopy(model)
    program = popxl.compile(model)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 4, generator=g) * 2 + 1
        with torch.no_grad():
            torch.testing.assert_close(program(x), ref(x), rtol=1e-5, atol=1e-6)
    assert int(model[1].num_batches_tracked) == int(ref[1].num_batches_tracked) == 3
    for k in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(model[1], k), getattr(ref[1], k), rtol=1e-6, atol=1e-7)
