"""Explicit batching: replicated programs without ``vmap`` when every op allows it.

Note [explicit batching]
    Under ``torch.func.vmap`` every op pays a dispatch cost (tens of µs) on top of its maths,
    which dominates small replicated programs. The compiler already knows, statically, which
    values are batched (one row per replica, ``[R, *shape]``) and which are replica-invariant
    (stored once). For a small, common set of ops the stacked form is a direct rewrite —
    elementwise ops broadcast correctly when every batched input has the same per-replica
    rank and no unbatched input has a larger one; ``mm`` becomes ``matmul``/``bmm``; ops
    taking a ``dim`` shift it past the replica dimension. A ``torch_popxl`` op brings its own
    rule: its definition's ``explicit`` rule (``opdefs/registry.py``) says whether it has a
    stacked form for the given batched inputs and returns the callable that runs it (a
    full-group all-reduce is one call of the stacked kernel). When every op of a fragment has such a rule the fragment is emitted in
    this form and runs on the physical stacked tensors with no ``vmap``; otherwise the whole
    fragment runs under ``vmap`` as before. The reference executor checks both.
"""

from __future__ import annotations

import torch

from .. import opdefs
from ..ir.graph import Op, Slot

__all__ = ["batchable", "emit_torch", "is_random"]

aten = torch.ops.aten
_DEBUG = False

_ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar,
    aten.mul.Scalar, aten.neg.default, aten.log.default, aten.exp.default, aten.sqrt.default,
    aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.gelu.default,
    aten.gelu_backward.default, aten.threshold_backward.default, aten.where.self,
    aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor, aten.mul_.Scalar,
    aten.div_.Scalar, aten.clone.default, aten._to_copy.default, aten.pow.Tensor_Scalar,
    aten.rsub.Scalar, aten.reciprocal.default, aten.zero_.default, aten.eq.Scalar, aten.ne.Scalar,
}  # fmt: skip
# ops whose argument 1 is a single dim of the (per-replica) input
_DIM1 = {aten._softmax.default, aten._log_softmax.default, aten.unsqueeze.default,
         aten.gather.default, aten.scatter_add.default}  # fmt: skip
_SUMS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.dim, aten.amax.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_FLAT_KINDS = {
    "clone",
    "alias",
    "host_load",
    "host_store",
    "mm_all_reduce",
    "mm_replica_sum",
    "loop",
}


def is_random(target) -> bool:
    """Whether ``target`` draws random numbers. torch tags every such aten overload
    ``nondeterministic_seeded``, including those without a ``Generator`` argument
    (``rand_like``, ``randn_like``, ``randint_like``); PopXL replicas draw independently."""
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def _ok_torch(f, a, R: int) -> bool:
    target = f.op.attrs.target
    if f in a.sum_adds or f in a.sum_reads:
        return False
    if is_random(target):
        # Each replica draws its own values (vmap's randomness="different"); the stacked form
        # has no rule for that, so a fragment with a random op runs under vmap.
        return False
    batched = [a.b(n) for n in f.ins]
    if not any(batched):
        return getattr(target, "namespace", "") == "aten"  # unbatched: runs as is
    if target in _ELEMENTWISE:
        ranks_b = {t.rank for t, b in zip(f.op.inputs, batched, strict=True) if b}
        ranks_u = [t.rank for t, b in zip(f.op.inputs, batched, strict=True) if not b]
        return len(ranks_b) == 1 and all(r <= min(ranks_b) for r in ranks_u)
    if target is aten.mm.default or target in _VIEWS or target in _SUMS:
        return True
    if target is aten.t.default:
        return f.op.inputs[0].rank == 2
    if target is aten.permute.default:
        return True
    if target in _DIM1 or target is aten._softmax_backward_data.default:
        return True
    return _opdef_rule(f.op, batched, R) is not None


def _opdef_rule(op: Op, batched: list[bool], R: int):
    """The stacked form of a ``torch_popxl`` op from its definition, or None."""
    opdef = opdefs.lookup(op)
    return None if opdef is None else opdef.rule("explicit")(op, batched, R)


