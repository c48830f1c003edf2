"""PopXL's non-in-place view-like ops make new tensors; their in-place variants alias (Note
[views of new tensors] in ir/views.py).

Every case runs upstream's two repros on both executors, at R = 1 and R = 2, on a replicated
variable and on an RTS shard, against numpy: the expected values come from numpy *copies*
for the non-in-place ops and numpy *views* for the in-place ones.

* write the result: ``y = f(x); accumulate_(y, d)``: ``x`` keeps its value (in-place ops:
  ``x`` sees the write);
* write the source: ``y = f(x); accumulate_(x, d)``: ``y`` keeps the values ``x`` had when
  it was made (in-place ops: ``y`` sees the write).
"""

from __future__ import annotations

import numpy as np
import pytest

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.ir.views import copied_views

EXECUTORS = ("fast", "reference")
SHAPE = (3, 1, 4)  # the tensor every case starts from (an RTS shard is reshaped to it)

# name -> (the op on a popxl tensor, the same on a numpy array). Each PopXL non-in-place op
# whose torch kernel returns a view of its input, through ``popxl.ops`` and through PopXL's
# Tensor methods; the numpy form returns a view where numpy's does.
NEW_TENSORS = {
    "Tensor.T": (lambda x: x.T, lambda a: a.T),
    "ops.transpose": (lambda x: ops.transpose(x, (1, 0, 2)), lambda a: a.transpose(1, 0, 2)),
    "Tensor.transpose(0, 2)": (lambda x: x.transpose(0, 2), lambda a: a.swapaxes(0, 2)),
    "ops.reshape": (lambda x: ops.reshape(x, (4, 3)), lambda a: a.reshape(4, 3)),
    "Tensor.reshape": (lambda x: x.reshape(12), lambda a: a.reshape(12)),
    "ops.flatten": (lambda x: ops.flatten(x), lambda a: a.reshape(-1)),
    "Tensor.flatten(1)": (lambda x: x.flatten(1), lambda a: a.reshape(3, 4)),
    "ops.squeeze": (lambda x: ops.squeeze(x, [1]), lambda a: a[:, 0]),
    "ops.unsqueeze": (lambda x: ops.unsqueeze(x, [0]), lambda a: a[None]),
    "ops.slice": (lambda x: ops.slice(x, [1], [3], axis=[0]), lambda a: a[1:3]),
    "Tensor[...]": (lambda x: x[0, :, 1:3], lambda a: a[0, :, 1:3]),
    "ops.subsample": (lambda x: ops.subsample(x, [2, 1, 2]), lambda a: a[::2, :, ::2]),
    "ops.split": (lambda x: ops.split(x, 3, axis=0)[1], lambda a: a[1:2]),
    "ops.detach": (lambda x: ops.detach(x), lambda a: a[...]),
    "Tensor.detach": (lambda x: x.detach(), lambda a: a[...]),
    "ops.cast to its dtype": (lambda x: ops.cast(x, x.dtype), lambda a: a[...]),
    "Tensor.diag": (lambda x: ops.squeeze(x, [1]).diag(), lambda a: a[:, 0].diagonal()),
    "ops.print_tensor": (lambda x: ops.print_tensor(x, "x"), lambda a: a[...]),
    "x.T[1] (two in a row)": (lambda x: x.T[1], lambda a: a.T[1]),
}

# The in-place variants: views of their input, upstream and here.
ALIASES = {
    "ops.transpose_": (lambda x: ops.transpose_(x, (1, 0, 2)), lambda a: a.transpose(1, 0, 2)),
    "Tensor.T_": (lambda x: x.T_, lambda a: a.T),
    "ops.reshape_": (lambda x: ops.reshape_(x, (4, 3)), lambda a: a.reshape(4, 3)),
    "ops.flatten_": (lambda x: ops.flatten_(x), lambda a: a.reshape(-1)),
    "ops.slice_": (lambda x: ops.slice_(x, [1], [3], axis=[0]), lambda a: a[1:3]),
    "ops.detach_": (lambda x: ops.detach_(x), lambda a: a[...]),
}

