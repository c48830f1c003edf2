"""addons.ops for tensor-parallel models: sharded cross entropy, distributed layer norm, RoPE,
grad_reduce_square_add; values and gradients per replica against torch on the unsharded data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl import ops
from torch_popxl.addons.layers.layer_norm_distributed import LayerNormDistributed
from torch_popxl.addons.ops.cross_entropy_sharded_loss import cross_entropy_sharded_loss
from torch_popxl.addons.ops.cross_entropy_sharded_wr_loss import cross_entropy_sharded_wr_loss
from torch_popxl.addons.ops.grad_reduce_square_add import grad_reduce_square_add
from torch_popxl.addons.ops.layer_norm_distributed import layer_norm_distributed
from torch_popxl.addons.ops.rotary_pos_embed import (
    rotary_pos_embed,
    trig_table_constants,
    trig_tables,
)

R, TP = 4, 2  # two data-parallel groups of two tensor-parallel shards (replicas {0,1}, {2,3})


class Fn(addons.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def build(self, *ts):
        return self.fn(*ts)


def run_fwd_bwd(fn, inputs: dict, seed_shape, n_grads: int, replication=R):
    """``fn`` over per-replica host inputs (``{name: (per-replica array, dtype)}``), its output
    and the gradients of its first ``n_grads`` inputs for a seed of ones."""
    ir = popxl.Ir(replication=replication)
    with ir.main_graph:
        streams = {k: popxl.h2d_stream(a.shape[1:], dt, k) for k, (a, dt) in inputs.items()}
        ts = [ops.host_load(s) for s in streams.values()]
        facts, fwd = Fn(lambda *a: fn(ir, *a)).create_graph(*ts)
        bwd = addons.autodiff(fwd, grads_required=fwd.graph.inputs[:n_grads])
        info = fwd.bind(facts.init()).call_with_info(*ts)
        seed = popxl.constant(np.ones(seed_shape, np.float32))
        grads = bwd.call(seed, args=bwd.grad_graph_info.inputs_dict(info))
        outs = [addons.host_store(t) for t in (info.outputs[0], *grads)]
    with popxl.Session(ir, "ipu_model") as session:
        result = session.run(
            {streams[k]: a if replication > 1 else a[0] for k, (a, _) in inputs.items()}
        )
    return [result[o] for o in outs]


def shard_per_replica(a: np.ndarray, axis: int) -> np.ndarray:
    """Replica r gets shard r % TP of ``a`` along ``axis``."""
    shards = np.split(a, TP, axis=axis)
    return np.stack([shards[r % TP] for r in range(R)])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_sharded_loss_matches_torch_on_the_full_logits(reduction):
    rng = np.random.default_rng(0)
    n, classes = 6, 8
    logits = (rng.normal(size=(n, classes)) * 3).astype(np.float32)
    labels = rng.integers(0, classes, size=n)
    shard = classes // TP
    shifted = np.stack([labels - shard * (r % TP) for r in range(R)]).astype(np.int32)
    loss, dlogits = run_fwd_bwd(
        lambda ir, x, i: cross_entropy_sharded_loss(
            x, i, replica_grouping=ir.replica_grouping(1, TP), reduction=reduction
        ),  # fmt: skip
        {"logits": (shard_per_replica(logits, 1), popxl.float32), "idx": (shifted, popxl.int32)},
        (n,) if reduction == "none" else (),
        1,
    )
    tx = torch.tensor(logits, requires_grad=True)
    tloss = torch.nn.functional.cross_entropy(tx, torch.tensor(labels), reduction=reduction)
    tloss.backward(torch.ones_like(tloss))
    for r in range(R):  # the same loss on every replica; each gets its slice of the gradient
        np.testing.assert_allclose(loss[r], tloss.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            dlogits[r], shard_per_replica(tx.grad.numpy(), 1)[r], rtol=1e-5, atol=1e-6
        )


def test_cross_entropy_sharded_loss_ignore_index_masks_samples_out_of_the_mean():
    rng = np.random.default_rng(1)
    n, classes = 5, 6
    logits = rng.normal(size=(n, classes)).astype(np.float32)
    labels = np.array([0, 4, -100, 5, -100])
    shard = classes // TP
    shifted = np.stack([labels - shard * (r % TP) for r in range(R)]).astype(np.int32)
    ignore = np.array(
        [-100 - shard * (r % TP) for r in range(R)], np.int32
    )  # shifted like the labels
    loss, dlogits = run_fwd_bwd(
        lambda ir, x, i, ig: cross_entropy_sharded_loss(x, i, ignore_index=ig, replica_grouping=ir.replica_grouping(1, TP)),
        {"logits": (shard_per_replica(logits, 1), popxl.float32), "idx": (shifted, popxl.int32),
         "ignore": (ignore, popxl.int32)},
        (), 1,
    )  # fmt: skip
    tx = torch.tensor(logits, requires_grad=True)
    tloss = torch.nn.functional.cross_entropy(tx, torch.tensor(labels), ignore_index=-100)
    tloss.backward()
    for r in range(R):
        np.testing.assert_allclose(loss[r], tloss.item(), rtol=1e-5)
        np.testing.assert_allclose(
            dlogits[r], shard_per_replica(tx.grad.numpy(), 1)[r], rtol=1e-5, atol=1e-6
        )


def test_cross_entropy_sharded_loss_rejects_bad_shapes_and_reductions():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        x = popxl.variable(np.zeros((3, 4), np.float32))
        i = popxl.variable(np.zeros(3, np.int32))
        with pytest.raises(ValueError, match="reduction must be one of"):
            cross_entropy_sharded_loss(x, i, reduction="max")
        with pytest.raises(ValueError, match=r"got logits \(3, 4\) and indices \(2,\)"):
            cross_entropy_sharded_loss(x, popxl.variable(np.zeros(2, np.int32)))


def test_layer_norm_distributed_matches_torch_layer_norm_on_the_full_hidden_axis():
    rng = np.random.default_rng(2)
    n, hidden = 3, 8
    x = rng.normal(size=(n, hidden)).astype(np.float32)
    w = rng.normal(size=hidden).astype(np.float32)
    b = rng.normal(size=hidden).astype(np.float32)
    y, dx, dw, db = run_fwd_bwd(
        lambda ir, t, wt, bt: layer_norm_distributed(t, wt, bt, group=ir.replica_grouping(1, TP)),
        {"x": (shard_per_replica(x, 1), popxl.float32), "w": (shard_per_replica(w, 0), popxl.float32),
         "b": (shard_per_replica(b, 0), popxl.float32)},
        (n, hidden // TP), 3,
    )  # fmt: skip
    ln = torch.nn.LayerNorm(hidden)
    with torch.no_grad():
        ln.weight.copy_(torch.tensor(w))
        ln.bias.copy_(torch.tensor(b))
    tx = torch.tensor(x, requires_grad=True)
    ty = ln(tx)
    ty.sum().backward()
    np.testing.assert_allclose(y, shard_per_replica(ty.detach().numpy(), 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, shard_per_replica(tx.grad.numpy(), 1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        dw, shard_per_replica(ln.weight.grad.numpy(), 0), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(db, shard_per_replica(ln.bias.grad.numpy(), 0), rtol=1e-4, atol=1e-5)


def test_layer_norm_distributed_layer_shards_its_variables_over_the_transposed_grouping():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 6)).astype(np.float32)
    ir = popxl.Ir(replication=R)
    tp_group = ir.replica_grouping(1, TP)
    with ir.main_graph:
        xs = popxl.h2d_stream((2, 3), popxl.float32, "x")
        facts, graph = LayerNormDistributed(tp_group).create_graph(xs.spec)
        variables = facts.init()
        y = graph.bind(variables).call(ops.host_load(xs))[0]
        out = addons.host_store(y)
    assert variables.weight.replica_grouping.num_groups == TP
    w = rng.normal(size=6).astype(np.float32)
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variable_data(variables.weight, np.stack(np.split(w, TP)))
        got = session.run({xs: shard_per_replica(x, 1)})[out]
    ref = torch.nn.functional.layer_norm(torch.tensor(x), (6,), torch.tensor(w), None, 1e-5).numpy()
    np.testing.assert_allclose(got, shard_per_replica(ref, 1), rtol=1e-5, atol=1e-5)


def rope_reference(t: np.ndarray, rotary_dim: int, base: int = 10000) -> torch.Tensor:
    """RoPE as a complex multiplication: pair k at position m times exp(i m base^(-2k/r)), for
    ``t`` in upstream's layout (batch, seq, heads, head_dim)."""
    tt = torch.tensor(t, dtype=torch.float64)
    seq = t.shape[1]
    theta = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = torch.outer(torch.arange(seq, dtype=torch.float64), theta)[:, None, :]  # over heads
    z = torch.view_as_complex(
        tt[..., :rotary_dim].reshape(*t.shape[:-1], rotary_dim // 2, 2).contiguous()
    )
    rotated = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).reshape(
        *t.shape[:-1], rotary_dim
    )
    return torch.cat([rotated, tt[..., rotary_dim:]], -1)


