"""Note [explicit batching]: replicated programs whose ops all have stacked rules run without
vmap; they must give exactly what the reference executor gives (per replica)."""

import copy

import numpy as np
import pytest
import torch
from optim_checks import fast_matches_reference, train_both

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.runtime import explicit as _explicit


def _store_each(named) -> dict:
    """A d2h stream and ``host_store`` for each ``(name, tensor)``: ``{name: stream}``."""
    outs = {}
    for name, t in named:
        st = popxl.d2h_stream(t.shape, t.dtype, name)
        ops.host_store(st, t)
        outs[name] = st
    return outs


def _explicit_matches_reference(build, x, runs=1, rtol=1e-6, atol=1e-6):
    """Build the program (``build() -> (ir, xs, outs, *variables)``) for each executor, run it
    ``runs`` times on ``x``: the fast executor's fragment is explicitly batched, and every
    output of every run and every variable afterwards has the reference executor's shape and
    values."""
    results = {}
    for executor in ("fast", "reference"):
        ir, xs, outs, *variables = build()
        session = popxl.Session(ir, "ipu_model", executor=executor)
        if executor == "fast":
            fn = session._executor.fns["normal"]
            assert fn.explicit, fn.vmap_reason
        with session:
            got = {}
            for i in range(runs):
                out = session.run({xs: x})
                got.update({f"{k}{i}": out[st] for k, st in outs.items()})
            got.update({v.name: session.get_tensor_data(v) for v in variables})
            results[executor] = got
    for k, want in results["reference"].items():
        assert results["fast"][k].shape == want.shape, k
        np.testing.assert_allclose(results["fast"][k], want, rtol=rtol, atol=atol, err_msg=k)


def _build(R):
    rng = np.random.default_rng(0)
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        w = popxl.variable(rng.normal(size=(6, 5)).astype(np.float32), name="w")  # invariant
        b = popxl.variable(rng.normal(size=(5,)).astype(np.float32), name="b")
        per = popxl.variable(rng.normal(size=(R, 4, 6)).astype(np.float32), name="per",
                             replica_grouping=ir.replica_grouping(1, 1))  # fmt: skip
        xs = popxl.h2d_stream((4, 6), popxl.float32, "x")
        ls = popxl.h2d_stream((4,), popxl.int32, "labels")
        x = ops.host_load(xs)
        h = torch.nn.functional.gelu(x @ w + b)  # mm(B, U) + broadcast
        m = torch.matmul(per.transpose(0, 1), x)  # mm(B, B) via t
        u = torch.matmul(w.transpose(0, 1), m)  # mm(U, B)
        s = torch.softmax(h, dim=-1)
        picked = torch.gather(s, 1, ops.host_load(ls).long().unsqueeze(1))
        red = picked.sum() + h.mean(dim=0).amax() + u.sum(dim=[0, 1])
        scattered = torch.zeros(4, 5).scatter_add(1, torch.zeros(4, 1, dtype=torch.int64), h)
        v = h.reshape(2, 10).view(20) * 2.0
        g = ops.collectives.replicated_all_reduce(h.sum(dim=0), "mean")
        ops.scaled_add_(b, g, b=-0.1)  # invariant update
        outs = _store_each((("h", h), ("m", m), ("u", u), ("red", red), ("scattered", scattered),
                        ("v", v), ("g", g), ("picked", picked)))  # fmt: skip
    return ir, xs, ls, outs, b


@pytest.mark.parametrize("R", [2, 4])
def test_explicitly_batched_program_matches_the_reference(R):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(R, 4, 6)).astype(np.float32)
    labels = rng.integers(0, 5, size=(R, 4)).astype(np.int32)
    results = {}
    for executor in ("fast", "reference"):
        ir, xs, ls, outs, b = _build(R)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        if executor == "fast":
            assert session._executor.fns["normal"].explicit, session.generated_code()
        with session:
            out = session.run({xs: x, ls: labels})
            results[executor] = {k: out[s] for k, s in outs.items()}
            results[executor]["b"] = session.get_tensor_data(b)
    for k, want in results["reference"].items():
        np.testing.assert_allclose(results["fast"][k], want, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("single_op_vmap", [True, False])
def test_programs_with_other_ops_fall_back_to_vmap(single_op_vmap, monkeypatch):
    # roll has no explicit rule: it runs alone under vmap in an explicit fragment (Note [one
    # op through torch's batching rule]); without that, the whole fragment runs under vmap
    if not single_op_vmap:
        monkeypatch.setattr(_explicit, "_one_op_vmap_ok", lambda f, a: False)
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        x = popxl.variable(
            np.ones((2, 2, 3), np.float32), replica_grouping=ir.replica_grouping(1, 1)
        )
        y = torch.roll(x.cumsum(dim=1), 1, dims=1)  # roll has no explicit rule
        st = popxl.d2h_stream(y.shape, y.dtype)
        ops.host_store(st, y)
    session = popxl.Session(ir, "ipu_model")
    assert session._executor.fns["normal"].explicit == single_op_vmap
    with session:
        want = np.roll(np.cumsum(np.ones((2, 3)), axis=1), 1, axis=1)[None].repeat(2, 0)
        np.testing.assert_array_equal(session.run()[st], want)  # (replicas, 2, 3)


def _build_remote_rts(R, group_size):
    """Remote memory, RTS slices and gathers and grouped collectives, on batched and
    replica-invariant values (the ops ``popxl.compile`` uses with off-chip sharded state)."""
    rng = np.random.default_rng(2)
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        rg = ir.replica_grouping(group_size=group_size)
        rb = popxl.remote_buffer((8,), popxl.float32, entries=3)
        remote_w = popxl.remote_variable(rng.normal(size=(8,)).astype(np.float32), rb, 0)
        inv = popxl.variable(rng.normal(size=(8,)).astype(np.float32), name="inv")  # invariant
        xs = popxl.h2d_stream((8,), popxl.float32, "x")
        offs = popxl.h2d_stream((), popxl.int32, "offset")
        x = ops.host_load(xs)
        w = ops.remote_load(rb, 0)  # a constant offset
        ops.remote_store(rb, 1, x * w)  # a batched value
        ops.remote_store(rb, 2, inv)  # a replica-invariant value
        per_replica = ops.remote_load(rb, ops.host_load(offs))  # batched offsets
        into = popxl.variable(np.zeros(8, np.float32), name="into")
        ops.remote_load_(rb, 1, into)
        shard = ops.collectives.replica_sharded_slice(per_replica, group=rg)
        inv_shard = ops.collectives.replicated_reduce_scatter(inv, group=rg)
        summed = ops.collectives.replicated_reduce_scatter(x + into, "add", group=rg)
        gathered = ops.collectives.replicated_all_gather(shard + summed, group=rg)
        inv_gathered = ops.collectives.replicated_all_gather(inv_shard, group=rg)
        reduced = ops.collectives.replicated_all_reduce(gathered, "mean", group=rg)
        inv_reduced = ops.collectives.replicated_all_reduce(inv, group=rg)
        owned = ops.collectives.replicated_slice(x.reshape((group_size, -1)), group=rg)
        outs = _store_each((("shard", shard), ("inv_shard", inv_shard), ("summed", summed),
                        ("gathered", gathered), ("inv_gathered", inv_gathered),
                        ("reduced", reduced), ("inv_reduced", inv_reduced), ("owned", owned),
                        ("per_replica", per_replica)))  # fmt: skip
    return ir, xs, offs, outs, (remote_w, into)


@pytest.mark.parametrize("R,group_size", [(1, 1), (2, 2), (2, 1), (4, 4), (4, 2)])
def test_remote_rts_and_grouped_collectives_run_explicitly_and_match_the_reference(R, group_size):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(R, 8)).astype(np.float32)
    offsets = (np.arange(R) % 3).astype(np.int32)  # each replica reads its own slot
    if R == 1:  # no replica dimension on the host side
        x, offsets = x[0], offsets[0]
    results = {}
    for executor in ("fast", "reference"):
        ir, xs, offs, outs, variables = _build_remote_rts(R, group_size)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        if executor == "fast" and R > 1:
            fn = session._executor.fns["normal"]
            assert fn.explicit, fn.vmap_reason
        with session:
            got = {}
            for _ in range(2):  # the second run reads what the first stored
                out = session.run({xs: x, offs: offsets})
                got.update({f"{k}{_}": out[s] for k, s in outs.items()})
            got.update({v.name: session.get_tensor_data(v) for v in variables})
            results[executor] = got
    for k, want in results["reference"].items():
        np.testing.assert_allclose(results["fast"][k], want, rtol=1e-5, atol=1e-6, err_msg=k)