# (replicas, how the variable is held)
SETTINGS = [(1, "replicated"), (2, "replicated"), (2, "sharded")]


def _store(t):
    stream = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(stream, t)
    return stream


def _initial(R: int, how: str, k: int) -> np.ndarray:
    """Each replica's starting value of case ``k`` (a shard differs between replicas)."""
    n = int(np.prod(SHAPE))
    full = np.arange(n * (R if how == "sharded" else 1), dtype=np.float32) + 100 * k
    return full.reshape(-1, *SHAPE) if how == "sharded" else np.stack([full.reshape(SHAPE)] * R)


def _source(how: str, value: np.ndarray):
    """(the variable, the SHAPE tensor the case works on): the variable itself, or an alias
    of its RTS shard (the in-place ``reshape_`` of the shard)."""
    if how == "replicated":
        v = popxl.variable(value[0])
        return v, v
    var, shard = popxl.replica_sharded_variable(value.reshape(-1))
    return var, ops.reshape_(shard, SHAPE)


def _expected(np_fn, x0: np.ndarray, write: str, aliasing: bool):
    """numpy's answer for one replica: (y, x) after the write of ``d`` (10 * position)."""
    x = x0.copy()
    y = np_fn(x)
    if not aliasing:
        y = y.copy()
    target = y if write == "result" else x
    target += 10.0 * np.arange(target.size, dtype=np.float32).reshape(target.shape)
    return y, x


def _run(cases: dict, R: int, how: str, write: str, executor: str):
    ir = popxl.Ir(replication=R)
    streams, variables, initial = {}, {}, {}
    with ir.main_graph, popxl.in_sequence():
        for k, (name, (fn, _)) in enumerate(cases.items()):
            initial[name] = _initial(R, how, k)
            var, x = _source(how, initial[name])
            y = fn(x)
            target = y if write == "result" else x
            d = 10.0 * np.arange(target.nelms, dtype=np.float32).reshape(target.shape)
            ops.var_updates.accumulate_(target, popxl.constant(d))
            streams[name] = (_store(y), _store(x))
            variables[name] = var
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run()
        held = {name: session.get_tensor_data(v) for name, v in variables.items()}
    return out, streams, held, initial


def _check(cases: dict, aliasing: bool, R: int, how: str, write: str, executor: str) -> None:
    out, streams, held, initial = _run(cases, R, how, write, executor)
    for name, (_, np_fn) in cases.items():
        ys, xs = [], []
        for r in range(R):
            y, x = _expected(np_fn, initial[name][r], write, aliasing)
            ys.append(y)
            xs.append(x)
        y_stream, x_stream = streams[name]
        got_y, got_x = out[y_stream], out[x_stream]
        want_y, want_x = (np.stack(ys), np.stack(xs)) if R > 1 else (ys[0], xs[0])
        np.testing.assert_array_equal(got_y, want_y, err_msg=f"{name}: y")
        np.testing.assert_array_equal(got_x, want_x, err_msg=f"{name}: x")
        want_var = np.concatenate([x.reshape(-1) for x in xs]) if how == "sharded" else xs[0]
        np.testing.assert_array_equal(held[name].reshape(want_var.shape), want_var,
                                      err_msg=f"{name}: the variable")  # fmt: skip


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("write", ["result", "source"])
@pytest.mark.parametrize(("R", "how"), SETTINGS)
def test_non_inplace_views_are_new_tensors(R, how, write, executor):
    _check(NEW_TENSORS, False, R, how, write, executor)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("write", ["result", "source"])
@pytest.mark.parametrize(("R", "how"), SETTINGS)
def test_inplace_views_alias_their_input(R, how, write, executor):
    _check(ALIASES, True, R, how, write, executor)


