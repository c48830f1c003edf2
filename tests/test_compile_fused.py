"""popxl.compile with Adam/AdamW(fused=True): one fused kernel call per param group, with the
numbers of eager torch's fused optimizer (Note [fused optimizer updates] in compile.py).

``Elementwise`` computes its gradients with elementwise ops only, so the compiled program's
gradients equal eager torch's bit for bit (also summed over replicas and micro-batches) and
the optimizer update is compared exactly: parameters, exp_avg, exp_avg_sq and step. The MLP's
matmul gradients are summed in another order than eager's, so it is compared tightly.
"""

import copy
import importlib

import pytest
import torch

import torch_popxl as popxl
from torch_popxl.runtime import explicit as _explicit

# the module (``torch_popxl.compile`` the attribute is the function)
_compile = importlib.import_module("torch_popxl.compile")

EXACT = {"rtol": 0.0, "atol": 0.0}
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
LOOSE = {"rtol": 2e-4, "atol": 2e-5}  # tests/test_compile.py's: another formula's rounding


class Elementwise(torch.nn.Module):
    """A scalar 'loss' whose gradients are elementwise: ``2 w s``, ``2 b s``, ``s``."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(12))
        self.b = torch.nn.Parameter(torch.randn(4))
        self.c = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        s = x.sum(0)
        return (
            (self.w * self.w * s).sum() + (self.b * self.b * s[:4]).sum() + (self.c * s[:3]).sum()
        )


def _identity_loss(out, target):
    return out


def _cross_entropy(out, target):
    return torch.nn.functional.cross_entropy(out, target)


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))  # fmt: skip


CASES = {"elementwise": (Elementwise, _identity_loss), "mlp": (_mlp, _cross_entropy)}


def _batches(n, size, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 12, generator=gen), torch.randint(0, 4, (size,), generator=gen))
            for _ in range(n)]  # fmt: skip


def _groups(model, lr=1e-2):
    """Two param groups with their own learning rates: the first parameter, the rest."""
    params = list(model.parameters())
    return [{"params": params[:1], "lr": lr}, {"params": params[1:], "lr": 2 * lr}]


FUSED = {
    "adam": lambda m, fused=True: torch.optim.Adam(
        _groups(m), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2, fused=fused
    ),
    "adamw": lambda m, fused=True: torch.optim.AdamW(
        _groups(m), lr=1e-2, weight_decay=0.1, fused=fused
    ),
}


def _eager(model, loss_fn, opt, batches, chunks, between):
    """Eager torch on the whole batch, chunk by chunk as the compiled schedule sums it: the
    mean of ``chunks`` chunk gradients for the cross-entropy mean, their sum for
    ``Elementwise``, whose loss sums over the batch."""
    losses = []
    weight = 1.0 if loss_fn is _identity_loss else 1.0 / chunks
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for xc, yc in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            loss = loss_fn(model(xc), yc)
            (loss * weight).backward()
            total += loss.item() * weight
        opt.step()
        losses.append(total)
        between()
    return losses


def _run_both(case, make_opt, R, GA, steps=3, make_between=None, eager_opt=None, **kw):
    """Trains a copy compiled and a copy eagerly on the same batches; ``make_between(opt)``
    gives what runs after every step (an LR scheduler)."""
    make_model, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    batches = _batches(steps, 8 * R * GA)
    opt = make_opt(model)
    between = make_between(opt) if make_between else lambda: None
    trainer = popxl.compile(model, loss_fn, opt, replication_factor=R, gradient_accumulation=GA,
                            **kw)  # fmt: skip
    losses = []
    for x, y in batches:
        losses.append(trainer.step(x, y))
        between()
    ref_opt = (eager_opt or make_opt)(ref)
    ref_between = make_between(ref_opt) if make_between else lambda: None
    ref_losses = _eager(ref, loss_fn, ref_opt, batches, R * GA, ref_between)
    return trainer, (model, opt, losses), (ref, ref_opt, ref_losses)


def _assert_same(ours, theirs, tol):
    model, opt, losses = ours
    ref, ref_opt, ref_losses = theirs
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), **tol, msg=lambda m, n=n: f"{n}: {m}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], **tol)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize(
    "R,GA,executor", [(1, 1, "fast"), (1, 1, "reference"), (4, 2, "fast"), (4, 2, "reference")]
)
def test_fused_adam_equals_eager_fused_adam(kind, R, GA, executor):
    """Exact at R=1; with replicas the gradient mean is summed in another order than eager's
    accumulation over chunks, so the numbers agree to within a few float32 ulps."""
    trainer, ours, theirs = _run_both("elementwise", FUSED[kind], R, GA, executor=executor)
    assert trainer.fused_reasons == (None, None)
    _assert_same(ours, theirs, EXACT if R == 1 else TIGHT)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_fused_adam_differs_from_eager_single_tensor_adam(kind):
    """The exact equality above says which formula ran: torch's single-tensor Adam (what the
    compiled step runs without fused=True) rounds differently."""
    _, ours, theirs = _run_both(
        "elementwise", FUSED[kind], 1, 1, eager_opt=lambda m: FUSED[kind](m, fused=False)
    )
    _assert_same(ours, theirs, LOOSE)
    with pytest.raises(AssertionError):
        _assert_same(ours, theirs, EXACT)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("R,GA", [(1, 1), (4, 2)])
def test_fused_adam_trains_an_mlp_as_eager_fused_adam(kind, R, GA):
    trainer, ours, theirs = _run_both("mlp", FUSED[kind], R, GA)
    assert trainer.fused_reasons == (None, None)
    _assert_same(ours, theirs, TIGHT)


def test_without_fused_the_chain_runs_and_says_why():
    trainer, ours, theirs = _run_both("elementwise", lambda m: FUSED["adam"](m, fused=False), 4, 2)
    assert trainer.fused_reasons == ("the optimizer was not built with fused=True",) * 2
    _assert_same(ours, theirs, TIGHT)


@pytest.mark.parametrize("R,GA", [(1, 1), (4, 2)])
def test_lr_scheduler_between_fused_steps_changes_the_compiled_update(R, GA):
    def scheduler(opt):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        return sched.step

    trainer, ours, theirs = _run_both("elementwise", FUSED["adamw"], R, GA, steps=4,
                                      make_between=scheduler)  # fmt: skip
    assert ours[1].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**4)
    assert trainer.fused_reasons == (None, None)
    _assert_same(ours, theirs, EXACT if R == 1 else TIGHT)


def test_changing_betas_eps_or_weight_decay_rebuilds_and_carries_state():
    """The fused kernel takes betas, eps and weight decay as numbers: a change rebuilds the
    program, and training goes on from the same state as eager torch's."""

    def edit(opt):
        def apply():
            for g in opt.param_groups:
                g["betas"] = (g["betas"][0] - 0.05, g["betas"][1])
                g["eps"] *= 2
                g["weight_decay"] += 0.01

        return apply

    trainer, ours, theirs = _run_both("elementwise", FUSED["adam"], 1, 1, make_between=edit)
    assert trainer.fused_reasons == (None, None)
    _assert_same(ours, theirs, EXACT)


