"""PyTorch's OpInfo database through the simulator: every op's forward at R=2, each replica
given different data, against eager torch run on each replica's data.

``sweep()`` returns one ``Outcome`` per (op, sample); ``python tests/opinfo_sweep.py`` prints
the counts (the README quotes them) and every case that is not a clean pass.

Kinds of outcome:
* ``pass``: every output equals eager's per replica (float32: rtol 1e-4, atol 1e-5 of the
  output's scale, reductions may sum in another order; integers and bools exactly; programs
  that draw random numbers and uninitialised outputs: shape and dtype only);
* ``slow``: equal, but some fragment runs on the per-replica path (``session.explain()``);
* ``wrong``: an output differs from eager's;
* ``error``: capture, build or run raised (``detail`` says what);
* ``skip``: the case is outside what a PopXL program carries (``detail``: why), decided
  before the program is built.

A pass or slow case also says which of its fragments are not explicitly batched (``traced``:
they run torch's batching rules traced under vmap, Note [vmap traced once]), and why.
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils._pytree as pytree

import torch_popxl as popxl
from torch_popxl import capture, ops
from torch_popxl import dtypes as _dt
from torch_popxl.ir.graph import OpKind
from torch_popxl.runtime import explicit

R = 2
SAMPLES_PER_OP = 2
# dtypes a host stream carries and eager torch computes on the CPU alike
_DTYPES = {torch.float32, torch.int64, torch.int32, torch.bool}


@dataclass(frozen=True)
class Outcome:
    op: str
    sample: int
    kind: str  # pass, slow, wrong, error, skip
    detail: str = ""
    # the fragments (a pass or slow case's) that are not explicitly batched (Note [explicit
    # batching]), with the op that kept each off it: traced under vmap, or slow
    traced: str = ""


def _replica_data(t: torch.Tensor, r: int) -> torch.Tensor:
    """Replica ``r``'s value of a sample tensor: replica 0 the sample itself, replica 1 the
    same shape with other values where that keeps the op's domain (floats shifted and
    scaled; integers and bools, often indices or masks, kept)."""
    if r == 0 or not t.dtype.is_floating_point:
        return t.clone()
    g = torch.Generator().manual_seed(1234 + t.numel())
    return (t * 0.75 + 0.1 * torch.rand(t.shape, generator=g, dtype=t.dtype)).to(t.dtype)


def _leaves(sample):
    return pytree.tree_flatten((sample.input, sample.args, sample.kwargs))


def _unsupported(op, sample) -> str | None:
    leaves, _ = _leaves(sample)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        return "no tensor input"
    for t in tensors:
        if t.dtype not in _DTYPES:
            return f"input dtype {t.dtype}"
        if t.layout != torch.strided or t.is_sparse:
            return f"input layout {t.layout}"
    if any(isinstance(x, torch.Generator) for x in leaves):
        return "a Generator argument"
    return None


def _seed(t: torch.Tensor, r: int) -> torch.Tensor:
    """Replica ``r``'s gradient seed for an output shaped like ``t``."""
    g = torch.Generator().manual_seed(99 + 7 * r + t.numel())
    return torch.randn(t.shape, generator=g, dtype=t.dtype)