def _tiny_mlp():
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))


_OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, 1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, 1e-2, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, 1e-2, momentum=0.9),
}


@pytest.mark.parametrize("R,opt", [(1, "adam"), (2, "adam"), (4, "adam"), (2, "adamw"),
                                   (4, "sgd_momentum")])  # fmt: skip
@pytest.mark.parametrize("layout", [dict(), dict(rts_threshold=16, optimizer_state="remote"),
                                    dict(optimizer_state="remote")],
                         ids=["on_chip", "remote_rts", "remote"])  # fmt: skip
def test_compiled_training_runs_explicitly_and_matches_the_reference(R, opt, layout):
    """The seed-style compile program (cross-entropy, accumulation loop, optimizer), on-chip
    and with sharded off-chip optimizer state, runs without vmap, with the accumulation loop
    folded (Note [fold the accumulation loop]; at R = 1 too: Note [one replica, stacked]) and
    the update in place (Note [update in place]), and equals the reference executor."""
    GA, micro = 2, 3
    rng = np.random.default_rng(4)
    data = [(rng.normal(size=(R * GA * micro, 12)).astype(np.float32),
             rng.integers(0, 5, R * GA * micro)) for _ in range(2)]  # fmt: skip
    params = {}
    for executor in ("fast", "reference"):
        torch.manual_seed(0)
        model = _tiny_mlp()
        trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                                _OPTIMIZERS[opt](model.parameters()), replication_factor=R,
                                gradient_accumulation=GA, executor=executor, **layout)  # fmt: skip
        losses = [trainer.step(x, y) for x, y in data]
        if executor == "fast":
            for name, fn in trainer.session._executor.fns.items():
                assert fn.explicit, (name, fn.vmap_reason)
            assert "iterations folded" in trainer.session._executor.source()
            if layout.get("optimizer_state") == "remote":
                # Note [replica-invariant remote buffers]: unsharded off-chip state is read
                # once (row 0) and the weights it updates stay replica-invariant
                executor_ = trainer.session._executor
                assert ")[0]" in executor_.source()
                weights = {slot.var.id for slot in trainer._active.slots}
                assert weights <= executor_.uniform, weights - executor_.uniform
        params[executor] = ([p.detach().clone() for p in model.parameters()], losses)
    for got, want in zip(params["fast"][0], params["reference"][0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(params["fast"][1], params["reference"][1], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _sgd_momentum(params, lr):
    return torch.optim.SGD(params, lr, momentum=0.9)


class _SafeSoftmaxAttention(torch.nn.Module):
    """Single-head attention through ``torch._safe_softmax`` (what torch's math attention,
    taken by ``scaled_dot_product_attention`` with dropout on the CPU, calls): a masked row
    gives zeros, not NaN."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2)
        keep = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        keep[0] = False  # the first query sees no key
        scores = scores.masked_fill(~keep, float("-inf"))
        return self.head((torch._safe_softmax(scores, -1) @ v).mean(1))


def test_safe_softmax_runs_stacked_and_keeps_off_chip_state_replica_invariant():
    """``_safe_softmax`` has a stacked form (its dim moves past the replicas): the program
    stays explicitly batched, so unsharded off-chip state is read once and the weights it
    updates stay replica-invariant (Note [replica-invariant remote buffers]); the losses and
    weights equal eager torch's on the whole batch."""
    R, GA, micro = 2, 2, 3
    rng = np.random.default_rng(5)
    data = [(rng.normal(size=(R * GA * micro, 5, 8)).astype(np.float32),
             rng.integers(0, 3, R * GA * micro)) for _ in range(2)]  # fmt: skip
    torch.manual_seed(0)
    # SGD: Adam would turn the rounding noise of the key bias's (exactly zero) gradient
    # into full steps
    trainer = train_both(_SafeSoftmaxAttention(), torch.nn.functional.cross_entropy, data, R, GA,
                         optimizer=_sgd_momentum, rtol=1e-5, atol=1e-6, rts_threshold=64,
                         optimizer_state="remote")  # fmt: skip
    executor = trainer.session._executor
    for name, fn in executor.fns.items():
        assert fn.explicit, (name, fn.vmap_reason)
    small = {slot.var.id for slot in trainer._active.slots if slot.var.nelms <= 64}
    assert small and small <= executor.uniform, small - executor.uniform


class _SequenceOps(torch.nn.Module):
    """An LSTM (``unbind`` and ``unsafe_split`` of its steps and gates), ``F.pad``
    (``constant_pad_nd``), ``new_zeros``, a fill with a 0-d tensor, rotary embeddings'
    rotate-half (``slice_backward`` in the gradient) and ``cumsum``."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(6, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 3)
        self.register_buffer("start", torch.tensor(0.5))

    def forward(self, x):
        h, _ = self.rnn(torch.nn.functional.pad(x, (0, 0, 1, 0)))
        h = h + torch.cat([-h[..., 4:], h[..., :4]], -1)
        h = h.cumsum(1) / h.shape[1]
        extra = h.new_zeros(h.shape[0], 1, 8).fill_(self.start)
        return self.head(torch.cat([h, extra], 1).mean(1))


class _ConvOps(torch.nn.Module):
    """Convolutions with batch norm in eval mode (its empty saved statistics) and the
    activations torch does not tag pointwise (hardswish, mish_, leaky_relu, elu, softplus)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4).eval()
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = torch.nn.functional.hardswish(self.bn(self.conv(x)))
        h = torch.nn.functional.mish(h, inplace=True) + torch.nn.functional.leaky_relu(h, 0.1)
        h = torch.nn.functional.elu(h) + torch.nn.functional.softplus(h, beta=2.0)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("model,shape", [(_SequenceOps, (5, 6)), (_ConvOps, (2, 6, 6))],
                         ids=["sequence", "conv"])  # fmt: skip
def test_more_model_ops_run_stacked_and_train_as_eager(model, shape):
    """Ops of RNNs, T5/GPT-2 and mobile CNNs have stacked forms: every fragment of the
    compiled program is explicitly batched (no vmap), and losses and weights equal eager
    torch's on the whole batch."""
    R, GA, micro = 2, 2, 3
    rng = np.random.default_rng(9)
    data = [(rng.normal(size=(R * GA * micro, *shape)).astype(np.float32),
             rng.integers(0, 3, R * GA * micro)) for _ in range(2)]  # fmt: skip
    torch.manual_seed(0)
    trainer = train_both(model(), torch.nn.functional.cross_entropy, data, R, GA,
                         optimizer=_sgd_momentum, rtol=1e-5, atol=1e-6)  # fmt: skip
    for name, fn in trainer.session._executor.fns.items():
        assert fn.explicit, (name, fn.vmap_reason)


class _Tally(torch.nn.Module):
    """Adds what it sees to a buffer: every iteration's write depends on that iteration's
    data, so an accumulation loop through it cannot fold (Note [fold the accumulation
    loop]; batch norm's running statistics fold)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(x.detach().abs().sum())
        return x


@pytest.mark.parametrize("GA,tally", [(1, False), (4, True)], ids=["no_loop", "tally"])
def test_one_replica_runs_the_plain_program_when_no_loop_folds(GA, tally):
    """Note [one replica, stacked]: R = 1 keeps the stacked lowering only when an accumulation
    loop folds. Without a loop, or with one that cannot fold (a buffer updated with every
    iteration's data), the program runs as the plain per-replica function; with GA = 1 that
    is eager's arithmetic bit for bit."""
    rng = np.random.default_rng(7)
    data = [(rng.normal(size=(GA * 4, 12)).astype(np.float32), rng.integers(0, 5, GA * 4))
            for _ in range(3)]  # fmt: skip

    def model():
        torch.manual_seed(0)
        norm = _Tally() if tally else torch.nn.Identity()
        return torch.nn.Sequential(torch.nn.Linear(12, 16), norm, torch.nn.GELU(),
                                   torch.nn.Linear(16, 5))  # fmt: skip

    got = model()
    trainer = popxl.compile(got, torch.nn.functional.cross_entropy,
                            torch.optim.SGD(got.parameters(), 0.1), gradient_accumulation=GA)  # fmt: skip
    dev = trainer.device  # eager on the simulator's device (TORCH_POPXL_DEVICE=cuda: the GPU)
    want = model().to(dev)
    opt = torch.optim.SGD(want.parameters(), 0.1)
    for x, y in data:
        loss = trainer.step(x, y)
        executor = trainer.session._executor
        assert not executor.program.folded_loops
        assert not any(fn.explicit for fn in executor.fns.values())
        if not tally:
            opt.zero_grad()
            eager = torch.nn.functional.cross_entropy(
                want(torch.from_numpy(x).to(dev)), torch.from_numpy(y).to(dev)
            )
            eager.backward()
            opt.step()
            assert loss == eager.item()
    if not tally:
        # bit for bit on the CPU; a GPU's eager SGD (foreach) may round its update differently
        exact = {"rtol": 0, "atol": 0} if dev.type == "cpu" else {"rtol": 1e-6, "atol": 1e-7}
        for a, b in zip(got.parameters(), want.parameters(), strict=True):
            torch.testing.assert_close(a, b.cpu(), **exact)
    else:
        assert all(torch.isfinite(p).all() for p in got.parameters())


@pytest.mark.parametrize("R", [1, 2])
def test_an_accumulation_loop_with_dropout_folds_and_every_row_draws_its_own_mask(R):
    """Note [fold the accumulation loop]: dropout's ``bernoulli_`` writes only the mask its own
    iteration made, so the loop folds (one matmul per layer for every micro-batch); every
    micro-batch and replica still draws its own mask, dropping about p of the elements and
    scaling the rest by 1 / (1 - p), as eager's dropout does."""
    GA, micro, width, p = 4, 16, 16, 0.5
    model = torch.nn.Sequential(torch.nn.Dropout(p), torch.nn.Linear(width, width))
    with torch.no_grad():  # the identity: the step's outputs are dropout's
        model[1].weight.copy_(torch.eye(width))
        model[1].bias.zero_()
    trainer = popxl.compile(model, lambda out, y: out.pow(2).mean(), torch.optim.SGD(
        model.parameters(), 0.0), replication_factor=R, gradient_accumulation=GA,
        return_outputs=True)  # fmt: skip
    x = np.full((R * GA * micro, width), 2.0, np.float32)
    _, out = trainer.step(x, np.zeros(R * GA * micro, np.float32))
    assert trainer.session._executor.program.folded_loops
    out = torch.as_tensor(np.asarray(out))
    assert set(out.unique().tolist()) <= {0.0, 4.0}  # kept: 2 / (1 - p)
    dropped = (out == 0).double().mean().item()
    assert 0.4 < dropped < 0.6, dropped  # 1,024 or more draws: 4.5 sigma either side
    masks = (out == 0).reshape(R * GA, micro * width)
    assert len({tuple(m.tolist()) for m in masks}) == R * GA  # no two micro-batches alike


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32])
def test_stacked_nll_loss_matches_per_replica_nll_loss(reduction, ignore, target_dtype):
    """The stacked nll_loss forward/backward rules equal aten's per replica, including
    ignored targets."""
    from torch_popxl.runtime import explicit

    torch.manual_seed(0)
    R, N, C = 3, 5, 4
    x = torch.randn(R, N, C).log_softmax(-1)
    target = torch.randint(0, C, (R, N))
    if ignore:
        target[0, 1] = target[2, 4] = -100
    red = {"mean": 1, "sum": 2}[reduction]
    given = target.to(target_dtype)
    out, total = explicit._nll_forward_stacked(x, given, None, red, -100)
    grad = torch.randn(R)
    got = explicit._nll_backward_stacked(grad, x, given, None, red, -100, total)
    aten = torch.ops.aten
    for r in range(R):
        o, t = aten.nll_loss_forward(x[r], target[r], None, red, -100)
        torch.testing.assert_close(out[r], o)
        torch.testing.assert_close(total[r], t)
        g = aten.nll_loss_backward(grad[r], x[r], target[r], None, red, -100, t)
        torch.testing.assert_close(got[r], g)


def _build_loop(R, variant):
    """A repeat loop over 4 micro-batches: ``plain`` only loads and stores (foldable),
    ``carried`` also counts its iterations (a loop-carried result), ``writes`` updates a
    variable in every iteration (each iteration sees the previous one's write)."""
    ir = popxl.Ir(replication=R)
    ir.num_host_transfers = 4
    with ir.main_graph, popxl.in_sequence():
        W = popxl.variable(np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2), name="W")
        b = popxl.variable(np.array([0.5, -0.5], np.float32), name="b")
        xs = popxl.h2d_stream((5, 3), popxl.float32, "x")
        ys = popxl.d2h_stream((5, 2), popxl.float32, "y")

        def body(*args):
            W, b = args[-2:]
            x = ops.host_load(xs)
            ops.host_store(ys, torch.nn.functional.gelu(x @ W + b).log_softmax(-1))
            if variant == "writes":
                ops.scaled_add_(b, x.sum(0)[:2], b=0.01)
            return (args[0] + 1.0,) if variant == "carried" else ()

        extra = [popxl.constant(0.0, popxl.float32)] if variant == "carried" else []
        specs = [popxl.TensorSpec((), popxl.float32)] if variant == "carried" else []
        g = ir.create_graph(body, *specs, W, b)
        ops.repeat(g, 4, *extra, W, b)
    return ir, xs, ys, b


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("variant", ["plain", "carried", "writes"])
def test_a_loop_folds_only_when_its_iterations_are_independent(R, variant):
    """Note [fold the accumulation loop]: the folded pass gives every iteration's stores in
    order, as the reference executor does; a loop whose iterations depend on each other is
    not folded and still matches."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, R, 5, 3)).astype(np.float32)
    results = {}
    for executor in ("fast", "reference"):
        ir, xs, ys, b = _build_loop(R, variant)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        if executor == "fast":
            source = session._executor.source()
            assert ("iterations folded" in source) == (variant == "plain"), source
        with session:
            results[executor] = (session.run({xs: x})[ys], session.get_tensor_data(b))
    np.testing.assert_allclose(results["fast"][0], results["reference"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results["fast"][1], results["reference"][1], rtol=1e-5, atol=1e-6)
    if variant != "writes":  # by hand: every micro-batch of every replica on its own
        W = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
        want = torch.nn.functional.gelu(torch.from_numpy(x @ W + np.array([0.5, -0.5], np.float32)))
        np.testing.assert_allclose(
            results["fast"][0], want.log_softmax(-1).numpy(), rtol=1e-5, atol=1e-6
        )


def _build_update(R):
    """Update chains with hazards for Note [update in place] and Note [scratch buffers]: a
    value read between a chain's first op and its copy-back, a temporary that is stored, a
    temporary read twice, and a plain chain that may run in place."""
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        v = popxl.variable(np.linspace(1, 2, 6, dtype=np.float32), name="v")
        w = popxl.variable(np.linspace(2, 3, 6, dtype=np.float32), name="w")
        xs = popxl.h2d_stream((6,), popxl.float32, "x")
        g = ops.collectives.replicated_all_reduce(ops.host_load(xs), "mean")  # invariant
        t = v * 0.5  # its chain is copied back into v, but v is read before the copy
        early = v + 1.0
        t = torch.addcmul(t, g, g)
        v.copy_(t)
        s = torch.sqrt(w)  # stored: must not live in a reused buffer
        twice = s * s + s
        d = torch.div(w, torch.sqrt(w) + 1e-3)  # a chain that stays inside: may be scratch
        w.copy_(torch.lerp(w, d, 0.25))
        outs = {}
        for name, value in (("early", early), ("s", s), ("twice", twice), ("d", d)):
            st = popxl.d2h_stream(value.shape, value.dtype, name)
            ops.host_store(st, value)
            outs[name] = st
    return ir, xs, outs, (v, w)


@pytest.mark.parametrize("R", [2, 4])
def test_in_place_updates_and_scratch_buffers_keep_the_programs_values(R):
    rng = np.random.default_rng(6)
    results = {}
    for executor in ("fast", "reference"):
        ir, xs, outs, variables = _build_update(R)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        got = []
        with session:
            for _ in range(3):  # buffers reused across runs must not leak into old results
                x = rng.normal(size=(R, 6)).astype(np.float32)
                out = session.run({xs: x})
                got.append({k: out[s] for k, s in outs.items()})
                got[-1].update({t.name: session.get_tensor_data(t) for t in variables})
        results[executor] = got
        rng = np.random.default_rng(6)
    for run_f, run_r in zip(results["fast"], results["reference"], strict=True):
        for k, want in run_r.items():
            np.testing.assert_allclose(run_f[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
    # by hand, first run: ``early`` sees v before its update
    v0 = np.linspace(1, 2, 6, dtype=np.float32)
    np.testing.assert_allclose(
        results["fast"][0]["early"], np.broadcast_to(v0 + 1, (R, 6)), rtol=1e-6
    )


class _TinyGPT(torch.nn.Module):
    """GPT-2's ops at toy size: embeddings, layer norms, causal attention (split, transpose,
    expand, bmm), tanh GELU, an LM head tied to the token embedding."""

    def __init__(self, vocab=11, width=8, heads=2, seq=5, attention="manual"):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(seq, width)
        self.ln_1 = torch.nn.LayerNorm(width)
        # no attention bias: softmax makes the key bias's gradient exactly zero, and Adam
        # would turn its rounding noise into updates of either sign
        self.c_attn = torch.nn.Linear(width, 3 * width, bias=False)
        self.c_proj = torch.nn.Linear(width, width)
        self.ln_2 = torch.nn.LayerNorm(width)
        self.c_fc = torch.nn.Linear(width, 2 * width)
        self.mlp_proj = torch.nn.Linear(2 * width, width)
        self.ln_f = torch.nn.LayerNorm(width)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, ids):
        b, t = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(t))
        q, k, v = self.c_attn(self.ln_1(x)).split(x.shape[-1], dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if self.attention == "manual":
            scores = (q @ k.transpose(-1, -2)).masked_fill(~self.mask[:t, :t], -1e9)
            a = torch.softmax(scores, dim=-1) @ v
        elif self.attention == "sdpa_causal":
            a = sdpa(q, k, v, is_causal=True)
        elif self.attention == "sdpa_mask":  # one [t, t] mask for every sequence
            a = sdpa(q, k, v, attn_mask=self.mask[:t, :t])
        elif self.attention == "sdpa_batch_mask":  # the same mask, one row per sequence
            a = sdpa(q, k, v, attn_mask=self.mask[:t, :t].expand(b, 1, t, t))
        else:  # "sdpa_row_mask": a mask per sequence, from its tokens (a replica's own rows)
            keep = (ids != 0)[:, None, None, :] | torch.eye(t, dtype=torch.bool)
            a = sdpa(q, k, v, attn_mask=keep & self.mask[:t, :t])
        a = a.transpose(1, 2).reshape(b, t, -1)
        x = x + self.c_proj(a)
        h = torch.nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        h1, h2 = h.split(x.shape[-1], dim=-1)
        x = x + self.mlp_proj(torch.cat([h2, h1], dim=-1))
        return self.ln_f(x) @ self.wte.weight.t()


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


@pytest.mark.parametrize("R,attention", [(2, "manual"), (3, "manual"), (2, "sdpa_causal"),
                                         (3, "sdpa_mask"), (2, "sdpa_batch_mask"),
                                         (2, "sdpa_row_mask")])  # fmt: skip
@pytest.mark.parametrize("layout", [dict(), dict(rts_threshold=16, optimizer_state="remote")],
                         ids=["on_chip", "remote_rts"])  # fmt: skip
def test_compiled_gpt_runs_explicitly_and_matches_the_reference_and_eager(R, attention, layout):
    """A GPT-style program (embedding and its dense backward, layer norms with replica-invariant
    or per-replica off-chip weights, split/transpose/expand/bmm/cat, or torch's fused attention
    with a causal flag, one shared mask or a mask per sequence) runs without vmap with the
    accumulation loop folded, and trains as the reference executor and eager torch do (R=3:
    the weights do not divide into shards, the copy path of Note [RTS updates in place])."""
    GA, micro, seq, vocab = 2, 2, 5, 11
    rng = np.random.default_rng(7)
    tokens = [rng.integers(0, vocab, (R * GA * micro, seq + 1)) for _ in range(2)]
    params = {}
    for executor in ("fast", "reference", "eager"):
        torch.manual_seed(0)
        model = _TinyGPT(vocab=vocab, seq=seq, attention=attention)
        opt = torch.optim.AdamW(model.parameters(), 1e-2, weight_decay=0.1)
        if executor == "eager":  # the same schedule: R * micro rows per micro-batch, mean loss
            for t in tokens:
                x, y = torch.from_numpy(t[:, :-1]), torch.from_numpy(t[:, 1:])
                opt.zero_grad()
                for xc, yc in zip(x.split(R * micro), y.split(R * micro), strict=True):
                    (_lm_loss(model(xc), yc) / GA).backward()
                opt.step()
            params[executor] = [p.detach().clone() for p in model.parameters()]
            continue
        trainer = popxl.compile(model, _lm_loss, opt, replication_factor=R,
                                gradient_accumulation=GA, executor=executor, **layout)  # fmt: skip
        for t in tokens:
            trainer.step(t[:, :-1], t[:, 1:])
        if executor == "fast":
            for name, fn in trainer.session._executor.fns.items():
                assert fn.explicit, (name, fn.vmap_reason)
            assert "iterations folded" in trainer.session._executor.source()
        params[executor] = [p.detach().clone() for p in model.parameters()]
    for got, want in zip(params["fast"], params["reference"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(params["fast"], params["eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_hugging_face_gpt2_trains_without_vmap_as_eager_torch_does():
    """Hugging Face's GPT-2 (built from a tiny config, its own attention code: torch's fused
    attention with the mask it builds) runs explicitly batched through popxl.compile and
    trains as eager torch does on the same schedule."""
    transformers = pytest.importorskip("transformers")
    R, GA, micro, seq, vocab = 2, 2, 2, 8, 40
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=16, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(config)

        def forward(self, ids):
            return self.gpt(input_ids=ids).logits

    rng = np.random.default_rng(3)
    tokens = [rng.integers(0, vocab, (R * GA * micro, seq + 1)) for _ in range(2)]
    torch.manual_seed(0)
    model = Logits()
    eager = copy.deepcopy(model)
    trainer = popxl.compile(model, _lm_loss, torch.optim.AdamW(model.parameters(), 1e-3),
                            replication_factor=R, gradient_accumulation=GA)  # fmt: skip
    opt = torch.optim.AdamW(eager.parameters(), 1e-3)
    for t in tokens:
        losses = trainer.step(t[:, :-1], t[:, 1:])
        x, y = torch.from_numpy(t[:, :-1]), torch.from_numpy(t[:, 1:])
        opt.zero_grad()
        eager_losses = []
        for xc, yc in zip(x.split(R * micro), y.split(R * micro), strict=True):
            loss = _lm_loss(eager(xc), yc)
            (loss / GA).backward()
            eager_losses.append(loss.item())
        opt.step()
        np.testing.assert_allclose(losses, np.mean(eager_losses), rtol=1e-5)
    for name, fn in trainer.session._executor.fns.items():
        assert fn.explicit, (name, fn.vmap_reason)
    for got, want in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-4, atol=1e-5)


def _remote_round_trips(R):
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        rb = popxl.remote_buffer((3,), popxl.float32, entries=3)
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        x = ops.host_load(xs)
        a = ops.remote_load(rb, 0)  # a round trip: runs as a view of the slots
        a += x
        ops.remote_store(rb, 0, a)
        b = ops.remote_load(rb, 1)  # used after its store: a copy
        b += x * 2.0
        ops.remote_store(rb, 1, b)
        c = ops.remote_load(rb, 2)  # a round trip, but the buffer is read in between: a copy
        d = ops.remote_load(rb, 1)
        c += d
        ops.remote_store(rb, 2, c)
        outs = _store_each((
            ("b", b),
            ("slot0", ops.remote_load(rb, 0)),
            ("slot1", ops.remote_load(rb, 1)),
        ))  # fmt: skip
    return ir, xs, outs


@pytest.mark.parametrize("R", [2, 4])
def test_remote_round_trips_as_slot_views_keep_values_and_traffic(R):
    """Note [remote slot views]: a load updated in place and stored back to its fixed slot
    runs as a view of the slots; the values (over several runs) are the reference executor's,
    the counted remote traffic is what every load and store moves (the store of the view
    calls the kernel directly, which checks and counts it), and loads whose value is used
    after the store, or whose buffer is read before the store, stay copies."""
    rng = np.random.default_rng(3)
    xs_data = [rng.normal(size=(R, 3)).astype(np.float32) for _ in range(3)]
    results, traffic = {}, {}
    for executor in ("fast", "reference"):
        ir, xs, outs = _remote_round_trips(R)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        if executor == "fast":
            code = session.generated_code()
            assert code.count("REMOTE_VIEW(") == 1, code
            assert code.count("REMOTE_STORE_STACKED(") == 1, code  # only the view's store
        with session:
            runs = [session.run({xs: x}) for x in xs_data]
            traffic[executor] = session._last_run_counters
        results[executor] = [{k: run[s] for k, s in outs.items()} for run in runs]
    for got, want in zip(results["fast"], results["reference"], strict=True):
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
    # every load and store moves one 3-float slot per replica, view or not (by hand: 6 loads,
    # 3 stores per run)
    got = {k: traffic["fast"][k] for k in ("remote_load_bytes", "remote_store_bytes",
                                            "num_remote_loads", "num_remote_stores")}  # fmt: skip
    assert got == {"remote_load_bytes": 6 * R * 12, "remote_store_bytes": 3 * R * 12,
                   "num_remote_loads": 6, "num_remote_stores": 3}  # fmt: skip


def _fused_adam_program(R, per_replica_lr=False):
    """One ``torch._fused_adam_`` call over a replica-invariant weight (with an invariant
    gradient) and a per-replica one (with its replica's streamed gradient)."""
    rng = np.random.default_rng(6)
    ir = popxl.Ir(replication=R)
    per_replica = ir.replica_grouping(1, 1)
    with ir.main_graph, popxl.in_sequence():
        w = popxl.variable(rng.normal(size=(5,)).astype(np.float32), name="w")
        g = popxl.variable(rng.normal(size=(5,)).astype(np.float32), name="g")
        m, v = (popxl.variable(np.zeros(5, np.float32), name=n) for n in ("m", "v"))
        per = popxl.variable(rng.normal(size=(R, 12)).astype(np.float32), name="per",
                             replica_grouping=per_replica)  # fmt: skip
        m_per, v_per = (popxl.variable(np.zeros((R, 12), np.float32), name=n,
                                       replica_grouping=per_replica) for n in ("mp", "vp"))  # fmt: skip
        xs = popxl.h2d_stream((12,), popxl.float32, "x")
        x = ops.host_load(xs)
        lr = x.sum() * 0.01 if per_replica_lr else popxl.variable(np.float32(0.1), name="lr")
        step = popxl.variable(np.float32(2.0), name="step")
        torch._fused_adam_([w, per], [g, x], [m, m_per], [v, v_per], [], [step, step], lr=lr,
                           beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8, amsgrad=False,
                           maximize=False)  # fmt: skip
        outs = _store_each((("w", w), ("m", m), ("per", per), ("m_per", m_per), ("v_per", v_per)))
    return ir, xs, outs


@pytest.mark.parametrize("R", [2, 4])
def test_fused_adam_over_per_replica_and_invariant_elements_runs_stacked(R):
    """Note [per-element list ops]: one fused call over a per-replica and a replica-invariant
    element runs on the stacked rows without vmap, the invariant weight and its state stay
    stored once, and the values (over two runs) are the reference executor's (one call per
    replica: the kernel's position-dependent rounding, hence a tolerance)."""
    xs_data = np.random.default_rng(1).normal(size=(R, 12)).astype(np.float32)
    results = {}
    for executor in ("fast", "reference"):
        ir, xs, outs = _fused_adam_program(R)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        with session:
            runs = [session.run({xs: xs_data}) for _ in range(2)]
        if executor == "fast":
            fast = session._executor
            assert all(fn.explicit for fn in fast.fns.values()), fast.source()
            assert {"w", "g", "m", "v", "lr", "step"} <= fast.uniform, fast.uniform
        results[executor] = {k: run[st] for run in runs[-1:] for k, st in outs.items()}
    for k, want in results["reference"].items():
        np.testing.assert_allclose(results["fast"][k], want, rtol=1e-5, atol=1e-6, err_msg=k)


def test_fused_adam_with_a_per_replica_learning_rate_is_refused_naming_the_op():
    ir, xs, _ = _fused_adam_program(2, per_replica_lr=True)
    with pytest.raises(NotImplementedError, match=r"_fused_adam_.*differs between replicas"):
        popxl.Session(ir, "ipu_model").run({xs: np.ones((2, 12), np.float32)})


def test_remote_slot_view_kernel_is_a_counted_view_and_checks_its_offset():
    """``remote_slot_view``: every replica's slot as a view, counted as one remote load; a
    store of that very view writes nothing but counts the store; a bad offset is a
    ValueError naming the buffer and the valid range, before anything is counted."""
    from torch_popxl.opdefs import backends

    K = torch.ops.torch_popxl
    buffer = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    with backends.traffic_scope() as counted:
        view = K.remote_slot_view(buffer, 1, 7)
        view += 100.0  # writes through to the buffer
        K.remote_store_stacked_(buffer, torch.tensor([1, 1]), view, 7)
    assert view.data_ptr() == buffer[:, 1].data_ptr()
    torch.testing.assert_close(buffer[:, 1], torch.arange(24.0).reshape(2, 3, 4)[:, 1] + 100.0)
    assert counted["num_remote_loads"] == 1 and counted["remote_load_bytes"] == 2 * 4 * 4
    assert counted["num_remote_stores"] == 1 and counted["remote_store_bytes"] == 2 * 4 * 4
    with (
        backends.traffic_scope() as counted,
        pytest.raises(ValueError, match=r"RemoteBuffer\[id=7\].*\[0, 3\)"),
    ):
        K.remote_slot_view(buffer, 3, 7)
    assert counted["num_remote_loads"] == 0


@pytest.mark.parametrize("R", [2, 4])
def test_a_gather_of_a_remote_slot_view_does_not_see_a_later_store(R):
    """Note [aliasing collectives]: the gather of a value that is a view of a remote slot is
    a copy, so storing something else into that slot afterwards leaves the gathered value as
    the reference executor has it."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(R, 3)).astype(np.float32)
    results = {}
    for executor in ("fast", "reference"):
        ir = popxl.Ir(replication=R)
        with ir.main_graph, popxl.in_sequence():
            rb = popxl.remote_buffer((3,), popxl.float32, entries=1)
            xs = popxl.h2d_stream((3,), popxl.float32, "x")
            xv = ops.host_load(xs)
            s = ops.remote_load(rb, 0)
            s += xv
            g = ops.collectives.replicated_all_gather(s)
            ops.remote_store(rb, 0, s)  # s goes back to its slot: a view
            ops.remote_store(rb, 0, xv * 3.0)
            h = g * 2.0  # reads the gathered value after the slot changed
            st = popxl.d2h_stream(h.shape, h.dtype, "h")
            ops.host_store(st, h)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        with session:
            results[executor] = [session.run({xs: x})[st] for _ in range(2)]
    for got, want in zip(results["fast"], results["reference"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def _build_mixed_ranks(R):
    """Elementwise ops whose batched operands differ in per-replica rank (Note [broadcasting on
    stacked values]); the vectors have R elements, so a stacked operand aligned the wrong way
    would broadcast silently instead of failing."""
    rng = np.random.default_rng(4)
    ir = popxl.Ir(replication=R)
    per = ir.replica_grouping(1, 1)  # one value per replica
    with ir.main_graph, popxl.in_sequence():
        step = popxl.variable(np.arange(1, R + 1, dtype=np.float32), name="step",
                              replica_grouping=per)  # fmt: skip
        bias = popxl.variable(rng.normal(size=(R, R)).astype(np.float32), name="bias",
                              replica_grouping=per)  # fmt: skip
        m = popxl.variable(rng.normal(size=(R, 3, R)).astype(np.float32), name="m",
                           replica_grouping=per)  # fmt: skip
        inv = popxl.variable(rng.normal(size=(R,)).astype(np.float32), name="inv")
        xs = popxl.h2d_stream((3, R), popxl.float32, "x")
        x = ops.host_load(xs)  # batched [3, R]
        logits = x + bias  # [3, R] + [R], both batched
        scaled = m / (1.0 - 0.9**step)  # [3, R] / [], both batched
        outer = step * inv  # batched [] times invariant [R]: the result is [R] per replica
        picked = torch.where(x > 0, step, bias)  # [3, R] condition, [] and [R] branches
        m.add_(step)  # in place: [3, R] += [] per replica
        m.div_(bias + 1.0)  # in place: [3, R] /= [R]
        outs = _store_each((("logits", logits), ("scaled", scaled), ("outer", outer),
                        ("picked", picked)))  # fmt: skip
    return ir, xs, outs, m


@pytest.mark.parametrize("R", [2, 3])
def test_mixed_rank_elementwise_ops_run_explicitly_and_match_the_reference(R):
    x = np.random.default_rng(5).normal(size=(R, 3, R)).astype(np.float32)
    _explicit_matches_reference(lambda: _build_mixed_ranks(R), x, runs=2, rtol=1e-5)


def _build_indexed(R):
    """index_select / index_copy / index_add with an index shared by the replicas (the
    pipeline's activation stashes), on batched and replica-invariant operands."""
    rng = np.random.default_rng(6)
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        stash = popxl.variable(rng.normal(size=(R, 3, 2, 4)).astype(np.float32), name="stash",
                               replica_grouping=ir.replica_grouping(1, 1))  # fmt: skip
        table = popxl.variable(rng.normal(size=(3, 4)).astype(np.float32), name="table")
        xs = popxl.h2d_stream((1, 2, 4), popxl.float32, "x")
        x = ops.host_load(xs)  # batched
        where = popxl.constant(np.array([2], np.int32)).long()
        stash.copy_(torch.index_copy(stash, 0, where, x))  # batched self and source
        picked = torch.index_select(stash, -3, where)
        rows = torch.index_select(table, 0, where)  # replica-invariant
        mixed = torch.index_copy(table, 0, where, x[0, :1])  # invariant self, batched source
        added = torch.index_add(
            table, 1, popxl.constant(np.array([3, 0], np.int32)).long(), x[0].T[:3]
        )
        outs = _store_each((("picked", picked), ("rows", rows), ("mixed", mixed), ("added", added)))
    return ir, xs, outs, stash


@pytest.mark.parametrize("R", [2, 3])
def test_indexed_ops_with_a_shared_index_run_explicitly_and_match_the_reference(R):
    x = np.random.default_rng(7).normal(size=(R, 1, 2, 4)).astype(np.float32)
    _explicit_matches_reference(lambda: _build_indexed(R), x)


def _build_pool_and_grads(R, image_shape):
    """2-d max pooling (forward and backward), select_backward and activation gradients on
    per-replica values: the ops of CNN and transformer backward passes."""
    aten = torch.ops.aten
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream(image_shape, popxl.float32, "x")
        x = ops.host_load(xs)
        pooled, indices = aten.max_pool2d_with_indices(x, [2, 2], [2, 2], [1, 1])
        grad = aten.max_pool2d_with_indices_backward(torch.sigmoid(pooled), x, [2, 2], [2, 2],
                                                     [1, 1], [1, 1], False, indices)  # fmt: skip
        picked = aten.select_backward(pooled[..., 1, :], list(pooled.shape), -2, 1)
        sig = aten.sigmoid_backward(grad, torch.sigmoid(x))
        tanh = aten.tanh_backward(grad, torch.tanh(x))
        silu = aten.silu_backward(grad, x)
        outs = _store_each((("pooled", pooled), ("indices", indices), ("grad", grad),
                        ("picked", picked), ("sig", sig), ("tanh", tanh), ("silu", silu)))  # fmt: skip
    return ir, xs, outs


@pytest.mark.parametrize("R,image_shape", [(2, (3, 2, 5, 6)), (3, (2, 4, 5))])
def test_pooling_and_gradient_ops_run_explicitly_and_match_the_reference(R, image_shape):
    x = np.random.default_rng(8).normal(size=(R, *image_shape)).astype(np.float32)
    _explicit_matches_reference(lambda: _build_pool_and_grads(R, image_shape), x)


def _build_masks_and_reductions(R):
    """Comparisons and masks, ``*_like`` values, a full mean and ``stack`` on per-replica and
    replica-invariant values."""
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        inv = popxl.variable(np.linspace(-1, 1, 12).reshape(3, 4).astype(np.float32), name="inv")
        xs = popxl.h2d_stream((3, 4), popxl.float32, "x")
        x = ops.host_load(xs)
        mask = torch.logical_and(x >= inv, ~(x > 0.5)) | (x != inv)
        bits = torch.bitwise_and(mask, torch.logical_or(x < 0, inv > 0))
        rem = torch.remainder(x, 0.7) + torch.remainder(x, inv + 2.0)
        like = torch.zeros_like(x) + torch.ones_like(inv) * 2.0
        mean = torch.mean(x * inv)
        stacked = torch.stack([x, inv, like], dim=-2)
        stacked0 = torch.stack([inv, x])
        outs = _store_each((("mask", mask), ("bits", bits), ("rem", rem), ("like", like),
                        ("mean", mean), ("stacked", stacked), ("stacked0", stacked0)))  # fmt: skip
    return ir, xs, outs


@pytest.mark.parametrize("R", [2, 3])
def test_masks_likes_means_and_stacks_run_explicitly_and_match_the_reference(R):
    x = np.random.default_rng(9).normal(size=(R, 3, 4)).astype(np.float32)
    _explicit_matches_reference(lambda: _build_masks_and_reductions(R), x)


def _cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.BatchNorm2d(4),
        torch.nn.Conv2d(4, 3, 3, bias=False), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(3 * 3 * 3, 5),
    )  # fmt: skip


def _cnn_fast_matches_reference(make_model, R: int, GA: int, seed: int) -> dict:
    """Two SGD-momentum steps of ``make_model()`` on each executor: losses, parameters and
    running statistics of the fast executor equal the reference executor's; returns the fast
    executor's generated fragments."""
    rng = np.random.default_rng(seed)
    batches = [(rng.normal(size=(R * GA * 4, 2, 8, 8)).astype(np.float32),
                rng.integers(0, 5, R * GA * 4)) for _ in range(2)]  # fmt: skip
    return fast_matches_reference(make_model, R, GA, batches)[1]


@pytest.mark.parametrize("R,GA", [(2, 2), (3, 1)])
def test_cnn_training_runs_explicitly_and_matches_the_reference_executor(R, GA):
    """Note [convolutions and batch norm on stacked rows]: convolutions (with and without bias),
    batch norm with per-replica statistics and running statistics, max pooling: the fast
    executor runs the whole step on stacked values and trains as the reference executor."""
    for name, fn in _cnn_fast_matches_reference(_cnn, R, GA, seed=10).items():
        assert fn.explicit, (name, fn.vmap_reason)


@pytest.mark.parametrize("batch_norm", [False, True])
def test_convolution_weight_gradients_are_one_call_over_all_replicas(batch_norm):
    """Note [convolution weight gradients summed over replicas]: a weight or bias gradient read
    only by its replica-sum accumulator comes from one ``convolution_backward`` over every
    replica's images, and the accumulation loop still folds into one pass (with batch norm's
    running statistics updated once per micro-batch, Note [fold the accumulation loop]);
    training equals the reference executor."""

    def model():
        if batch_norm:
            return _cnn()
        return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.Conv2d(4, 3, 3, stride=2), torch.nn.Flatten(),
                                   torch.nn.Linear(3 * 3 * 3, 5))  # fmt: skip

    fns = _cnn_fast_matches_reference(model, R=2, GA=2, seed=11)
    sources = "".join(fn.source for fn in fns.values())
    assert sources.count("summed=True") == 2  # both convolutions
    assert "iterations folded" in sources