def test_dynamic_loss_scaling_keeps_the_chain_and_says_why():
    trainer, ours, theirs = _run_both("mlp", FUSED["adamw"], 4, 2, loss_scaling="dynamic")
    assert all(r is not None and "dynamic loss scaling" in r for r in trainer.fused_reasons), (
        trainer.fused_reasons
    )
    _assert_same(ours, theirs, LOOSE)  # the chain is torch's single-tensor formula


# Sharded (RTS) and off-chip optimizer state: the MLP's parameters of 16 values or more are
# sharded, its last bias (4 values) is not, so each sharded group also holds an unsharded
# member.
LAYOUTS = {
    "remote_rts": {"rts_threshold": 16, "optimizer_state": "remote"},
    "remote": {"optimizer_state": "remote"},
    "rts": {"rts_threshold": 16},
}


def _runs_explicitly_with_invariant_weights(trainer):
    """No fragment under vmap, and every weight (sharded or not) stored once for all replicas
    (Note [per-element list ops]: a shard in the group does not make the others per replica)."""
    executor = trainer.session._executor
    for name, fn in executor.fns.items():
        assert fn.explicit, (name, fn.vmap_reason)
    weights = {s.var.id for s in trainer._active.slots}
    assert weights <= executor.uniform, weights - executor.uniform


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS)
@pytest.mark.parametrize("R", [2, 4])
def test_fused_adamw_with_sharded_or_off_chip_state_equals_eager_fused_adamw(R, layout):
    """One fused call per group also over shards and off-chip state: eager fused AdamW's
    numbers (to within the R > 1 reduction order), no vmap, and the reference executor's. The
    MLP's shards divide its parameters, so they sit at the parameters' own positions and the
    update is the on-chip program's bit for bit (Note [per-element list ops])."""
    trainer, ours, theirs = _run_both("mlp", FUSED["adamw"], R, 2, **layout)
    assert trainer.fused_reasons == (None, None)
    sharded = [s.sharded for s in trainer._active.slots]
    assert sharded == ([True] * 5 + [False] if "rts_threshold" in layout else [False] * 6)
    _runs_explicitly_with_invariant_weights(trainer)
    _assert_same(ours, theirs, TIGHT)
    on_chip, whole, _ = _run_both("mlp", FUSED["adamw"], R, 2)
    assert on_chip.fused_reasons == (None, None)
    _assert_same(ours, whole, EXACT)
    reference, ref_ours, _ = _run_both("mlp", FUSED["adamw"], R, 2, executor="reference",
                                       **layout)  # fmt: skip
    assert reference.fused_reasons == (None, None)
    _assert_same(ours, ref_ours, TIGHT)  # one kernel call per replica: Note [per-element ...]


