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


def _run_case(op, sample) -> Outcome:
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    why = _unsupported(op, sample)
    if why is not None:
        return Outcome(name, 0, "skip", why)
    leaves, spec = _leaves(sample)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    per_replica = {i: [_replica_data(leaves[i], r) for r in range(R)] for i in positions}

    def eager(r: int):
        vals = list(leaves)
        for i in positions:
            vals[i] = per_replica[i][r].clone()
        inp, args, kwargs = pytree.tree_unflatten(vals, spec)
        return op.op(inp, *args, **kwargs)

    try:
        want = [eager(r) for r in range(R)]
    except Exception as e:  # noqa: BLE001 - the replica-1 data left the op's domain
        return Outcome(name, 0, "skip", f"eager torch raises on replica data: {type(e).__name__}")
    out_leaves = [pytree.tree_flatten(w)[0] for w in want]
    if not all(isinstance(x, torch.Tensor) for x in out_leaves[0]) or not out_leaves[0]:
        return Outcome(name, 0, "skip", "an output that is not a tensor")
    if any(x.dtype not in _DTYPES or x.layout != torch.strided for x in out_leaves[0]):
        return Outcome(name, 0, "skip", "an output dtype or layout a stream does not carry")
    try:
        got, slow, random = _simulate(op, leaves, spec, positions, per_replica)
    except Exception as e:  # noqa: BLE001 - the sweep records every failure
        return Outcome(name, 0, "error", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    uninitialised = op.name in _UNINITIALISED
    for k in range(len(out_leaves[0])):
        for r in range(R):
            g, e = got[k][r], out_leaves[r][k].detach().numpy()
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
    return Outcome(name, 0, "slow" if slow else "pass", "; ".join(slow))


# ops whose outputs hold whatever memory they were given
_UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"}


def _simulate(op, leaves, spec, positions, per_replica):
    ir = popxl.Ir(replication=R)
    streams = {}
    with ir.main_graph:
        vals = list(leaves)
        for i in positions:
            t = leaves[i]
            s = popxl.h2d_stream(tuple(t.shape), _dt.dtype.as_dtype(t.dtype), f"in{i}")
            streams[i] = s
            vals[i] = ops.host_load(s)
        inp, args, kwargs = pytree.tree_unflatten(vals, spec)
        # as captured torch code: the op sees torch tensors (some OpInfo variants are unbound
        # torch.Tensor methods, which take nothing else)
        result = capture.call_torch(op.op, (inp, *args), kwargs)
        outs = []
        for y in pytree.tree_flatten(result)[0]:
            d = popxl.d2h_stream(y.shape, y.dtype)
            ops.host_store(d, y)
            outs.append(d)
    feed = {streams[i]: np.stack([v.numpy() for v in per_replica[i]]) for i in positions}
    # values drawn at random are compared by shape and dtype only (tests/test_random_replicas.py
    # checks their distributions)
    random = any(op.kind is OpKind.TORCH and explicit.draws_random(op) for op in ir.main_graph.ops)
    with popxl.Session(ir) as session:
        got = session.run(feed)
        slow = session.explain()
    return [got[d].reshape(R, *tuple(d.shape)) for d in outs], slow, random


def sweep(ops_filter=None) -> list[Outcome]:
    from torch.testing._internal.common_methods_invocations import op_db

    results = []
    for op in op_db:
        if ops_filter is not None and not ops_filter(op):
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
        except Exception:  # noqa: BLE001 - a broken sample generator is torch's, not ours
            continue
        for k, sample in enumerate(samples[:SAMPLES_PER_OP]):
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                o = _run_case(op, sample)
            results.append(Outcome(o.op, k, o.kind, o.detail))
    return results


def summary(results: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in results:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    return counts


if __name__ == "__main__":
    res = sweep()
    print(summary(res), "ops:", len({o.op for o in res}))
    for o in res:
        if o.kind not in ("pass", "skip") or "-v" in sys.argv:
            print(f"{o.kind:6} {o.op}[{o.sample}]: {o.detail}")
