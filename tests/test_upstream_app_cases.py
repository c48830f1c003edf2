"""Capture and autodiff cases Graphcore's PopXL applications rely on (nlp/gpt3_2.7B TP, BERT,
GPT-3 175B), each as upstream PopXL defines it, checked against eager torch."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl import ops
from torch_popxl.popart import PyWeightsIO
from torch_popxl.transforms import autodiff

RNG = np.random.default_rng(0)


def _run(ir, executor):
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        return session.run()


def _store(t):
    s = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(s, t)
    return s


# ---- (a) autodiff of a graph whose calls compute values the gradient needs -----------------
# Upstream (popart python/popxl/popxl/transforms/autodiff.py, PopART's Autodiff) differentiates
# a called graph along with its caller: values computed inside the callee that the gradient
# needs become callee outputs (and so call outputs) that the gradient graph takes as Fwd inputs.
# GPT-3 2.7B TP's model graph calls its layer graphs this way.


def _inner(x: popxl.Tensor, w: popxl.Tensor) -> popxl.Tensor:
    return ops.gelu(x @ w)


def _nested(x: popxl.Tensor, w: popxl.Tensor) -> popxl.Tensor:
    g = popxl.gcg().ir.create_graph(_inner, x, w)
    (y,) = ops.call(g, x, w)
    return ops.tanh(y) * y


def _outer(x: popxl.Tensor, w: popxl.Tensor, v: popxl.Tensor) -> popxl.Tensor:
    ir = popxl.gcg().ir
    inner = ir.create_graph(_inner, x, w)
    (h,) = ops.call(inner, x, w)  # one call site ...
    (h2,) = ops.call(inner, h, v)  # ... and a second of the same graph
    nested = ir.create_graph(_nested, h2, v)  # and a callee two levels deep
    (y,) = ops.call(nested, h2, v)
    return ops.reduce_sum(ops.gelu(y) * h)


def _torch_outer(x, w, v):
    gelu = lambda t: torch.nn.functional.gelu(t, approximate="tanh")  # noqa: E731  (popxl gelu)
    h = gelu(x @ w)
    h2 = gelu(h @ v)
    z = gelu(h2 @ v)
    y = torch.tanh(z) * z
    return (gelu(y) * h).sum()


@pytest.mark.parametrize(
    "autodiff_first", [True, False], ids=["autodiff-then-call", "call-then-autodiff"]
)
@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_autodiff_reads_values_computed_inside_called_graphs(executor, autodiff_first):
    x = RNG.normal(size=(4, 8)).astype(np.float32)
    w = RNG.normal(size=(8, 8)).astype(np.float32) * 0.3
    v = RNG.normal(size=(8, 8)).astype(np.float32) * 0.3
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        ts = [popxl.variable(a, name=n) for a, n in ((x, "x"), (w, "w"), (v, "v"))]
        fwd = ir.create_graph(_outer, *[t.spec for t in ts])
        if autodiff_first:  # as the apps: create_graph, autodiff, then the calls
            bwd = autodiff(fwd)
            info = ops.call_with_info(fwd, *ts)
        else:  # the call site gets the new outputs when autodiff adds them
            info = ops.call_with_info(fwd, *ts)
            bwd = autodiff(fwd)
        grads = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
        streams = [_store(t) for t in (info.outputs[0], *grads)]
    out = _run(ir, executor)

    xs = [torch.tensor(a, requires_grad=True) for a in (x, w, v)]
    y = _torch_outer(*xs)
    y.backward()
    np.testing.assert_allclose(out[streams[0]], y.detach().numpy(), rtol=1e-5)
    for s, ref in zip(streams[1:], xs, strict=True):
        np.testing.assert_allclose(out[s], ref.grad.numpy(), rtol=1e-4, atol=1e-5)


# ---- (b) reshape / reshape_ of a transposed tensor --------------------------------------------
# Upstream's reshape and reshape_ (popart python/popxl/popxl/ops/reshape.py) accept any input
# layout: Poplar views are tensor expressions, so a transposed tensor reshapes like any other.
# BERT / GPT attention folds transposed heads this way.


@pytest.mark.parametrize(
    "method", ["ops.reshape", "ops.reshape_", "Tensor.reshape", "Tensor.reshape_"]
)
@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_reshape_of_a_transposed_tensor_matches_numpy(executor, method):
    data = np.arange(2 * 4 * 2 * 16, dtype=np.float32).reshape(2, 4, 2, 16)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(data)
        t = ops.transpose_(x, (0, 2, 1, 3))  # (2, 2, 4, 16), not contiguous
        shape = (4, 4, 16)
        r = {
            "ops.reshape": lambda: ops.reshape(t, shape),
            "ops.reshape_": lambda: ops.reshape_(t, shape),
            "Tensor.reshape": lambda: t.reshape(shape),
            "Tensor.reshape_": lambda: t.reshape_(shape),
        }[method]()
        s = _store(r)
    np.testing.assert_array_equal(_run(ir, executor)[s], data.transpose(0, 2, 1, 3).reshape(shape))


def test_reshape_of_a_contiguous_tensor_still_aliases():
    # reshape_ of a contiguous tensor stays a view: an in-place update through it reaches x.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(np.zeros((2, 3), np.float32))
        v = ops.reshape_(x, (6,))
        ops.add_(v, popxl.constant(np.arange(6, dtype=np.float32)))
        s = _store(x)
    np.testing.assert_array_equal(_run(ir, "fast")[s], np.arange(6, dtype=np.float32).reshape(2, 3))


def test_reshape_names_the_shapes_it_cannot_reconcile():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros((2, 3), np.float32))
        for fn in (ops.reshape, ops.reshape_):
            with pytest.raises(ValueError, match=r"\(2, 3\) \(6 elements\) to \(4, 2\)"):
                fn(x, (4, 2))


# ---- (c) in-place Tensor methods upstream's popxl.Tensor has ---------------------------------
# popart python/popxl/popxl/tensor.py: transpose_, T_, reshape_, flatten_, detach_.


@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_inplace_tensor_methods_match_numpy(executor):
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    ir = popxl.Ir()
    with ir.main_graph:
        streams = {
            "flatten_": _store(popxl.variable(data).flatten_()),
            "flatten_ of a transpose": _store(popxl.variable(data).T.flatten_()),
            "transpose_": _store(popxl.variable(data).transpose_((1, 0))),
            "T_": _store(popxl.variable(data).T_),
            "reshape_": _store(popxl.variable(data).reshape_((2, 6))),
            "detach_": _store(popxl.variable(data).detach_()),
        }
    out = _run(ir, executor)
    want = {
        "flatten_": data.reshape(-1),
        "flatten_ of a transpose": data.T.reshape(-1),
        "transpose_": data.T,
        "T_": data.T,
        "reshape_": data.reshape(2, 6),
        "detach_": data,
    }
    for name, s in streams.items():
        np.testing.assert_array_equal(out[s], want[name], err_msg=name)


def test_flatten_inplace_aliases_its_input():
    # ops.flatten_ is the in-place version: an update through the result changes the input.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(np.zeros((2, 2), np.float32))
        ops.add_(x.flatten_(), popxl.constant(np.array([1, 2, 3, 4], np.float32)))
        s = _store(x)
    np.testing.assert_array_equal(_run(ir, "fast")[s], [[1, 2], [3, 4]])


# ---- (d) errors name the value given -----------------------------------------------------------


@pytest.mark.parametrize("count", [2.5, "3", True])
def test_repeat_count_error_names_the_value(count):
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(2, np.float32))
        g = ir.create_graph(lambda a: a + 1, x)
        with pytest.raises(
            TypeError, match=rf"repeat_count must be an int.*got {type(count).__name__} {count!r}"
        ):
            ops.repeat(g, count, x)


def test_type_errors_name_the_value_given():
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(TypeError, match=r"got float 2\.5"):
            ops.relu(2.5)
        with pytest.raises(TypeError, match=r"got str 'main'"):
            ops.call("main")
        with pytest.raises(TypeError, match=r"got list \[1, 2\]"):
            autodiff([1, 2])


# ---- repeat with count 0 ------------------------------------------------------------------------
# popart python/popxl/popxl/ops/repeat.py raises only for repeat_count < 0: a count of 0 runs the
# body no times and the loop-carried results are the inputs.


@pytest.mark.parametrize("replication", [1, 2])
@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_repeat_zero_times_returns_the_carried_inputs(executor, replication):
    x0 = np.array([1.0, 2.0], np.float32)
    ir = popxl.Ir(replication=replication)
    with ir.main_graph:
        x = popxl.variable(x0, name="x")
        w = popxl.variable(np.array([10.0, 20.0], np.float32), name="w")
        g = ir.create_graph(lambda a, b: a * b + 1, x, w)
        (y0,) = ops.repeat(g, 0, x, w)
        (y3,) = ops.repeat(g, 3, x, w)
        s0, s3 = _store(y0), _store(y3)
    out = _run(ir, executor)
    want3 = x0
    for _ in range(3):
        want3 = want3 * np.array([10.0, 20.0], np.float32) + 1
    reps = (replication,) if replication > 1 else ()
    np.testing.assert_array_equal(out[s0], np.broadcast_to(x0, (*reps, 2)))
    np.testing.assert_allclose(out[s3], np.broadcast_to(want3, (*reps, 2)))


# ---- rotary_pos_embed on upstream's layout ------------------------------------------------------
# popxl-addons ops/rotary_pos_embed: t is (batch, seq, heads, head_dim) and the sin / cos tables
# (seq, rotary_dim // 2) or (1 or batch, seq, rotary_dim // 2) broadcast over the heads
# (rotary_pos_embedx.cpp; its test compares with Hugging Face GPT-J's apply_rotary_pos_emb).


def _gptj_rope(q: np.ndarray, sin: np.ndarray, cos: np.ndarray, rotary_dim: int) -> np.ndarray:
    # Hugging Face GPT-J's formula: tables interleaved to (.., seq, 1, rotary_dim); x * cos plus
    # rotate_every_two(x) * sin, where rotate_every_two maps (a, b) pairs to (-b, a).
    sin = np.repeat(sin, 2, axis=-1)[..., None, :]
    cos = np.repeat(cos, 2, axis=-1)[..., None, :]
    rot, rest = q[..., :rotary_dim], q[..., rotary_dim:]
    swapped = np.stack([-rot[..., 1::2], rot[..., ::2]], axis=-1).reshape(rot.shape)
    return np.concatenate([rot * cos + swapped * sin, rest], axis=-1)


@pytest.mark.parametrize("table_rank", [2, 3, "batch"])
@pytest.mark.parametrize("rotary_dim", [None, 4, 16])
def test_rotary_pos_embed_matches_gptj_on_upstreams_layout(rotary_dim, table_rank):
    from torch_popxl.addons.ops.rotary_pos_embed import rotary_pos_embed, trig_tables

    batch, seq, heads, hdim = 3, 8, 2, 32  # upstream's test shapes: seq != heads
    q = RNG.normal(size=(batch, seq, heads, hdim)).astype(np.float32)
    r = rotary_dim or hdim
    sin, cos = trig_tables(seq, r)
    if table_rank == 3:
        sin, cos = sin[None], cos[None]
    elif table_rank == "batch":  # one table per batch row (positions offset by the row)
        tables = [trig_tables(seq + b, r) for b in range(batch)]
        sin = np.stack([s[b:] for b, (s, _) in enumerate(tables)])
        cos = np.stack([c[b:] for b, (_, c) in enumerate(tables)])
    ir = popxl.Ir()
    with ir.main_graph:
        y = rotary_pos_embed(
            popxl.variable(q), popxl.constant(sin), popxl.constant(cos), rotary_dim
        )
        s = _store(y)
    want = _gptj_rope(
        q, sin if sin.ndim == 3 else sin[None], cos if cos.ndim == 3 else cos[None], r
    )
    np.testing.assert_allclose(_run(ir, "fast")[s], want, rtol=1e-5, atol=1e-5)


def test_rotary_pos_embed_names_the_table_shape_it_expects():
    from torch_popxl.addons.ops.rotary_pos_embed import rotary_pos_embed, trig_table_constants

    ir = popxl.Ir()
    with ir.main_graph:
        q = popxl.variable(np.zeros((3, 8, 2, 32), np.float32))
        sin, cos = trig_table_constants(2, 32)  # tables for 2 positions, not seq = 8
        with pytest.raises(
            ValueError, match=r"sin must be \(seq, rotary_dim // 2\) = \(8, 16\).*got \(1, 2, 16\)"
        ):
            rotary_pos_embed(q, sin, cos)


# ---- CallSiteInfo._op.modifiesIndex ---------------------------------------------------------------
# popart tests/popxl/ops/call_test.py and repeat_test.py (test_by_ref, test_not_by_ref,
# test_repeat_by_ref_implicit / _explicit): a call site modifies input i iff the callee's input i
# is a TensorByRef (whether or not the callee writes it); a repeat's indices start at 2 (the
# loop's trip count and condition come first).


def _by_ref_first(x: popxl.TensorByRef, y: popxl.Tensor):
    return x + y  # reads only: by-ref is a permission, not a write


def _by_ref_second(x: popxl.Tensor, y: popxl.TensorByRef):
    ops.var_updates.accumulate_(y, x)
    return x


def _by_value(x: popxl.Tensor, y: popxl.Tensor):
    return ops.var_updates.accumulate_(x, y), y


@pytest.mark.parametrize(
    "fn, by_ref",
    [(_by_ref_first, [True, False]), (_by_ref_second, [False, True]), (_by_value, [False, False])],
)
def test_call_and_repeat_sites_report_modified_inputs_as_upstream(fn, by_ref):
    ir = popxl.Ir()
    with ir.main_graph:
        v1 = popxl.variable(np.float32(1))
        v2 = popxl.variable(np.float32(2))
        g = ir.create_graph(fn, v1, v2)
        call = ops.call_with_info(g, v1, v2)
        loop = ops.repeat_with_info(g, 3, v1, v2)
    assert [call._op.modifiesIndex(i) for i in (0, 1)] == by_ref
    assert [loop._op.modifiesIndex(i) for i in (0, 1, 2, 3)] == [False, False, *by_ref]


# ---- Session.device assignment ----------------------------------------------------------------
# Upstream's Session.device has a setter that stores the popart.DeviceInfo to attach to (apps
# assign one made by popdist). Here the object is kept and the run is unchanged; a torch device
# that differs from the session's own is refused, since replicas cannot move.


def test_session_device_accepts_upstreams_device_info_and_runs_unchanged():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.arange(4, dtype=np.float32))
        s = _store(x * 2.0)
    session = popxl.Session(ir, "ipu_hw")
    session.device = object()  # stands for a popart.DeviceInfo
    session.device = "cpu"  # the device it already uses
    assert session.device == torch.device("cpu")
    with session:
        np.testing.assert_array_equal(session.run()[s], np.arange(4, dtype=np.float32) * 2)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"cannot move them.*device='cuda'"):
            session.device = "cuda"
    with pytest.raises(ValueError, match="must be 'cpu' or 'cuda'"):
        session.device = "tpu"


# Upstream's session.device is the DeviceInfo: popxl-addons' tests end with
# session.device.detach(); attach()/detach() move no weights, the context manager does (PopXL's
# own session test walks this sequence).


def test_session_device_attach_and_detach_as_upstreams_device_info():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        w = popxl.variable(np.zeros(3, np.float32), name="w")
        ops.var_updates.accumulate_(w, popxl.constant(np.ones(3, np.float32)))
        s = _store(w * 1.0)
    session = popxl.Session(ir, "ipu_model")
    assert session.device == torch.device("cpu") and session.device.type == "cpu"
    assert not session.device.isAttached
    with session:  # attaches and writes the weights from the host
        assert session.device.isAttached
        np.testing.assert_array_equal(session.run()[s], [1, 1, 1])
        with session:  # already attached: nothing moves
            assert session.device.isAttached
            session.device.detach()  # no weights move
            assert not session.device.isAttached
            with pytest.raises(ValueError, match="Must be attached"):
                session.run()
            with session:  # a detached session attaches: weights from the host (zeros)
                assert session.device.isAttached
                np.testing.assert_array_equal(session.run()[s], [1, 1, 1])
            # leaving the context that attached it writes the weights back and detaches
            assert not session.device.isAttached
            np.testing.assert_array_equal(session.get_tensor_data(w), [1, 1, 1])
            session.device.attach()  # no weights move
            assert session.device.isAttached
            np.testing.assert_array_equal(session.run()[s], [2, 2, 2])
        assert session.device.isAttached  # this context did not attach it
    assert not session.device.isAttached
    np.testing.assert_array_equal(session.get_tensor_data(w), [2, 2, 2])


# ---- Session._pb_session: the applications' write_variables_pb ------------------------------
# Every application's utils.write_variables_pb (nlp/gpt3_2.7B, gpt_j, bloom, ...) writes weights
# with session._pb_session.writeWeights(popart.PyWeightsIO({tensor.id: array})) and then, when
# attached, session._pb_session.weightsFromHost().


@pytest.mark.parametrize("attached", [False, True])
def test_pb_session_write_weights_sets_variables_by_id(attached):
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        w = popxl.variable(np.zeros((2, 3), np.float32), name="w")
        b = popxl.variable(np.zeros(3, np.float32), name="b")
        s = _store(w + b)
    session = popxl.Session(ir, "ipu_hw")
    w_np = np.arange(6, dtype=np.float32).reshape(2, 3)
    b_np = np.full(3, 0.5, np.float32)
    with session if attached else contextlib.nullcontext():
        session._pb_session.writeWeights(PyWeightsIO({w.id: w_np, b.id: b_np}))
        if session.is_attached:
            session._pb_session.weightsFromHost()
        with pytest.raises(KeyError, match=r"no variable with id \['nope'\]"):
            session._pb_session.writeWeights({w.id: w_np * 0, "nope": b_np})
    np.testing.assert_array_equal(
        session.get_tensor_data(w), w_np
    )  # the failed write wrote nothing
    with session:
        out = session.run()[s]
    np.testing.assert_array_equal(out, np.stack([w_np + b_np] * 2))


# ---- popxl.context.get_current_context(): upstream's Context object --------------------------
# BLOOM's and GPT-3 175B's tp2d_replica_groups read get_current_context().graph.ir; upstream's
# Context (popart python/popxl/popxl/context.py) also has main_graph, ipu_id (default 0),
# io_tile_set, name_scopes and in_sequence (None outside any in_sequence and under 'pass').


def test_get_current_context_is_upstreams_live_context():
    from torch_popxl.context import get_current_context

    ctx = get_current_context()
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        assert ctx.graph is ir.main_graph and ctx.graph.ir is ir
        assert ctx.graph.ir.replica_grouping(group_size=2, stride=2).group_size == 2
        assert (ctx.ipu_id, ctx.io_tile_set, ctx.name_scopes, ctx.in_sequence) == (
            0,
            False,
            [],
            None,
        )
        g = ir.create_empty_graph("inner")
        with g, popxl.name_scope("layer"), popxl.ipu(1), popxl.io_tiles(), popxl.in_sequence(False):
            assert get_current_context() is ctx  # one context, as upstream
            assert ctx.graph is g and ctx.main_graph is ir.main_graph
            assert (ctx.ipu_id, ctx.io_tile_set, ctx.name_scopes, ctx.in_sequence) == (
                1, True, ["layer"], False
            )  # fmt: skip
            with popxl.in_sequence("pass"):
                assert ctx.in_sequence is None
        assert ctx.graph is ir.main_graph
    with pytest.raises(RuntimeError, match="No graph context is active"):
        _ = ctx.graph


# ---- called graphs take strided arguments --------------------------------------------------
# T5's and GPT-J's attention serialisation (``attention_serialisation > 1``): the query is
# transposed to (batch, heads, seq, size), split along the sequence, and each piece goes
# through one called graph. Upstream a called graph takes its arguments' values, whatever op
# produced them; here the pieces are strided, while the callee's batched ``@`` was recorded on
# contiguous inputs (Note [recorded views meet other layouts], capture.py). T5's
# ``finetuning.py`` autodiffs the block that makes these calls.

_Q = RNG.random((2, 8, 2, 16), dtype=np.float32)  # (batch, seq, heads, head size)
_K = RNG.random((2, 2, 16, 8), dtype=np.float32)  # (batch, heads, head size, seq)
_DS = RNG.random((2, 2, 8, 8), dtype=np.float32)  # gradient of the scores


def _serialised_scores(q: popxl.Tensor, k: popxl.Tensor) -> popxl.Tensor:
    q0, q1 = ops.split(q.transpose((0, 2, 1, 3)), 2, axis=2)
    blk = popxl.gcg().ir.create_graph(lambda a, b: a @ b, q0, k)
    (s0,) = ops.call(blk, q0, k)
    (s1,) = ops.call(blk, q1, k)
    return ops.concat([s0, s1], axis=2)


@pytest.mark.parametrize("replication", [1, 2])
@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_called_graph_takes_strided_arguments(executor, replication):
    ir = popxl.Ir(replication=replication)
    with ir.main_graph:
        out = _store(_serialised_scores(popxl.constant(_Q), popxl.constant(_K)))
    got = _run(ir, executor)[out]
    expected = (torch.from_numpy(_Q).transpose(1, 2) @ torch.from_numpy(_K)).numpy()
    for r in range(replication):
        np.testing.assert_allclose(got[r] if replication > 1 else got, expected, rtol=1e-6)


@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_autodiff_through_called_graph_with_strided_arguments(executor):
    ir = popxl.Ir()
    with ir.main_graph:
        specs = [popxl.TensorSpec(a.shape, popxl.float32) for a in (_Q, _K)]
        fwd = addons.GraphWithNamedArgs(ir.create_graph(_serialised_scores, *specs))
        bwd = addons.autodiff(fwd)
        info = fwd.call_with_info(popxl.constant(_Q), popxl.constant(_K))
        dq, dk = bwd.call(popxl.constant(_DS), args=bwd.grad_graph_info.inputs_dict(info))
        outs = _store(info.outputs[0]), _store(dq), _store(dk)
    got = _run(ir, executor)
    q = torch.from_numpy(_Q).requires_grad_()
    k = torch.from_numpy(_K).requires_grad_()
    expected = q.transpose(1, 2) @ k
    expected.backward(torch.from_numpy(_DS))
    np.testing.assert_allclose(got[outs[0]], expected.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(got[outs[1]], q.grad.numpy(), rtol=1e-5)
    np.testing.assert_allclose(got[outs[2]], k.grad.numpy(), rtol=1e-5)


# ---- (h) BERT pretraining (nlp/bert/popxl/pretraining.py) ---------------------------------
# Its layer graphs apply ``ops.dropout`` and are differentiated (autodiff_with_accumulation,
# then recompute_graph): upstream's dropout is one DropoutOp, not a modifying op, and its
# gradient scales the incoming gradient by the forward's mask / (1 - p). Its MLM head calls
# ``cross_entropy_with_grad`` with (batch, mask_tokens) labels for (batch * mask_tokens, vocab)
# logits: upstream's loss op reads labels flattened, one per row of logits.


def _dropout_and_gradient(executor, p, c, shape, differentiate):
    """``ops.dropout(x, seed, p) * c`` on ones and its gradient for ones, the backward graph
    made by ``differentiate(fwd)`` -> (graph, inputs_dict(info)); returns (y, dx)."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(np.ones(shape, np.float32), name="x")
        seed = popxl.variable(np.array([7, 11], np.uint32), popxl.uint32, name="seed")

        def f(x, seed):
            return ops.dropout(x, seed, p=p) * c

        fwd = ir.create_graph(f, x, seed)
        graph, inputs_dict = differentiate(fwd)
        info = ops.call_with_info(fwd, x, seed)
        (dx,) = ops.call(graph, popxl.constant(np.ones(shape, np.float32)),
                         inputs_dict=inputs_dict(info))  # fmt: skip
        sy, sdx = _store(info.parent_output(0)), _store(dx)
    out = _run(ir, executor)
    return out[sy], out[sdx]