BF16_ULP = {"rtol": 2**-7, "atol": 1e-6}  # one bfloat16 rounding step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state", ["on_chip", "remote"])
@pytest.mark.parametrize("R", [2, 4])
def test_fused_adam_over_padded_shards_equals_the_unsharded_fused_update(R, state, dtype):
    """``rts_threshold=3`` shards every parameter of ``Elementwise``, the 3-value ``c`` with
    padding: the fast path, bfloat16 shards (cast through float32) included, gives the
    unsharded program's numbers to within the kernel's position-dependent rounding (Note
    [per-element list ops]) and eager's to within the R > 1 reduction order."""
    model = (lambda: Elementwise().to(dtype), _identity_loss)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CASES, "elementwise", model)
        sharded, ours, theirs = _run_both("elementwise", FUSED["adam"], R, 2, rts_threshold=3,
                                          optimizer_state=state)  # fmt: skip
        unsharded, whole, _ = _run_both("elementwise", FUSED["adam"], R, 2)
    assert sharded.fused_reasons == unsharded.fused_reasons == (None, None)
    assert all(s.sharded for s in sharded._active.slots)
    assert ours[0].c.dtype == dtype
    _runs_explicitly_with_invariant_weights(sharded)
    _assert_same(ours, whole, TIGHT if dtype == torch.float32 else BF16_ULP)
    if dtype == torch.float32:  # bfloat16 gradient means round differently from eager's
        _assert_same(ours, theirs, TIGHT)


