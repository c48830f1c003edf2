"""The one-pass SGD kernel (csrc/sgd.cpp, Note [one-pass SGD update] in opdefs/sgd.py): every
flag combination of torch.optim.SGD updates the parameter, the momentum buffer and p.grad bit
for bit as eager torch's single-tensor SGD does on the same gradient (tolerance 0), whatever
the length (vector tails) and thread count; the compiled step calls it, once per parameter,
and trains as eager does."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from optim_checks import (
    assert_same_training,
    eager_step,
    fast_matches_reference,
    kernel_steps_against_eager,
)

import torch_popxl as popxl
from torch_popxl.opdefs.sgd import sgd_update_

# (momentum, dampening, nesterov, weight_decay, maximize): every combination torch accepts
FLAGS = [
    (m, d, n, wd, mx)
    for m, d, n, wd, mx in itertools.product(
        (0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 1e-2), (False, True)
    )  # fmt: skip
    if not (n and (m == 0 or d != 0))
]
# lengths around the 8- and 16-lane vectors and across the threads' chunks (16384 elements)
SIZES = (1, 7, 16, 33, 16384 * 2 + 5)
LR = 0.037


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """The kernels under test are the CPU simulator's; a trainer on a GPU (TORCH_POPXL_DEVICE=cuda)
    runs torch's own ops instead, so these tests pin the CPU."""
    monkeypatch.setenv("TORCH_POPXL_DEVICE", "cpu")


def _flag_id(f):
    m, d, n, wd, mx = f
    return f"m{m}-d{d}-{'nesterov' if n else 'plain'}-wd{wd}-{'max' if mx else 'min'}"


def _kernel_vs_eager(flags, n: int, factors: list[float], steps: int = 3) -> None:
    momentum, dampening, nesterov, wd, maximize = flags
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    q = p.clone().requires_grad_()
    opt = torch.optim.SGD([q], lr=LR, momentum=momentum, dampening=dampening,
                          nesterov=nesterov, weight_decay=wd, maximize=maximize,
                          foreach=False)  # fmt: skip
    buf = torch.zeros(n) if momentum else None
    hyper = torch.tensor([LR, wd, momentum, dampening, 0.0], dtype=torch.float64)
    f = torch.tensor(factors, dtype=torch.float32)
    for step in range(steps):
        acc = torch.randn(n, generator=gen) * 3
        g = acc
        for k in range(len(factors)):  # the separate multiplies the kernel replaces
            g = g * f[k]
        q.grad = g.clone()
        opt.step()
        grad_out = torch.full((n,), float("nan"))
        sgd_update_(p, buf, grad_out, acc, hyper, torch.tensor(float(step)), f, wd != 0,
                    nesterov, maximize)  # fmt: skip
        kw = {"rtol": 0, "atol": 0}
        torch.testing.assert_close(
            grad_out, g, **kw, msg=lambda s, k=step: f"p.grad, step {k}: {s}"
        )
        torch.testing.assert_close(
            p, q.detach(), **kw, msg=lambda s, k=step: f"param, step {k}: {s}"
        )
        if momentum:
            want = opt.state[q]["momentum_buffer"]
            torch.testing.assert_close(
                buf, want, **kw, msg=lambda s, k=step: f"buffer, step {k}: {s}"
            )


@pytest.mark.parametrize("flags", FLAGS, ids=_flag_id)
def test_sgd_kernel_matches_eager_sgd_bit_for_bit(flags):
    for n in SIZES:
        _kernel_vs_eager(flags, n, [])
        _kernel_vs_eager(flags, n, [0.25, 1.7])  # the count and loss-scale multipliers


def test_sgd_kernel_is_the_same_on_one_and_two_threads():
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            _kernel_vs_eager((0.9, 0.0, True, 1e-2, False), 16384 * 4 + 3, [0.5])
    finally:
        torch.set_num_threads(before)