@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_rotary_pos_embed_is_a_complex_rotation_and_its_gradient_the_inverse(rotary_dim):
    rng = np.random.default_rng(4)
    t = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)  # (batch, seq, heads, head_dim)
    r = rotary_dim or 8
    y, dt = run_fwd_bwd(
        lambda ir, x: rotary_pos_embed(x, *trig_table_constants(5, r), rotary_dim=rotary_dim),
        {"t": (t[None], popxl.float32)}, t.shape, 1, replication=1,
    )  # fmt: skip
    np.testing.assert_allclose(y, rope_reference(t, r).numpy(), rtol=1e-5, atol=1e-5)
    # Gradient: torch autograd through the rotation written with the sin / cos tables.
    tt = torch.tensor(t, dtype=torch.float64, requires_grad=True)
    tx = tt.clone()
    seq = t.shape[1]
    sin, cos = (torch.tensor(a)[:, None, :] for a in trig_tables(seq, r, np_dtype="float64"))
    pairs = tx[..., :r].reshape(*t.shape[:-1], r // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.cat([torch.stack([re * cos - im * sin, re * sin + im * cos], -1).reshape(*t.shape[:-1], r),
                     tx[..., r:]], -1)  # fmt: skip
    out.sum().backward()
    np.testing.assert_allclose(dt, tt.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_trig_tables_and_rotary_argument_checks():
    sin, cos = trig_tables(4, 6)
    assert sin.shape == cos.shape == (4, 3)
    np.testing.assert_allclose(sin[2, 1], np.sin(2 * 10000 ** (-2 / 6)), rtol=1e-6)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros((1, 4, 1, 6), np.float32))
        s, c = trig_table_constants(4, 6)
        with pytest.raises(ValueError, match="must be even"):
            rotary_pos_embed(x, s, c, rotary_dim=5)
        with pytest.raises(ValueError, match=r"\(seq, rotary_dim // 2\) = \(4, 2\)"):
            rotary_pos_embed(x, s, c, rotary_dim=4)


