"""A training batch that does not split over the replicas: padded rows that add nothing.

Note [padded rows]
    A DataLoader without ``drop_last`` ends an epoch with a short batch, 1001 samples at batch
    size 64 end with 41, which does not split into equal shares for R = 4 replicas (each
    replica runs the same program). Where the shares can be equal, fewer micro-batches run
    (Note [a short last batch] in compile.py); where they cannot, the batch is padded at its
    end to ``n' = R x GA' x micro`` rows, ``GA' = min(GA, ceil(n / R))`` and ``micro =
    ceil(n / (R x GA'))`` (41 on 4 x 4: 48 rows, micro-batches of 3; 3 on 4 x 4: 4 rows, one
    micro-batch of 1), with copies of its last row, and a boolean stream marks the real rows.
    The loss then reads only those: ``loss_fn(out[real], target[real])`` for every output and
    target with the micro-batch's rows, which is a selection by a mask (Note [rows selected by
    a mask] in compile_masked.py). So sums add the real rows only, means become counted means
    over the real rows' elements (added up over micro-batches exactly: Note [exact losses over
    micro-batches] in compile_loss.py), a cross entropy's unselected rows get its
    ``ignore_index``, a sum divided by the micro-batch's rows (``kl_div``'s ``batchmean``:
    Note [a sum divided by the batch's size]) counts the real rows, and padded rows get no
    gradient (a micro-batch of padding only adds nothing). The outputs returned to the user
    are the real rows'. Under torchrun each process passes its own share, which must still
    split over its replicas (padding one process's share would need the others' counts).

    That is eager's step only while the forward keeps rows independent: a row's outputs, and
    the module's buffers, must not depend on the other rows of its micro-batch (BatchNorm in
    training mode normalises over them and folds them into its running statistics; a forward
    that returns ``x.mean()`` reduces over them). Which ops mix rows is left to torch to say:
    before the program is built, ``check_rows_independent`` runs the forward eagerly on one
    micro-batch of real and padded rows twice, the padded rows' values different (floats
    scaled and shifted, integers copied from another real row) under the same random seed,
    and compares the real rows' outputs and the buffers bit for bit. Where they differ, the
    two runs are compared op by op: the first op whose output differs in a larger share of its
    elements than any of its inputs does is the one that mixes rows, named in the error with
    its module. Refused before anything changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .compile_common import _attributes_restored

__all__ = ["OnRealRows", "check_rows_independent", "padded_split", "real_rows"]


def padded_split(n: int, R: int, GA: int) -> tuple[int, int]:
    """(rows after padding, micro-batches per replica) for ``n`` samples on ``R`` replicas
    with ``GA`` micro-batches each (Note [padded rows])."""
    ga = min(GA, -(-n // R))
    micro = -(-n // (R * ga))
    return R * ga * micro, ga


def _select(x, real: torch.Tensor):
    if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == real.shape[0]:
        return x[real]
    return x


class OnRealRows:
    """``loss_fn`` on the real rows of the outputs and targets (Note [padded rows]): called
    with ``(targets, real)``, ``real`` a boolean row mask."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn = loss_fn

    def __call__(self, out, targets_and_real: tuple) -> torch.Tensor:
        targets, real = targets_and_real
        return self.loss_fn(
            pytree.tree_map(lambda x: _select(x, real), out),
            pytree.tree_map(lambda x: _select(x, real), targets),
        )


def real_rows(loss_fn: Callable, targets) -> torch.Tensor | None:
    """The real rows' mask where ``loss_fn`` reads the real rows only, else None."""
    return targets[1] if isinstance(loss_fn, OnRealRows) else None


# ---- which ops mix rows ---------------------------------------------------------------------


def _probe_rows(arrays: list[np.ndarray], micro: int, n_real: int) -> tuple[list, list, int]:
    """One micro-batch of real rows then padded ones, twice: the padded rows' values differ
    between the two (floats scaled and shifted, integers from another real row); and how many
    rows are real."""
    k = min(micro - 1, n_real)  # (micro 1: padding only; then only buffers can tell)
    a_rows, b_rows = [], []
    for a in arrays:
        t = torch.from_numpy(np.ascontiguousarray(a[:n_real]))
        real = t[:k]
        pad = t[n_real - 1 :].expand(micro - k, *t.shape[1:])
        if t.dtype.is_floating_point:
            other = pad * 2 + 1
        else:
            other = t[:1].expand(micro - k, *t.shape[1:])
        a_rows.append(torch.cat([real, pad]).contiguous())
        b_rows.append(torch.cat([real, other]).contiguous())
    return a_rows, b_rows, k


def _same(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Elementwise: the two runs agree (NaN where both are NaN)."""
    x, y = x.detach(), y.detach()
    eq = x == y
    return eq | (torch.isnan(x) & torch.isnan(y)) if x.is_floating_point() else eq


def _differs(x, y, rows: tuple[int, int] | None) -> bool:
    """Whether two runs' values of an output (its first ``rows[0]`` rows where it has
    ``rows[1]``) or of a buffer differ."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return False
    if rows is not None and x.ndim > 0 and x.shape[0] == rows[1]:
        x, y = x[: rows[0]], y[: rows[0]]
    return x.shape != y.shape or not bool(_same(x, y).all())