@pytest.mark.parametrize("R", [1, 2])
def test_a_loop_using_a_stream_twice_per_iteration_takes_its_entries_in_order(R):
    """A folded loop takes each stream's next entries in one pass, so a loop that loads (or
    stores) one stream twice per iteration is not folded: iteration i reads entries 2i and
    2i + 1 and stores in that order, as the reference executor does."""
    ir = popxl.Ir(replication=R)
    ir.num_host_transfers = 8
    with ir.main_graph:
        b_s = popxl.h2d_stream((3,), popxl.float32, "B")
        w = popxl.variable(np.ones(3, np.float32), name="w")
        first, both = (
            popxl.d2h_stream((3,), popxl.float32, "first"),
            popxl.d2h_stream((3,), popxl.float32, "both"),
        )

        def body(w):
            x, y = ops.host_load(b_s), ops.host_load(b_s)
            ops.host_store(first, x * w)
            ops.host_store(both, x + y)
            ops.host_store(both, x - y)

        ops.repeat(ir.create_graph(body, w), 4, w)
    shape = (8, 3) if R == 1 else (8, R, 3)
    b = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    results = {}
    for executor in ("fast", "reference"):
        with popxl.Session(ir, executor=executor) as session:
            results[executor] = session.run({b_s: b})
    for stream, stored in ((first, 4), (both, 8)):  # entries beyond those stored are unset
        np.testing.assert_array_equal(results["fast"][stream][:stored],
                                      results["reference"][stream][:stored])  # fmt: skip
    np.testing.assert_array_equal(results["fast"][first][:4], b[0::2][:4])  # by hand
    np.testing.assert_array_equal(results["fast"][both][0], b[0] + b[1])
    np.testing.assert_array_equal(results["fast"][both][1], b[0] - b[1])