@pytest.mark.parametrize("dtype, scale_as_tensor", [(popxl.float32, False), (popxl.float16, True)])
def test_grad_reduce_square_add_is_the_unscaled_squared_norm(dtype, scale_as_tensor):
    g = (np.random.default_rng(5).normal(size=(7, 3)) * 64).astype(dtype.as_numpy())
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(g, dtype)
        ls = popxl.constant(64.0, popxl.float32) if scale_as_tensor else 64
        out = addons.host_store(grad_reduce_square_add(t, ls))
    with popxl.Session(ir, "ipu_model") as session:
        got = session.run()[out]
    assert got.dtype == np.float32 and got.shape == ()
    np.testing.assert_allclose(got, (g.astype(np.float64) ** 2).sum() / 64**2, rtol=1e-5)


def test_cross_entropy_sharded_wr_loss_matches_torch_per_sample_with_shard_gradients():
    rng = np.random.default_rng(6)
    n, widths = 4, (3, 5)
    logits = rng.normal(size=(n, sum(widths))).astype(np.float32)
    labels = np.array([0, 7, 3, 4])
    parts = np.split(logits, [widths[0]], axis=1)
    y, d0, d1 = run_fwd_bwd(
        lambda ir, a, b, i: cross_entropy_sharded_wr_loss([a, b], [i, i], ipus=[0, 1]),
        {"a": (parts[0][None], popxl.float32), "b": (parts[1][None], popxl.float32),
         "i": (labels[None].astype(np.int32), popxl.int32)},
        (n,), 2, replication=1,
    )  # fmt: skip
    tx = torch.tensor(logits, requires_grad=True)
    tloss = torch.nn.functional.cross_entropy(tx, torch.tensor(labels), reduction="none")
    tloss.sum().backward()
    np.testing.assert_allclose(y, tloss.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([d0, d1], 1), tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    ir = popxl.Ir()
    with ir.main_graph, pytest.raises(ValueError, match="one indices tensor per logits shard"):
        x = popxl.variable(np.zeros((2, 3), np.float32))
        cross_entropy_sharded_wr_loss([x, x], [popxl.variable(np.zeros(2, np.int32))])