@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_autodiff_of_dropout_scales_by_the_forward_mask(executor):
    p, c = 0.25, 3.0

    def differentiate(fwd):
        grad = autodiff(fwd, grads_required=[fwd.inputs[0]])
        return grad.graph, grad.inputs_dict

    y, dx = _dropout_and_gradient(executor, p, c, (16, 32), differentiate)
    kept = y != 0
    # the forward's values: c / (1 - p) where kept; about p of them dropped
    np.testing.assert_allclose(y[kept], c / (1 - p), rtol=1e-6)
    assert 0.1 < 1 - kept.mean() < 0.4
    # the gradient: the same mask, the same scale
    np.testing.assert_allclose(dx, np.where(kept, c / (1 - p), 0.0), rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_with_grad_reads_labels_one_per_row_of_logits(reduction):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2 * 5, 7)).astype(np.float32)
    labels = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
    labels[0, 1] = 0  # an ignored label (BERT's MLM ignore_index=0)
    ir = popxl.Ir()
    with ir.main_graph:
        loss, dx = addons.ops.cross_entropy_with_grad(
            popxl.constant(logits), popxl.constant(labels), loss_scaling=8, ignore_index=0,
            reduction=reduction,
        )  # fmt: skip
        s_loss, s_dx = _store(loss), _store(dx)
    out = _run(ir, "fast")
    tx = torch.tensor(logits, requires_grad=True)
    tl = torch.nn.functional.cross_entropy(
        tx, torch.tensor(labels.reshape(-1), dtype=torch.long), ignore_index=0,
        reduction=reduction,
    )  # fmt: skip
    (8 * tl).sum().backward()
    expected = tl.detach().numpy().reshape(labels.shape) if reduction == "none" else tl.item()
    np.testing.assert_allclose(out[s_loss], expected, rtol=1e-5)
    np.testing.assert_allclose(out[s_dx], tx.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_cross_entropy_with_grad_names_a_label_count_that_does_not_match_the_rows():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(np.zeros((10, 7), np.float32))
        with pytest.raises(ValueError, match=r"labels have shape \(3, 3\) \(9 labels\).*\(10,\)"):
            addons.ops.cross_entropy_with_grad(x, popxl.constant(np.zeros((3, 3), np.int32)))


# Dropout draws its mask from its seed tensor (Note [samples come from the seed]): BERT's
# and GPT-3's layer gradients are recomputed (``recompute_graph`` replays the dropout), and the
# tensor-parallel applications give a tensor-parallel group one seed so their "identical"
# dropout drops the same elements on every shard.


@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_dropout_mask_is_a_function_of_the_seed(executor):
    R, p = 4, 0.5
    ir = popxl.Ir(replication=R)
    shared, per_replica = ir.replica_grouping(group_size=R), ir.replica_grouping(group_size=1)
    with ir.main_graph, popxl.in_sequence():
        x = popxl.variable(np.ones((16, 32), np.float32), name="x")
        seed = popxl.variable(np.array([3, 5], np.uint32), popxl.uint32, name="seed",
                              replica_grouping=shared)  # fmt: skip
        seeds = popxl.variable(np.array([[1, 2], [1, 2], [9, 4], [6, 6]], np.uint32), popxl.uint32,
                               name="seeds", replica_grouping=per_replica)  # fmt: skip
        _, other = ops.split_random_seed(seed)
        first, again = ops.dropout(x, seed, p), ops.dropout(x, seed, p)
        new_seed, own = ops.dropout(x, other, p), ops.dropout(x, seeds, p)
        shaped = ops.shaped_dropout(x, seed, [1, 32], p)
        shaped_again = ops.shaped_dropout(x, seed, [1, 32], p)
        s = [_store(t) for t in (first, again, new_seed, own, shaped, shaped_again)]
    out = _run(ir, executor)
    first, again, new_seed, own, shaped, shaped_again = (out[t] != 0 for t in s)
    assert 0.4 < 1 - first.mean() < 0.6
    np.testing.assert_allclose(out[s[0]][first], 1 / (1 - p))
    np.testing.assert_array_equal(first, again)  # the same seed, the same mask
    assert (first != new_seed).mean() > 0.3  # another seed, another mask
    for r in range(1, R):  # every replica given the seed drops the same elements
        np.testing.assert_array_equal(first[r], first[0])
    np.testing.assert_array_equal(own[1], own[0])  # replicas 0 and 1 share seeds [1, 2]
    assert (own[2] != own[0]).mean() > 0.3 and (own[3] != own[2]).mean() > 0.3
    np.testing.assert_array_equal(shaped, shaped_again)
    np.testing.assert_array_equal(shaped, np.broadcast_to(shaped[:, :1], shaped.shape))


@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_recomputed_dropout_uses_the_forward_mask(executor):
    p, c = 0.5, 2.0

    def differentiate(fwd):
        grad = addons.autodiff(addons.GraphWithNamedArgs(fwd), grads_required=[fwd.inputs[0]])
        grad = addons.transforms.recompute_graph(grad)  # the gradient replays the forward
        return grad.graph, grad.grad_graph_info.inputs_dict

    y, dx = _dropout_and_gradient(executor, p, c, (8, 16), differentiate)
    kept = y != 0
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(dx, np.where(kept, c / (1 - p), 0.0), rtol=1e-6)