def _share(x: torch.Tensor, y: torch.Tensor) -> float:
    """The share of elements that differ between two runs' values of one tensor."""
    if x.shape != y.shape or x.numel() == 0:
        return 0.0
    return 1.0 - float(_same(x, y).sum()) / x.numel()


class _Ops(TorchDispatchMode):
    """Records every op's outputs (first run), or compares them with the first run's and
    finds the first op that spreads a difference over more of its output than its inputs
    held (second run)."""

    def __init__(self, where: Callable[[], str], first: list | None, shares: dict[int, float]):
        super().__init__()
        self._where = where
        self._first = first
        self.seen: list = []
        self._shares = shares  # id(tensor) -> the share of its elements that differ
        self._keep: list = []
        self.mixing: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        i = len(self.seen)
        self.seen.append([o.detach().clone() for o in outs])
        if self._first is None or self.mixing is not None or i >= len(self._first):
            return out
        ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        before = max((self._shares.get(id(a), 0.0) for a in ins), default=0.0)
        shares = [_share(o, p) for o, p in zip(outs, self._first[i], strict=False)]
        for o, s in zip(outs, shares, strict=False):
            self._keep.append(o)
            self._shares[id(o)] = s
        if shares and max(shares) > before + 1e-9:
            self.mixing = f"{func} in {self._where()}"
        return out


@contextlib.contextmanager
def _module_path(model: torch.nn.Module) -> Iterator[Callable[[], str]]:
    """The innermost module running (its name in ``model`` and class), while inside."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []

    def pre(module, _args):
        if id(module) in names:
            name = names[id(module)]
            stack.append(f"module {name!r} ({type(module).__name__})" if name else
                         f"the model's forward ({type(module).__name__})")  # fmt: skip

    def post(module, _args, _out):
        if id(module) in names and stack:
            stack.pop()

    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(pre),
        torch.nn.modules.module.register_module_forward_hook(post),
    ]
    try:
        yield lambda: stack[-1] if stack else "the model's forward"
    finally:
        for h in hooks:
            h.remove()


def _run(model, params, buffers, inputs: tuple, seed: int, mode=None):
    """The forward in eager torch on copies of the module's tensors, ``inputs`` its ``(args,
    kwargs)``: (outputs, buffers)."""
    args, kwargs = inputs
    tensors = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    bufs = {n: b.detach().clone() for n, b in buffers.items()}
    with (torch.random.fork_rng(devices=[]), _attributes_restored(model),
          mode if mode is not None else contextlib.nullcontext()):  # fmt: skip
        torch.manual_seed(seed)
        out = torch.func.functional_call(model, {**tensors, **bufs}, args, kwargs)
    return out, bufs


def check_rows_independent(
    model: torch.nn.Module,
    arrays: list[np.ndarray],
    rebuild: Callable,
    micro: int,
    n_real: int,
    refuse: Callable[[str], Exception],
) -> None:
    """Raises ``refuse(why)`` where padded rows would change the real rows' results or the
    module's buffers (Note [padded rows]). ``rebuild(tensors)`` gives ``(args, kwargs)``."""
    a_rows, b_rows, k = _probe_rows(arrays, micro, n_real)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    seed = int(torch.randint(0, 2**31 - 1, (), generator=torch.Generator().manual_seed(0)))
    try:
        out_a, buf_a = _run(model, params, buffers, rebuild(a_rows), seed)
        out_b, buf_b = _run(model, params, buffers, rebuild(b_rows), seed)
    except Exception as e:  # (it cannot be checked: refused rather than maybe wrong)
        raise refuse(f"the forward could not be run eagerly to check it ({type(e).__name__}: {e})"
                     ) from e  # fmt: skip
    rows = (k, micro)
    changed = [f"output{pytree.keystr(p)}"
               for (p, x), y in zip(pytree.tree_flatten_with_path(out_a)[0],
                                    pytree.tree_leaves(out_b), strict=False)
               if _differs(x, y, rows)]  # fmt: skip
    changed += [f"buffer {n!r}" for n in buf_a if _differs(buf_a[n], buf_b[n], None)]
    if not changed:
        return
    shares: dict[int, float] = {}
    with _module_path(model) as where:
        record = _Ops(where, None, shares)
        _run(model, params, buffers, rebuild(a_rows), seed, record)
        for x, y in zip(a_rows, b_rows, strict=True):
            shares[id(y)] = _share(x, y)
        compare = _Ops(where, record.seen, shares)
        _run(model, params, buffers, rebuild(b_rows), seed, compare)
    op = compare.mixing or "an op that moves rows across the batch"
    raise refuse(f"{op} mixes the rows of the batch: the padded rows change the real rows' "
                 f"{', '.join(changed[:3])}" + (", ..." if len(changed) > 3 else ""))  # fmt: skip
