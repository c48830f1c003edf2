"""Note [Adam chain in three passes] (csrc/adam.cpp): ``torch_popxl::adam_chain_`` equals eager
torch's single-tensor Adam step bit for bit, whatever the tensor size (vectorised body and
tail), the lerp branch (1 - beta1 below or above 0.5), the thread count and the layout (the
three-pass kernel and the chain it falls back to); the compiled Adam step's equality with eager
torch is tests/test_compile_optimizer_exact.py's. With ``factors`` and ``grad_outs`` it also
does the compiled step's gradient finishing (rescale, ``p.grad`` copy) bit for bit, and the
compiled step calls it so, once per parameter."""

import copy

import pytest
import torch
import torch.nn.functional as F
from optim_checks import assert_same_training, kernel_steps_against_eager

import torch_popxl as popxl
from torch_popxl.opdefs import scalar_tensor


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """The kernels under test are the CPU simulator's; a trainer on a GPU (TORCH_POPXL_DEVICE=cuda)
    runs torch's own ops instead, so these tests pin the CPU."""
    monkeypatch.setenv("TORCH_POPXL_DEVICE", "cpu")


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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 17, 40010, 70001])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "chain_path"])
def test_factors_and_grad_out_equal_rescale_copy_then_eager_adam(n, threads, transposed):
    """The compiled step hands the kernel the unscaled accumulator: multiplied by each factor
    in turn (as the separate multiplies round), copied into p.grad, then eager's Adam step."""
    hyper = HYPER[1]
    p, acc, m, v = _state(n, seed=n + 5)
    acc = acc * 300.0
    factors = torch.tensor([1.0 / 256.0, 0.37], dtype=torch.float32)
    g = acc
    for k in range(len(factors)):  # what the kernel replaces
        g = g * factors[k]
    want = _eager(p, g, m, v, *hyper)
    got = [p.clone(), m.clone(), v.clone()]
    grad_out = torch.full((n,), float("nan"))
    acc_in = acc.clone()
    if transposed and n > 1:  # strided operands run the chain through ATen's ops
        got = [t.reshape(1, n).t() for t in got]
        grad_out, acc_in = grad_out.reshape(1, n).t(), acc_in.reshape(1, n).t()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scalar_tensor.adam_chain(*got[:1], acc_in, *got[1:], *_scalars(*hyper),
                                 grad_out=grad_out, factors=factors)  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert torch.equal(acc_in.reshape(n), acc), "the accumulator must not change"
    assert torch.equal(grad_out.reshape(n), g), "p.grad is the rescaled gradient"
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want, strict=True):
        a = a.reshape(n)
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item():.3e}"


def test_bad_grad_outs_and_factors_are_refused_before_anything_changes():
    p, g, m, v = _state(16, seed=4)
    kept = [p.clone(), m.clone(), v.clone()]
    scalars = _scalars(*HYPER[0])
    out = torch.zeros(16)
    with pytest.raises(
        ValueError, match=r"grad_outs must be empty .* one tensor per param \(1\), got 2"
    ):
        torch.ops.torch_popxl.adam_chain_([p], [g], [m], [v], *scalars, [out, out], None)
    with pytest.raises(ValueError, match=r"grad_outs\[0\] must have its gradient's shape \[16\]"):
        scalar_tensor.adam_chain(p, g, m, v, *scalars, grad_out=torch.zeros(15))
    with pytest.raises(ValueError, match=r"factors must be a 1-D float32 CPU tensor.*Double"):
        scalar_tensor.adam_chain(p, g, m, v, *scalars, grad_out=out,
                                 factors=torch.ones(1, dtype=torch.float64))  # fmt: skip
    for a, b in zip((p, m, v), kept, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(out, torch.zeros(16))


def _count_chain_calls(trainer, monkeypatch) -> list[tuple[int, int]]:
    """Counts ``adam_chain_`` calls of the trainer's program (the generated code binds the op
    or calls it through the stacked form), each as (how many p.grad it writes, how many
    factors it applies)."""
    calls: list[tuple[int, int]] = []

    def record(op):
        def counted(*args):
            lists, scalars = scalar_tensor._adam_args(args)
            calls.append((len(lists[4]), 0 if scalars[6] is None else scalars[6].numel()))
            return op(*args)

        return counted

    program = trainer.session._executor.program
    for k, v in list(program.globals.items()):
        if v is scalar_tensor._ADAM:
            program.globals[k] = record(v)
    monkeypatch.setattr(scalar_tensor, "_ADAM", record(scalar_tensor._ADAM))
    return calls


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 4))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
    ],
    ids=["adam", "adamw_decay", "adam_decay_keeps_the_rescale"],
)
def test_compiled_adam_step_finishes_gradients_in_the_kernel_and_trains_as_eager(make, monkeypatch):
    model = _mlp()
    _, opt, calls = kernel_steps_against_eager(
        model, make, lambda trainer: _count_chain_calls(trainer, monkeypatch)
    )
    n = len(list(model.parameters()))
    coupled_decay = opt.param_groups[0]["weight_decay"] and type(opt) is torch.optim.Adam
    # one call per parameter and step; it writes p.grad unless Adam's weight decay comes first
    assert [c[0] for c in calls] == [0 if coupled_decay else 1] * (2 * n), calls


def test_remote_sharded_adam_applies_the_count_factor_in_the_kernel_where_unsharded(monkeypatch):
    """R=2, GA=2, sharded off-chip state: the kernel gets the summed gradient and the loss
    count's factor, sharded or not; a sharded parameter's kernel writes its shard of p.grad,
    gathered as the parameter is (Note [p.grad after a step])."""
    model = _mlp()
    ref = copy.deepcopy(model)
    opt, opt_ref = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, ref))
    trainer = popxl.compile(model, F.cross_entropy, opt, replication_factor=2,
                            gradient_accumulation=2, rts_threshold=64,
                            optimizer_state="remote")  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, 12, generator=gen), torch.randint(0, 4, (16,), generator=gen))
               for _ in range(3)]  # fmt: skip
    calls: list[tuple[int, int]] = []
    for i, (x, y) in enumerate(batches):
        trainer.step(x, y)
        opt_ref.zero_grad()
        for xc, yc in zip(x.split(8), y.split(8), strict=True):
            (F.cross_entropy(ref(xc), yc) / 2).backward()
        opt_ref.step()
        if i == 0:
            calls = _count_chain_calls(trainer, monkeypatch)
    sharded = [p.numel() >= 64 for p in model.parameters()]
    assert any(sharded) and not all(sharded)
    assert calls == [(1, 1)] * (2 * len(sharded)), calls
    trainer.sync_weights()
    # the replicas' sum and the 4 micro-batches' order differ from eager's: not bit for bit
    assert_same_training(model, opt, ref, opt_ref)