@pytest.mark.parametrize("R", [2])
def test_an_op_with_only_a_decomposition_runs_it_through_vmap_in_an_explicit_fragment(R):
    # Note [one op through torch's batching rule]: binary_cross_entropy_with_logits has no
    # batching rule, torch decomposes it; the step stays explicitly batched and trains as eager
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(4 * R, 4)).astype(np.float32),
                rng.random(size=(4 * R, 2)).astype(np.float32)) for _ in range(3)]  # fmt: skip
    trainer = train_both(model, torch.nn.functional.binary_cross_entropy_with_logits, batches,
                         R, 1)  # fmt: skip
    fn = trainer.session._executor.fns["normal"]
    assert fn.explicit, fn.vmap_reason
    assert "aten.binary_cross_entropy_with_logits.default" in fn.vmapped_ops


def _full_views(R):
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((4, 3), popxl.float32, "x")
        x = ops.host_load(xs)
        y = torch.ops.aten.slice.Tensor(x, 0, 0, 4)  # the whole of x
        z = y.view(4, 3).reshape(4, 3)  # a new tensor (Note [views of new tensors])
        w = torch.ops.aten.slice.Tensor(x, 0, 0, 4)
        w.mul_(2.0)  # torch code on a handle keeps torch's aliases: x doubles, z does not
        part = torch.ops.aten.slice.Tensor(x, 0, 1, 3)  # a real slice
        outs = _store_each((("x", x), ("sum", z * 2.0 + x), ("w", w), ("part", part * 1.0)))
    return ir, xs, outs


