"""The project's batching rules for aten ops torch has none for (Note [aten batching rules],
torch_popxl/opdefs/aten_batching.py), under ``torch.func.vmap`` against the op run on each
replica's values (eager torch), with replica-invariant arguments, and traced once as the
runtime traces them: one call of the op for all replicas, never one per replica. The OpInfo
sweep (tests/test_opinfo_sweep.py) covers every rule on torch's own samples; this file covers
what the sweep's samples do not: invariant arguments, indices out of range, arguments a rule
leaves to a per-replica loop, and that such a loop is reported."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torch_popxl  # noqa: F401 - registers the rules
from torch_popxl.runtime.executor import _per_replica_loops

R = 3


def _per_replica(fn, args, in_dims):
    rows = [fn(*[a if d is None else a[r] for a, d in zip(args, in_dims, strict=True)])
            for r in range(R)]  # fmt: skip
    if isinstance(rows[0], tuple):
        return tuple(torch.stack(o) for o in zip(*rows, strict=True))
    return torch.stack(rows)


def _check(fn, args, in_dims, rtol=1e-5, atol=1e-6):
    """``fn`` under vmap equals ``fn`` per replica, and its traced form runs no loop."""
    batched = torch.func.vmap(fn, in_dims=in_dims, randomness="different")
    got, want = batched(*args), _per_replica(fn, args, in_dims)
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,), strict=True):  # fmt: skip
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
    graph = make_fx(batched, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    assert _per_replica_loops(graph, R) == ()


g = torch.Generator().manual_seed(0)
X = torch.randn(R, 4, 5, generator=g)


def test_take_with_invariant_values_and_per_replica_indices_negative_ones_wrapped():
    index = torch.tensor([[0, -1, 7], [19, 3, -20], [5, 5, 2]])
    _check(torch.take, (X[0], index), (None, 0))
    _check(torch.take, (X, index[0]), (0, None))


def test_take_raises_for_an_index_out_of_range_as_eager_does():
    index = torch.tensor([[0], [20], [1]])  # replica 1's index is past its 20 values
    with pytest.raises(IndexError):
        torch.take(X[1], index[1])
    with pytest.raises((IndexError, RuntimeError)):
        torch.func.vmap(torch.take)(X, index)


def test_put_accumulates_within_each_replica():
    index = torch.tensor([[0, 0, 3], [1, 1, 1], [19, -1, 2]])
    src = torch.randn(R, 3, generator=g)
    _check(lambda x, i, s: torch.put(x, i, s, accumulate=True), (X, index, src), (0, 0, 0))


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")  # torch's, in eager too
def test_index_reduce_with_an_invariant_index_over_a_middle_dim():
    src = torch.randn(R, 4, 3, generator=g)
    index = torch.tensor([4, 0, 4])
    for reduce in ("prod", "mean", "amax", "amin"):

        def fn(x, s, reduce=reduce):
            return x.index_reduce(1, index, s, reduce)

        _check(functools.partial(fn, reduce=reduce), (X, src), (0, 0))


def test_isin_with_invariant_test_elements_and_invert():
    ints = torch.randint(0, 6, (R, 4, 5), generator=g)
    test = torch.tensor([1, 3])
    _check(lambda e: torch.isin(e, test, invert=True), (ints,), (0,))
    _check(lambda t: torch.isin(ints[0], t), (torch.randint(0, 6, (R, 2), generator=g),), (0,))


def test_histc_with_each_replicas_own_range():
    x = torch.randn(R, 50, generator=g)
    x[1] = 2.0  # one value: eager widens the range by 1 on each side
    _check(lambda v: torch.histc(v, bins=7), (x,), (0,))
    _check(lambda v: torch.histc(v, bins=4, min=-1, max=1), (x,), (0,))


def test_max_unpool_with_and_without_a_batch_dim_per_replica():
    pool = torch.nn.functional.max_pool2d
    unpool = torch.nn.functional.max_unpool2d
    for shape in ((R, 2, 3, 4, 4), (R, 3, 4, 4)):
        x = torch.randn(*shape, generator=g)
        out, idx = torch.func.vmap(lambda v: pool(v, 2, return_indices=True))(x)
        _check(lambda o, i: unpool(o, i, 2), (out, idx), (0, 0))


def test_margin_losses_fold_the_replicas_into_the_samples():
    x = torch.randn(R, 6, 4, generator=g)
    y = torch.randint(0, 4, (R, 6), generator=g)
    F = torch.nn.functional
    for reduction in ("none", "mean", "sum"):
        _check(functools.partial(F.multi_margin_loss, reduction=reduction), (x, y), (0, 0))
    # the same targets on every replica
    _check(lambda a: F.multi_margin_loss(a, y[0], p=2, margin=0.5), (x,), (0,))


def test_a_class_weight_per_replica_runs_per_replica_and_the_trace_says_so():
    # the rule does not cover a batched class weight: the op runs once per replica
    # (vmap's fallback), and the runtime's check finds the loop (Session.explain reports it)
    x = torch.randn(R, 6, 4, generator=g)
    y = torch.randint(0, 4, (R, 6), generator=g)
    w = torch.rand(R, 4, generator=g)
    fn = torch.nn.functional.multi_margin_loss
    batched = torch.func.vmap(lambda a, b, c: fn(a, b, weight=c))
    torch.testing.assert_close(
        batched(x, y, w), _per_replica(lambda a, b, c: fn(a, b, weight=c), (x, y, w), (0, 0, 0))
    )
    graph = make_fx(batched, tracing_mode="fake")(x, y, w)
    assert _per_replica_loops(graph, R) == ("aten.multi_margin_loss.default",)


def test_segment_reduce_with_per_replica_lengths():
    data = torch.randn(R, 6, 2, generator=g)
    lengths = torch.tensor([[1, 2, 3], [3, 3, 0], [0, 0, 6]])
    _check(lambda d, n: torch.segment_reduce(d, "max", lengths=n, unsafe=True), (data, lengths),
           (0, 0))  # fmt: skip
    _check(lambda d: torch.segment_reduce(d, "mean", lengths=lengths[1], axis=0), (data,), (0,))


def test_masked_scatter_with_a_broadcast_mask():
    mask = torch.tensor([[True, False, True, False, True]] * R)
    mask[1] = ~mask[1]
    src = torch.randn(R, 20, generator=g)
    _check(torch.Tensor.masked_scatter, (X, mask, src), (0, 0, 0))
    _check(lambda x, s: x.masked_scatter(mask[0], s), (X, src), (0, 0))


def test_renorm_norms_each_replicas_slices_alone():
    _check(lambda x: torch.renorm(x, 2, 1, 1.5), (X * 3,), (0,))
    _check(lambda x: torch.renorm(x, 1, -1, 2.0), (X * 3,), (0,))


def test_fractional_max_pool_draws_per_replica_and_pools_each_replica_with_its_draw():
    x = torch.randn(1, 2, 9, 9, generator=g).expand(R, 1, 2, 9, 9)  # the same on every replica
    F = torch.nn.functional
    # the rule with given samples equals eager per replica
    samples = torch.rand(R, 1, 2, 2, generator=g)
    _check(lambda v, s: F.fractional_max_pool2d(v, 2, output_size=4, _random_samples=s),
           (x, samples), (0, 0))  # fmt: skip
    # drawn under vmap: independent draws, so replicas with equal inputs pool differently
    torch.manual_seed(0)  # (deterministic: 2 channels x 2 axes of 19 -> 7 windows could match)
    big = torch.randn(1, 2, 19, 19, generator=g).expand(R, 1, 2, 19, 19)
    out = torch.func.vmap(lambda v: F.fractional_max_pool2d(v, 2, output_size=7),
                          randomness="different")(big)  # fmt: skip
    assert all(not torch.equal(out[0], out[r]) for r in range(1, R))


def test_histogram_edges_and_counts_per_replica():
    x = torch.randn(R, 40, generator=g)
    x[2] = 0.25  # one value: eager widens the range by 0.5 each side
    w = torch.rand(R, 40, generator=g)
    _check(lambda v: torch.histogram(v, bins=6), (x,), (0,))
    _check(lambda v, u: torch.histogram(v, bins=4, range=(-1.0, 1.0), weight=u, density=True),
           (x, w), (0, 0))  # fmt: skip
    edges = torch.sort(torch.randn(R, 5, generator=g), dim=1).values
    _check(lambda v, e: torch.histogram(v, e), (x, edges), (0, 0))


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")])
def test_pdist_gradient_for_each_norm(p):
    x = torch.randn(R, 5, 3, generator=g)
    x[:, 3] = x[:, 1]  # a pair at distance 0
    seed = torch.randn(R, 10, generator=g)
    aten = torch.ops.aten

    def grad(v, s):
        return aten._pdist_backward(s, v, p, aten._pdist_forward(v, p))

    _check(grad, (x, seed), (0, 0))


@pytest.mark.parametrize("dim", [0, 2, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_norm_gradient_norms_each_replicas_own_slices(dim, dtype):
    """weight_norm's gradient (wav2vec2's positional convolution) with a weight per replica or
    one for all (a parameter under a per-replica gradient), in float32 and bfloat16."""
    aten = torch.ops.aten
    v = torch.randn(R, 4, 3, 5, generator=g).to(dtype)
    g_shape = [R, 1, 1, 1]
    g_shape[dim % 3 + 1] = v.shape[dim % 3 + 1]
    gain = torch.randn(g_shape, generator=g).to(dtype)
    seed = torch.randn(R, 4, 3, 5, generator=g).to(dtype)

    norms = torch.stack([aten._weight_norm_interface(v[r], gain[r], dim % 3)[1] for r in range(R)])

    def grad(s, v, gain, norms):
        return aten._weight_norm_interface_backward(s, v, gain, norms, dim % 3)

    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    _check(grad, (seed, v, gain, norms), (0, 0, 0, 0), **tol)
    _check(grad, (seed, v[0], gain[0], norms[0]), (0, None, None, None), **tol)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@pytest.mark.parametrize(
    "mask",
    [None, "causal", "additive [L, S] per replica", "float [B, 1, L, S] shared"],
)
def test_cpu_flash_attention_folds_the_replicas_into_its_batch(mask):
    B, H, L, S, E = 2, 3, 5, 6, 4
    q = torch.randn(R, B, H, L, E, generator=g)
    k, v = torch.randn(R, B, H, S, E, generator=g), torch.randn(B, H, S, E, generator=g)  # v shared
    causal = mask == "causal"
    if mask == "additive [L, S] per replica":
        m, m_dim = torch.where(torch.rand(R, L, S, generator=g) > 0.3, 0.0, -1e4), 0
    elif mask == "float [B, 1, L, S] shared":
        m, m_dim = torch.randn(B, 1, L, S, generator=g), None
    else:
        m, m_dim = None, None

    def forward(q, k, v, m):
        return _FLASH(q, k, v, 0.0, causal, attn_mask=m)

    _check(forward, (q, k, v, m), (0, 0, None, m_dim) if m is not None else (0, 0, None, None))
    out, lse = (torch.stack(t) for t in zip(*[forward(q[r], k[r], v, m if m_dim is None else m[r])
                                               for r in range(R)], strict=True))  # fmt: skip
    grad = torch.randn_like(out)

    def backward(grad, q, k, out, lse, m):
        return _FLASH_BACKWARD(grad, q, k, v, out, lse, 0.0, causal, attn_mask=m)

    _check(backward, (grad, q, k, out, lse, m), (0, 0, 0, 0, 0, m_dim))


@pytest.mark.parametrize("op", [torch.ops.aten._embedding_bag.default,
                                torch.ops.aten._embedding_bag_forward_only.default])  # fmt: skip
@pytest.mark.parametrize("mode", [0, 1, 2], ids=["sum", "mean", "max"])
@pytest.mark.parametrize("table", ["invariant", "per_replica"])
def test_embedding_bags_of_every_replica_are_bags_of_one_call(op, mode, table):
    # every output (the bags, and offset2bag, bag sizes and max indices the backward reads)
    # as per replica, with an empty bag and a padding index where the table is shared
    weight = torch.randn(R, 7, 3, generator=g)
    ids = torch.randint(0, 7, (R, 6), generator=g)
    offsets = torch.tensor([[0, 2, 2, 5]] * R)
    weights = torch.rand(R, 6, generator=g) if mode == 0 else None
    pad = 2 if table == "invariant" else -1

    def bags(w, i, o, p):
        return op(w, i, o, False, mode, False, p, False, pad)

    args, dims = (weight, ids, offsets, weights), (0, 0, 0, None if weights is None else 0)
    if table == "invariant":
        args, dims = (weight[0], *args[1:]), (None, *dims[1:])
    _check(bags, args, dims)


def test_embedding_bags_closed_by_a_last_offset_run_per_replica_and_the_trace_says_so():
    weight, ids = torch.randn(7, 3, generator=g), torch.randint(0, 7, (R, 6), generator=g)
    offsets = torch.tensor([[0, 2, 4], [0, 3, 6], [0, 1, 5]])  # the last closes the bags

    def bags(i, o):
        return torch.ops.aten._embedding_bag.default(weight, i, o, False, 0, False, None, True)

    batched = torch.func.vmap(bags)
    for got, want in zip(batched(ids, offsets), _per_replica(bags, (ids, offsets), (0, 0)),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want)
    graph = make_fx(batched, tracing_mode="fake", _allow_non_fake_inputs=True)(ids, offsets)
    assert _per_replica_loops(graph, R) != ()