def test_sgd_kernel_on_strided_tensors_matches_eager():
    # a transposed parameter with a contiguous gradient: the kernel works on copies
    p = torch.randn(40, 30).t()
    q = p.clone().requires_grad_()
    opt = torch.optim.SGD([q], lr=LR, momentum=0.9, weight_decay=1e-2, foreach=False)
    buf = torch.zeros(30, 40)
    hyper = torch.tensor([LR, 1e-2, 0.9, 0.0, 0.0], dtype=torch.float64)
    for step in range(2):
        g = torch.randn(30, 40)
        q.grad = g.clone()
        opt.step()
        sgd_update_(p, buf, None, g, hyper, torch.tensor(float(step)), torch.zeros(0), True,
                    False, False)  # fmt: skip
        torch.testing.assert_close(p, q.detach(), rtol=0, atol=0)
        torch.testing.assert_close(buf, opt.state[q]["momentum_buffer"], rtol=0, atol=0)


def test_sgd_kernel_refuses_other_dtypes_with_a_clear_error():
    p = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32 CPU parameters; got Double"):
        sgd_update_(p, None, None, p, torch.zeros(5, dtype=torch.float64), torch.zeros(()),
                    torch.zeros(0), False, False, False)  # fmt: skip


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 4))


def _count_kernel_calls(trainer) -> list[int]:
    """Wraps the generated code's binding of the kernel with a counter (one program)."""
    program = trainer.session._executor.program
    names = [k for k, v in program.globals.items() if v is sgd_update_]
    assert names, "the generated step does not call torch_popxl::sgd_update_"
    calls = [0]
    for k in names:

        def counted(*args, _op=program.globals[k]):
            calls[0] += 1
            return _op(*args)

        program.globals[k] = counted
    return calls


@pytest.mark.parametrize("flags", FLAGS, ids=_flag_id)
def test_compiled_sgd_step_calls_the_kernel_and_trains_as_eager(flags):
    momentum, dampening, nesterov, wd, maximize = flags

    def make(ps):
        return torch.optim.SGD(ps, lr=0.05, momentum=momentum, dampening=dampening,
                               nesterov=nesterov, weight_decay=wd, maximize=maximize)  # fmt: skip

    model = _model()
    trainer, _, calls = kernel_steps_against_eager(model, make, _count_kernel_calls)
    assert trainer.fused_reasons == (None,)
    assert calls[0] == 2 * len(list(model.parameters()))  # one call per parameter and step


def test_sgd_kernel_reasons_name_what_keeps_the_chain():
    model = _model().to(torch.bfloat16)
    trainer = popxl.compile(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 12, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16)
    trainer.step(x, y)
    assert trainer.fused_reasons == (
        "the one-pass SGD kernel takes float32 parameters; the group has ['bfloat16']",
    )
    model = _model()
    trainer = popxl.compile(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                            loss_scaling="dynamic")  # fmt: skip
    trainer.step(x.float(), y.float())
    assert trainer.fused_reasons == (
        "dynamic loss scaling skips steps in the per-parameter update",
    )


@pytest.mark.parametrize("R,GA", [(2, 2), (4, 1)])
def test_sum_read_shares_the_accumulator_and_matches_the_reference(R, GA):
    """Note [replica-sum accumulators]: the kernel reads the replica-sum accumulator itself (no
    copy) and the fast executor trains as the reference executor does."""

    def model_fn():
        return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(),
                                   torch.nn.Linear(40, 5))  # fmt: skip

    gen = torch.Generator().manual_seed(2)
    n = 4 * R * GA
    batches = [(torch.randn(n, 12, generator=gen).numpy(),
                torch.randint(0, 5, (n,), generator=gen).numpy()) for _ in range(3)]  # fmt: skip
    _, fns = fast_matches_reference(model_fn, R, GA, batches)
    source = "\n".join(fn.source for fn in fns.values() if hasattr(fn, "source"))
    # the four gradients' and the loss count's reductions
    assert source.count("rt.sum_read(") == source.count("alias=True") == 5, source