@pytest.mark.parametrize("R", [1, 2])
def test_a_full_slice_and_a_view_to_the_same_shape_run_as_their_input(R):
    """A slice or view whose result has its input's shape is its input (the flattener shares
    the name, as for detach): no line runs for it, an in-place write through it writes its
    input as before, a view made a new tensor is still copied, and the values are the
    reference executor's and, by hand, 2x, 4x, 2x and rows 1:3 of 2x; a real slice still
    runs."""
    x = np.random.default_rng(0).normal(size=(R, 4, 3)).astype(np.float32)
    feed = x if R > 1 else x[0]
    got = {}
    for executor in ("fast", "reference"):
        ir, xs, outs = _full_views(R)
        session = popxl.Session(ir, "ipu_model", executor=executor)
        if executor == "fast":
            program = session._executor.program
            code = session._executor.fns["normal"].source
            (name,) = [n for n, o in program.overloads.items() if o is torch.ops.aten.slice.Tensor]
            assert code.count(f"{name}(") == 1, code  # only ``part``
            assert code.count(".clone()") == 1, code  # the new tensor ``z``
            assert code.count("VIEW(") <= 1, code  # ``z``'s own view at most
        with session:
            run = session.run({xs: feed})
        got[executor] = {k: run[st] for k, st in outs.items()}
    want = {"x": 2 * feed, "sum": 4 * feed, "w": 2 * feed, "part": 2 * feed[..., 1:3, :]}
    for executor, values in got.items():
        for k, v in want.items():
            np.testing.assert_allclose(values[k], v, rtol=1e-6, err_msg=f"{executor} {k}")
