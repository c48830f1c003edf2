"""What runs on the slow path is reported by an API, never printed: ``Session.explain()``,
``Trainer.explain()``, ``InferenceProgram.explain()``; fragments with ops the project has no
stacked rule for are traced once under vmap (Note [vmap traced once] in runtime/executor.py);
and ordinary CNN training (dropout, label smoothing, adaptive average pooling) runs on the
fast path with nothing written to stderr."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops


def _program(build, replicas=2):
    ir = popxl.Ir(replication=replicas)
    with ir.main_graph:
        xs = popxl.h2d_stream((4, 3), popxl.float32, "x")
        y = build(ops.host_load(xs))
        out = popxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(out, y)
    return ir, xs, out


def _run(build, x, executor="fast", **session_kw):
    ir, xs, out = _program(build)
    with popxl.Session(ir, executor=executor, **session_kw) as session:
        got = [session.run({xs: x})[out] for _ in range(2)]  # the first run traces
        return got, session.explain(), session


X = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)


@pytest.fixture
def no_single_op_vmap(monkeypatch):
    """roll's fragment off the explicit path: without Note [one op through torch's batching
    rule] (runtime/explicit.py) an op with no stacked rule sends its fragment to vmap."""
    from torch_popxl.runtime import explicit

    monkeypatch.setattr(explicit, "_one_op_vmap_ok", lambda f, a: False)


def test_an_op_without_a_stacked_rule_runs_alone_through_torchs_batching_rule():
    # roll has no stacked rule of this project: it runs under vmap by itself, and its
    # fragment stays explicitly batched (Note [one op through torch's batching rule])
    got, lines, session = _run(lambda t: torch.roll(t, 1, 0) * 2.0, X)
    for g in got:
        np.testing.assert_array_equal(g, np.roll(X, 1, axis=1) * 2.0)  # per replica, its dim 0
    assert lines == []
    fn = session._executor.fns["normal"]
    assert fn.explicit and fn.vmapped_ops == ("aten.roll.default",)


def test_an_op_without_a_stacked_rule_runs_traced_on_the_fast_path(no_single_op_vmap):
    # roll has no stacked rule of this project: its fragment is traced once under vmap
    # (Note [vmap traced once]) and runs as the stacked ops torch's batching rule gives
    got, lines, session = _run(lambda t: torch.roll(t, 1, 0), X)
    for g in got:
        np.testing.assert_array_equal(g, np.roll(X, 1, axis=1))  # per replica, its dim 0
    assert lines == []
    from torch_popxl.runtime.executor import _Traced

    assert isinstance(session._executor._traced["normal"], _Traced)  # traced, not failed


def test_an_op_torch_cannot_batch_is_reported_as_a_per_replica_loop(no_single_op_vmap):
    # nonzero_static has no batching rule, torch's or the project's (opdefs/aten_batching.py)
    got, lines, _ = _run(lambda t: torch.nonzero_static(t.remainder(5) > 2, size=4), X)
    want = np.stack([np.argwhere(X[r] % 5 > 2)[:4] for r in range(2)])
    for g in got:
        np.testing.assert_array_equal(g, want)
    assert lines == ["normal: torch has no batching rule for aten.nonzero_static.default: run "
                     "once per replica"]  # fmt: skip


def test_an_op_torch_cannot_batch_runs_alone_once_per_replica_in_a_stacked_fragment():
    """Note [one op through torch's batching rule]: the op on each replica's rows, the rest of
    the fragment stacked; nothing to report."""
    got, lines, session = _run(lambda t: torch.nonzero_static(t.remainder(5) > 2, size=4), X)
    want = np.stack([np.argwhere(X[r] % 5 > 2)[:4] for r in range(2)])
    for g in got:
        np.testing.assert_array_equal(g, want)
    assert lines == []
    fn = session._executor.fns["normal"]
    assert fn.explicit and fn.vmapped_ops == ("aten.nonzero_static.default",)


def test_an_op_batched_by_the_projects_table_runs_on_the_fast_path():
    # isin has no torch batching rule; Note [aten batching rules] gives it one
    got, lines, _ = _run(lambda t: torch.isin(t, t[0]), X)
    want = np.stack([np.isin(X[r], X[r, 0]) for r in range(2)])
    for g in got:
        np.testing.assert_array_equal(g, want)
    assert lines == []


def _refuse_tracing(*args, **kwargs):
    raise RuntimeError("tracing refused for this test")


def test_a_fragment_that_cannot_be_traced_runs_under_vmap_and_says_why(
    monkeypatch, no_single_op_vmap
):
    from torch_popxl.runtime import executor

    monkeypatch.setattr(executor, "trace_fake", _refuse_tracing)
    got, lines, _ = _run(lambda t: torch.roll(t, 1, 0), X)
    for g in got:
        np.testing.assert_array_equal(g, np.roll(X, 1, axis=1))
    assert lines == ["normal: runs under torch.func.vmap at every step (slower): no explicit "
                     "rule for aten.roll.default, and tracing it failed: RuntimeError: "
                     "tracing refused for this test"]  # fmt: skip


def test_an_op_alone_that_cannot_be_traced_runs_under_vmap_and_says_why(monkeypatch):
    from torch_popxl.runtime import explicit

    monkeypatch.setattr(explicit, "_trace_fake", _refuse_tracing)
    got, lines, session = _run(lambda t: torch.roll(t, 1, 0), X)
    for g in got:
        np.testing.assert_array_equal(g, np.roll(X, 1, axis=1))
    assert session._executor.fns["normal"].explicit
    assert lines == ["normal: aten.roll.default runs alone under torch.func.vmap at every step "
                     "(slower): tracing it failed: RuntimeError: tracing refused for this test"]  # fmt: skip


def test_the_reference_executor_says_it_is_the_reference():
    got, lines, _ = _run(lambda t: torch.cumsum(t, 0), X, executor="reference")
    np.testing.assert_array_equal(got[0], np.cumsum(X, axis=1))
    assert len(lines) == 1 and "reference executor" in lines[0]


def test_session_explain_is_empty_on_the_fast_path():
    ir, xs, _ = _program(lambda t: torch.relu(t) * 2.0)
    with popxl.Session(ir) as session:
        session.run({xs: np.ones((2, 4, 3), np.float32)})
        assert session.explain() == []


class _CNN(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2),
            torch.nn.Flatten(), torch.nn.Dropout(p), torch.nn.Linear(16, 10),
        )  # fmt: skip

    def forward(self, x):
        return self.body(x)


def _batches(n=3, rows=8):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(rows, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, rows))
            for _ in range(n)]  # fmt: skip


def test_cnn_with_label_smoothing_and_adaptive_pooling_trains_as_eager_on_the_fast_path(capfd):
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    eager = _CNN(0.0)
    model = copy.deepcopy(eager)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    trainer = popxl.compile(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    for x, y in _batches():
        loss = trainer.step(x, y)
        opt.zero_grad()
        ref = loss_fn(eager(torch.from_numpy(x)), torch.from_numpy(y))
        ref.backward()
        opt.step()
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
    trainer.sync_weights()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert trainer.explain() == []
    assert capfd.readouterr().err == ""


def test_dropout_training_runs_on_the_fast_path_with_nothing_on_stderr(capfd):
    model = _CNN(0.5)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                            torch.optim.SGD(model.parameters(), lr=0.1), replication_factor=2)  # fmt: skip
    losses = [trainer.step(x, y) for x, y in _batches()]
    assert all(np.isfinite(losses))
    assert trainer.explain() == []
    assert capfd.readouterr().err == ""
    trainer.sync_weights()
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_explain_before_the_first_step_says_how_to_get_a_program():
    model = _CNN(0.0)
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                            torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip
    with pytest.raises(ValueError, match="built by the first step"):
        trainer.explain()
    with pytest.raises(ValueError, match="built by the first call"):
        popxl.compile(model).explain()