@pytest.mark.parametrize("R,GA", [(4, 1), (2, 2)])
def test_sharded_p_grad_is_the_kernels_shard_gathered_in_place_with_eagers_values(R, GA):
    """Note [p.grad after a step]: with RTS the kernel writes each replica's shard of p.grad
    (91 and 21 elements: the last shards padded), which is gathered in place: no separate
    rescale, gather and copy. Weights, p.grad and momentum equal eager SGD's on the global
    batch, and every kernel call of the step writes its p.grad."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    ref = copy.deepcopy(model)

    def make(ps):
        return torch.optim.SGD(ps, lr=0.05, momentum=0.9)

    opt, opt_ref = make(model.parameters()), make(ref.parameters())
    trainer = popxl.compile(model, F.mse_loss, opt, replication_factor=R,
                            gradient_accumulation=GA, rts_threshold=16)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    n = 4 * R * GA
    for _ in range(3):
        x, y = torch.randn(n, 13, generator=gen), torch.randn(n, 3, generator=gen)
        trainer.step(x, y)
        eager_step(ref, opt_ref, x, y)
    trainer.sync_weights()
    assert_same_training(model, opt, ref, opt_ref)
    kernels = [op for op in trainer.ir.main_graph.ops
               if op.kind == "torch" and op.attrs.target is sgd_update_]  # fmt: skip
    assert len(kernels) == 4
    assert all(op.attrs.args[2] is not None for op in kernels)  # grad_out: p.grad or its shard
    shards = [op for op in trainer.ir.main_graph.ops
              if op.kind == "torch" and "replicated_reduce_scatter" in str(op.attrs.target)
              and op.attrs.args[1] == "local"]  # fmt: skip
    # the two sharded weights' slices and their p.grad's
    assert len(shards) == 4


@pytest.mark.parametrize("R,GA", [(1, 1), (2, 2), (2, 1)])
def test_accumulators_zeroed_then_added_once_are_written_by_a_copy(R, GA):
    """Note [zeroed accumulators written once]: the step zeroes the accumulators as it begins
    (Note [zeroed before the loop]) and its one add into each (a folded or single-pass loop)
    runs as a copy with no zeroing pass; the fast executor trains as the reference does."""
    gen = torch.Generator().manual_seed(4)
    n = 4 * R * GA
    batches = [(torch.randn(n, 12, generator=gen).numpy(),
                torch.randint(0, 5, (n,), generator=gen).numpy()) for _ in range(3)]  # fmt: skip

    def model_fn():
        return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(),
                                   torch.nn.Linear(40, 5))  # fmt: skip

    _, fns = fast_matches_reference(model_fn, R, GA, batches)
    aten = torch.ops.aten
    ops = {"zero_": aten.zero_.default, "copy_": aten.copy_.default, "add_": aten.add_.Tensor}
    calls = dict.fromkeys(ops, 0)
    for fn in fns.values():
        for name, value in fn.__globals__.items():
            for kind, op in ops.items():
                if value is op._op:  # the generated code calls the raw aten ops
                    calls[kind] += fn.source.count(f"{name}(")
    # four gradient accumulators: copied into, never zeroed nor added to; what is left is
    # the step counter's add and, over several micro-batches, the loss count's add and its
    # zeroing after its read (the old step: four zeroings and adds more). With replicas the
    # two weights' folded matmuls write their accumulators themselves instead of a copy (Note
    # [weight gradients into their accumulators] in runtime/lower.py)
    counted = int(R * GA > 1)
    into = sum(fn.source.count("MM_FOLD_INTO(") for fn in fns.values())
    assert into == (2 if R > 1 else 0)
    assert calls == {"zero_": counted, "copy_": 4 + counted - into, "add_": 1 + counted}, calls