@pytest.mark.parametrize("layout", ["remote_rts", "remote"])
def test_fused_update_moves_what_the_chain_moves(layout):
    """The fused update loads and stores every member's state once per step, as the chain
    does: the same counted traffic, predicted by the memory report and counted by the
    runtime. By hand (R=4): 2 states x 4 bytes x (values per replica, summed over replicas);
    remote_rts: 1600 sharded values (400 per replica) and the 4-value bias on each replica."""
    counters, sharded = {}, {}
    for fused in (True, False):
        trainer, ours, theirs = _run_both("mlp", lambda m, f=fused: FUSED["adamw"](m, fused=f),
                                          4, 2, **LAYOUTS[layout])  # fmt: skip
        assert (trainer.fused_reasons == (None, None)) == fused
        report = trainer.memory_report()
        assert dict(report.predicted_counters) == dict(report.measured_counters)
        counters[fused] = dict(report.measured_counters)
        sharded[fused] = sum(s.sharded for s in trainer._active.slots)
    # The chain's Adam kernel writes each sharded parameter's shard of p.grad, taken by a
    # local slice (a collective of 0 bytes: Note [p.grad after a step]); the rest is the same.
    assert sharded[False] == sharded[True] and (sharded[False] > 0) == (layout == "remote_rts")
    slices = counters[False].pop("num_collectives") - counters[True].pop("num_collectives")
    assert slices == sharded[False]
    assert counters[True] == counters[False]
    values = {"remote_rts": 1600 + 4 * 4, "remote": 4 * 1604}[layout]
    got = {k: counters[True][k] for k in ("remote_load_bytes", "remote_store_bytes",
                                           "num_remote_loads", "num_remote_stores")}  # fmt: skip
    assert got == {"remote_load_bytes": 2 * 4 * values, "remote_store_bytes": 2 * 4 * values,
                   "num_remote_loads": 12, "num_remote_stores": 12}  # fmt: skip


@pytest.mark.parametrize("layout", ["on_chip", "remote_rts", "rts"])
def test_fused_update_in_a_vmap_fragment_equals_eager(layout, monkeypatch):
    """A fragment with an op lacking an explicit-batching rule runs under vmap; the fused
    update inside it (on replica-invariant tensors, or on shards that vmap batches and
    ``per_element_stacked`` unwraps) still gives eager's numbers."""
    monkeypatch.setattr(_explicit, "vmap_reason", lambda *a: "forced by the test")
    trainer, ours, theirs = _run_both("mlp", FUSED["adam"], 4, 2, **LAYOUTS.get(layout, {}))
    executor = trainer.session._executor
    assert not any(getattr(fn, "explicit", True) for fn in executor.fns.values())
    assert trainer.fused_reasons == (None, None)
    _assert_same(ours, theirs, TIGHT)


def test_per_element_stacked_reads_non_contiguous_operands_by_their_strides():
    """torch's CPU fused kernel walks memory as if contiguous (a transposed parameter or an
    expanded gradient is misread); ``per_element_stacked`` runs it on contiguous copies and
    writes them back (Note [per-element list ops])."""
    gen = torch.Generator().manual_seed(0)
    p, m = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen).abs()
    g = torch.randn(3, generator=gen)
    kwargs = {"lr": torch.tensor(0.1), "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0,
              "eps": 1e-8, "amsgrad": False, "maximize": False}  # fmt: skip
    want = [p.clone(), g.expand(5, 3).clone(), m.clone(), m.clone()]
    torch._fused_adam_(*[[t] for t in want], [], [torch.tensor(2.0)], **kwargs)
    got = [p.t().contiguous().t(), g.expand(5, 3), m.clone(), m.clone()]  # column-major p
    assert not got[0].is_contiguous() and not got[1].is_contiguous()
    _explicit.per_element_stacked(torch._fused_adam_, *[[t] for t in got], [],
                                  [torch.tensor(2.0)], **kwargs)  # fmt: skip
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:], strict=True):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_adamw_on_16_bit_parameters_equals_eager_fused_adamw_exactly(dtype, monkeypatch):
    monkeypatch.setitem(CASES, "elementwise", (lambda: Elementwise().to(dtype), _identity_loss))
    trainer, ours, theirs = _run_both("elementwise", FUSED["adamw"], 1, 1)
    assert trainer.fused_reasons == (None, None)
    assert ours[0].w.dtype == dtype
    _assert_same(ours, theirs, EXACT)


def test_a_cuda_simulator_keeps_the_chain_and_says_why():
    """CUDA's fused kernel is not exercised here, so a CUDA program keeps the chain."""
    spec = _compile._GroupSpec("adam", ("w",), fused=(0.9, 0.999, 1e-8, 0.0))
    assert _compile._fused_reason(spec, [], False, "cpu") is None
    reason = _compile._fused_reason(spec, [], False, "cuda:0")
    assert reason is not None and "CPU simulator only" in reason