def batchable(flat, analysis, R: int) -> bool:
    """Whether every op of ``flat`` has an explicit-batching rule (Note [explicit batching])."""
    for f in flat:
        if f.kind == "torch":
            if not _ok_torch(f, analysis, R):
                if _DEBUG:
                    print("explicit batching: no rule for", f.op.attrs.target)
                return False
        elif f.kind not in _FLAT_KINDS:
            return False
        if f.kind == "loop" and not batchable(f.body, analysis, R):
            return False
    return True


def _shift(d: int) -> int:
    return d + 1 if d >= 0 else d


def emit_torch(em, f, ind: str) -> None:
    """Emit ``f`` on stacked tensors (the caller checked ``batchable``)."""
    target = f.op.attrs.target
    args = list(f.op.attrs.args)
    kwargs = dict(f.op.attrs.kwargs)
    a = em.a
    batched = [a.b(n) for n in f.ins]

    def lit(x):
        return em.literal(x, f)

    out = f.outs[0] if f.outs else None
    R = em.p.R
    stacked_form = _opdef_rule(f.op, batched, R) if any(batched) else None
    if stacked_form is not None:  # the op's own rule (batchable() checked it has one)
        call_args = [lit(v) for v in args] + [f"{k}={lit(v)}" for k, v in kwargs.items()]
        em.lines.append(f"{ind}{out} = {em.p.literal(stacked_form)}({', '.join(call_args)})")
        return
    if not any(batched) or target in _ELEMENTWISE:
        em._torch_plain(f, ind)
        return
    x = lit(args[0])
    if target is aten.mm.default:
        fn = "torch.bmm" if all(batched) else "torch.matmul"
        em.lines.append(f"{ind}{out} = {fn}({x}, {lit(args[1])})")
    elif target is aten.t.default:
        em.lines.append(f"{ind}{out} = {x}.transpose(-1, -2)")
    elif target is aten.permute.default:
        rank = f.op.inputs[0].rank
        perm = [0] + [(d % rank) + 1 for d in args[1]]
        em.lines.append(f"{ind}{out} = {x}.permute({perm!r})")
    elif target in _VIEWS:
        em.lines.append(f"{ind}{out} = STACKED_VIEW({x}, {lit(args[1])}, {R})")
    elif target in _SUMS:
        per_replica_dims = f.op.inputs[0].rank
        dims = args[1] if len(args) > 1 else kwargs.pop("dim", None)
        if dims is None or dims == [] or target is aten.sum.default:
            dims = list(range(per_replica_dims))
        dims = [_shift(d % per_replica_dims) for d in dims]
        keep = args[2] if len(args) > 2 else kwargs.pop("keepdim", False)
        extra = "".join(f", {k}={lit(v)}" for k, v in kwargs.items())
        fn = {aten.amax.default: "torch.amax", aten.mean.dim: "torch.mean"}.get(target, "torch.sum")
        em.lines.append(f"{ind}{out} = {fn}({x}, {tuple(dims)!r}, keepdim={keep!r}{extra})")
    elif target in _DIM1 or target is aten._softmax_backward_data.default:
        # every tensor argument must be stacked; the dim moves past the replica dim
        rendered = []
        for v in args:
            s = lit(v)
            if isinstance(v, Slot) and not a.b(f.ins[v.index]):
                s = f"{s}.expand({R}, *{s}.shape)"
            rendered.append(s)
        dim_pos = 2 if target is aten._softmax_backward_data.default else 1
        rendered[dim_pos] = repr(_shift(args[dim_pos]))
        rendered += [f"{k}={lit(v)}" for k, v in kwargs.items()]
        em.lines.append(f"{ind}{out} = {em.p.literal(target._op)}({', '.join(rendered)})")
    else:  # pragma: no cover - batchable() admits nothing else
        raise AssertionError(f"no explicit rule for {target}")