def test_every_case_is_a_view_in_torch():
    """Each non-in-place case records a view (torch's kernel shares storage), so the cases
    test the copy rule rather than ops that copy anyway; each in-place case an alias."""
    from torch_popxl.ir.walk import effects

    for cases, field in ((NEW_TENSORS, "views"), (ALIASES, "aliases")):
        for name, (fn, _) in cases.items():
            ir = popxl.Ir()
            with ir.main_graph:
                x = popxl.variable(np.zeros(SHAPE, np.float32))
                fn(x)
            assert any(getattr(effects(op), field) for op in ir.main_graph._ops), name


def _stores(*ts):
    return [_store(t) for t in ts]


def _x0():
    return np.arange(6, dtype=np.float32).reshape(2, 3)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_view_nothing_can_tell_from_a_copy_stays_a_view(executor):
    """Only where a write of one side could be seen by the other is a view copied: ``x.T``
    read before ``x`` is updated (a forward, then the optimizer) costs nothing; read after,
    it is the one op copied."""
    for read_after in (False, True):
        ir = popxl.Ir()
        with ir.main_graph, popxl.in_sequence():
            x = popxl.variable(_x0())
            w = popxl.variable(np.ones((2, 2), np.float32))
            y = x.T
            z = y @ w
            ops.var_updates.accumulate_(x, popxl.constant(np.ones((2, 3), np.float32)))
            streams = _stores(z, y) if read_after else _stores(z)
        transpose = next(op for op in ir.main_graph._ops if op.outputs and op.outputs[0] is y)
        assert copied_views(ir) == ({transpose} if read_after else set())
        with popxl.Session(ir, "ipu_model", executor=executor) as session:
            out = session.run()
            if executor == "fast":
                assert (".clone()" in session._executor.source()) == read_after
        np.testing.assert_array_equal(out[streams[0]], _x0().T @ np.ones((2, 2)))
        if read_after:
            np.testing.assert_array_equal(out[streams[1]], _x0().T)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_callee_writes_a_new_tensor_view_of_its_by_ref_input(executor):
    """Through a call: ``a.T`` inside the callee is a new tensor (the caller's tensor keeps
    its value), ``transpose_(a)`` an alias (the caller sees the write, the earlier ``a.T``
    does not)."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(_x0())

        def body(a: popxl.TensorByRef):
            y = a.T
            ops.var_updates.accumulate_(y, popxl.constant(np.ones((3, 2), np.float32)))
            z = ops.transpose_(a)
            ops.var_updates.accumulate_(z, popxl.constant(np.full((3, 2), 10.0, np.float32)))
            return y

        (y,) = ops.call(ir.create_graph(body, x), x)
        y_s, x_s = _stores(y, x)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run()
        held = session.get_tensor_data(x)
    np.testing.assert_array_equal(out[y_s], _x0().T + 1.0)
    np.testing.assert_array_equal(out[x_s], _x0() + 10.0)
    np.testing.assert_array_equal(held, _x0() + 10.0)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_view_made_in_a_repeat_keeps_the_value_of_its_iteration(executor):
    """``v = w.T`` then ``w += 1`` in each of 3 iterations: the sum of the ``v`` is
    ``3 w0.T + (0 + 1 + 2)``."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        w = popxl.variable(_x0())

        def body(acc, w: popxl.TensorByRef):
            v = w.T
            ops.var_updates.accumulate_(w, popxl.constant(np.ones((2, 3), np.float32)))
            return acc + v

        g = ir.create_graph(body, popxl.TensorSpec((3, 2), popxl.float32), w)
        (acc,) = ops.repeat(g, 3, popxl.constant(np.zeros((3, 2), np.float32)), w)
        (acc_s,) = _stores(acc)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run()
        held = session.get_tensor_data(w)
    np.testing.assert_array_equal(out[acc_s], 3 * _x0().T + 3.0)
    np.testing.assert_array_equal(held, _x0() + 3.0)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_inplace_update_of_one_view_is_not_ambiguous_with_another(executor):
    """GPT-3 175B's LM head passes ``w.T`` to a graph that accumulates into it, after an
    earlier ``w.T`` made its input spec: two new tensors, so nothing is ambiguous (here the
    check saw ``w`` itself updated while the first ``w.T`` read it). Updating ``w`` itself,
    unordered with a read, still is."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(_x0())
        a = x.T
        b = x.T
        ops.var_updates.accumulate_(b, popxl.constant(np.ones((3, 2), np.float32)))
        a_s, b_s = _stores(a, b)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run()
        held = session.get_tensor_data(x)
    np.testing.assert_array_equal(out[a_s], _x0().T)
    np.testing.assert_array_equal(out[b_s], _x0().T + 1.0)
    np.testing.assert_array_equal(held, _x0())

    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(_x0())
        _stores(x.T)
        ops.var_updates.accumulate_(x, popxl.constant(np.ones((2, 3), np.float32)))
    with pytest.raises(popxl.errors.PopXLError, match="Inplacing ambiguity detected"):
        popxl.Session(ir, "ipu_model", executor=executor)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_gradient_reads_the_transposed_weight_of_its_forward(executor):
    """``y = x @ w.T`` differentiated by ``transforms.autodiff``; ``w`` is updated between
    the forward and backward calls: the backward's activation ``w.T`` is the forward's value
    (a new tensor upstream), so the gradients are those of the old ``w``."""
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=(4, 3)).astype(np.float32)
    w0 = rng.normal(size=(2, 3)).astype(np.float32)
    dy = rng.normal(size=(4, 2)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x, w = popxl.variable(x0), popxl.variable(w0)
        fwd = ir.create_graph(lambda a, b: a @ b.T, x, w)
        bwd = popxl.transforms.autodiff(fwd)
        info = ops.call_with_info(fwd, x, w)
        ops.var_updates.accumulate_(w, popxl.constant(np.full((2, 3), 5.0, np.float32)))
        dx, dw = ops.call(bwd.graph, popxl.constant(dy), inputs_dict=bwd.inputs_dict(info))
        y_s, dx_s, dw_s = _stores(info.outputs[0], dx, dw)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run()
    np.testing.assert_allclose(out[y_s], x0 @ w0.T, rtol=1e-6)
    np.testing.assert_allclose(out[dx_s], dy @ w0, rtol=1e-5)
    np.testing.assert_allclose(out[dw_s], dy.T @ x0, rtol=1e-5)


def test_popxl_compile_records_no_new_tensor_views():
    """popxl.compile captures torch's own code, whose views are torch's aliases: its programs
    have no view to copy, so their generated code is what it was."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                            torch.optim.Adam(model.parameters(), lr=1e-3), replication_factor=2,
                            gradient_accumulation=2, rts_threshold=4)  # fmt: skip
    trainer.plan(torch.randn(8, 6), torch.randint(0, 3, (8,)))
    ops_ = [op for g in trainer.ir.graphs for op in g._ops]
    assert ops_ and not any(getattr(op.attrs, "new_tensors", False) for op in ops_)
    assert copied_views(trainer.ir) == frozenset()


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_call_output_viewing_a_call_input_is_a_new_tensor(executor):
    """A call's outputs are new tensors upstream. The gradient graph of a reshape returns
    torch's view of its input gradient; an update of the caller's ``dy`` after the call must
    not reach ``dx`` (Note [call outputs are new tensors])."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(np.zeros((2, 3), np.float32))
        dy = popxl.variable(np.ones(6, np.float32))
        fwd = ir.create_graph(lambda a: a.reshape((6,)), x)
        bwd = popxl.transforms.autodiff(fwd)
        info = ops.call_with_info(fwd, x)
        (dx,) = ops.call(bwd.graph, dy, inputs_dict=bwd.inputs_dict(info))
        ops.var_updates.accumulate_(dy, popxl.constant(np.ones(6, np.float32)))
        (dx_s,) = _stores(dx)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run()
    np.testing.assert_array_equal(out[dx_s], np.ones((2, 3), np.float32))