def _run_case(op, sample, backward: bool = False) -> Outcome:
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    why = _unsupported(op, sample)
    if why is not None:
        return Outcome(name, 0, "skip", why)
    leaves, spec = _leaves(sample)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    per_replica = {i: [_replica_data(leaves[i], r) for r in range(R)] for i in positions}
    # backward: the float inputs get gradients
    wrt = [i for i in positions if leaves[i].dtype.is_floating_point] if backward else []

    def eager(r: int):
        vals = list(leaves)
        for i in positions:
            vals[i] = per_replica[i][r].clone().requires_grad_(i in wrt)
        inp, args, kwargs = pytree.tree_unflatten(vals, spec)
        out = op.op(inp, *args, **kwargs)
        if not backward:
            return out
        outs = [o for o in pytree.tree_flatten(out)[0]
                if isinstance(o, torch.Tensor) and o.requires_grad]  # fmt: skip
        if not outs or any(not o.dtype.is_floating_point for o in outs):
            raise _NotDifferentiable  # none, or a complex one (streams carry real dtypes)
        grads = torch.autograd.grad(outs, [vals[i] for i in wrt], [_seed(o, r) for o in outs],
                                    allow_unused=True)  # fmt: skip
        # inputs the outputs do not depend on get no gradient (autodiff refuses to give one)
        used[:] = [i for i, g in zip(wrt, grads, strict=True) if g is not None]
        return [g for g in grads if g is not None]

    if backward and not wrt:
        return Outcome(name, 0, "skip", "no float input")
    used: list[int] = []
    try:
        want = [eager(r) for r in range(R)]
    except _NotDifferentiable:
        return Outcome(name, 0, "skip", "no differentiable output, or a complex one")
    except Exception as e:  # noqa: BLE001 - the replica-1 data left the op's domain
        return Outcome(name, 0, "skip", f"eager torch raises on replica data: {type(e).__name__}")
    out_leaves = [pytree.tree_flatten(w)[0] for w in want]
    if not all(isinstance(x, torch.Tensor) for x in out_leaves[0]) or not out_leaves[0]:
        return Outcome(name, 0, "skip", "an output that is not a tensor")
    if any(x.dtype not in _DTYPES or x.layout != torch.strided for x in out_leaves[0]):
        return Outcome(name, 0, "skip", "an output dtype or layout a stream does not carry")
    try:
        if backward:
            if not used:
                return Outcome(name, 0, "skip", "no input gets a gradient")
            got, slow, random = _simulate_backward(op, leaves, spec, positions, per_replica, used)
        else:
            got, slow, random = _simulate(op, leaves, spec, positions, per_replica)
    except Exception as e:  # noqa: BLE001 - the sweep records every failure
        return Outcome(name, 0, "error", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    uninitialised = op.name in _UNINITIALISED
    for k in range(len(out_leaves[0])):
        for r in range(R):
            g, e = got[k][r], out_leaves[r][k].detach().numpy(force=True)
            if g.shape != e.shape or g.dtype != e.dtype:
                return Outcome(name, 0, "wrong", f"output {k} replica {r}: {g.shape} {g.dtype} "
                               f"against eager's {e.shape} {e.dtype}")  # fmt: skip
            if random or uninitialised:
                continue
            # reductions sum in another order: absolute error relative to the output's scale
            scale = float(np.nanmax(np.abs(e), initial=1.0)) if e.dtype.kind == "f" else 0.0
            if not np.allclose(g, e, rtol=1e-4, atol=1e-5 * max(scale, 1.0), equal_nan=True):
                diff = np.nanmax(np.abs(g.astype(np.float64) - e.astype(np.float64)))
                return Outcome(name, 0, "wrong", f"output {k} replica {r}: max |diff| {diff:.3g}")
    slow, traced = slow
    return Outcome(name, 0, "slow" if slow else "pass", "; ".join(slow), traced)


class _NotDifferentiable(Exception):
    pass


# ops whose outputs hold whatever memory they were given
_UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}


def _load_inputs(leaves, positions):
    """Host streams and their loads for the sample's tensors, in the current graph."""
    streams, vals = {}, list(leaves)
    for i in positions:
        t = leaves[i]
        streams[i] = popxl.h2d_stream(tuple(t.shape), _dt.dtype.as_dtype(t.dtype), f"in{i}")
        vals[i] = ops.host_load(streams[i])
    return streams, vals


def _call(op, vals, spec):
    inp, args, kwargs = pytree.tree_unflatten(vals, spec)
    # as captured torch code: the op sees torch tensors (some OpInfo variants are unbound
    # torch.Tensor methods, which take nothing else)
    return capture.call_torch(op.op, (inp, *args), kwargs)


def _store(ys) -> list:
    outs = []
    for y in ys:
        d = popxl.d2h_stream(y.shape, y.dtype)
        ops.host_store(d, y)
        outs.append(d)
    return outs


def _execute(ir, outs, feed):
    # values drawn at random are compared by shape and dtype only (tests/test_random_replicas.py
    # checks their distributions)
    graphs = [ir.main_graph, *ir.main_graph.called_graphs]
    random = any(
        op.kind is OpKind.TORCH and explicit.draws_random(op) for g in graphs for op in g.ops
    )
    with popxl.Session(ir) as session:
        got = session.run(feed)
        slow = session.explain()
        fns = session._executor.fns
    traced = "; ".join(f"{k}: {fn.vmap_reason}" for k, fn in fns.items() if not fn.explicit)
    return [got[d].reshape(R, *tuple(d.shape)) for d in outs], (slow, traced), random


def _feed(streams, per_replica, extra=()):
    feed = {streams[i]: np.stack([v.numpy() for v in per_replica[i]]) for i in streams}
    feed.update(extra)
    return feed


def _simulate(op, leaves, spec, positions, per_replica):
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        streams, vals = _load_inputs(leaves, positions)
        outs = _store(pytree.tree_flatten(_call(op, vals, spec))[0])
    return _execute(ir, outs, _feed(streams, per_replica))


def _simulate_backward(op, leaves, spec, positions, per_replica, wrt):
    """The op in a subgraph, its gradient graph from ``popxl.transforms.autodiff`` (allowing
    in-place updates of values that carry no gradient, as ``popxl.compile`` does), called with
    per-replica seeds for the float outputs; the gradients of the inputs ``wrt``."""
    from torch_popxl.transforms.autodiff import ExpectedConnectionType

    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        streams, vals = _load_inputs(leaves, positions)

        def forward(*tensors):
            inner = list(vals)
            for i, t in zip(positions, tensors, strict=True):
                inner[i] = t
            out = pytree.tree_flatten(_call(op, inner, spec))[0]
            return tuple(o for o in out if o.dtype.is_floating_point)

        fwd = ir.create_graph(forward, *[vals[i] for i in positions])
        required = [fwd.inputs[positions.index(i)] for i in wrt]
        bwd = popxl.transforms.autodiff(fwd, grads_required=required, _allow_modifying=True)
        info = ops.call_with_info(fwd, *[vals[i] for i in positions])
        connect = bwd.inputs_dict(info)
        extra = {}  # seed stream -> per-replica seeds (eager's, for the same output)
        for grad_in, expected in zip(bwd.graph.inputs, bwd.expected_inputs, strict=True):
            if expected.connection_type is ExpectedConnectionType.FwdGrad:
                o = expected.fwd_tensor
                stream = popxl.h2d_stream(o.shape, o.dtype, f"seed{len(extra)}")
                like = torch.empty(o.shape, dtype=o.dtype.as_torch())
                extra[stream] = np.stack([_seed(like, r).numpy() for r in range(R)])
                connect[grad_in] = ops.host_load(stream)
        grads = ops.call(bwd.graph, inputs_dict=connect)
        outs = _store(grads if isinstance(grads, (list, tuple)) else [grads])
    return _execute(ir, outs, _feed(streams, per_replica, extra))


def sweep(ops_filter=None, backward: bool = False) -> list[Outcome]:
    """Every OpInfo op's first samples (forward, or gradients of the float inputs)."""
    from torch.testing._internal.common_methods_invocations import op_db

    results = []
    for op in op_db:
        if ops_filter is not None and not ops_filter(op):
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        if backward and not op.supports_autograd:
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
        except Exception:  # noqa: BLE001 - a broken sample generator is torch's, not ours
            continue
        for k, sample in enumerate(samples[:SAMPLES_PER_OP]):
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                o = _run_case(op, sample, backward)
            results.append(Outcome(o.op, k, o.kind, o.detail, o.traced))
    return results


def summary(results: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in results:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    return counts


if __name__ == "__main__":
    res = sweep(backward="--backward" in sys.argv)
    print(summary(res), "ops:", len({o.op for o in res}))
    for o in res:
        if o.kind not in ("pass", "skip") or "-v" in sys.argv:
            print(f"{o.kind:6} {o.op}[{o.sample}]: {o.detail}")
    traced = [o for o in res if o.traced]
    print(f"{len(traced)} cases with a fragment not explicitly batched:")
    for o in traced:
        print(f"  {o.op}[{o.sample}]: {o.traced}")
