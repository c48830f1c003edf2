"""``popxl.compile``'s captured optimizer step: any ``torch.optim.Optimizer`` whose ``step()``
needs no closure, run as torch runs it (Note [captured optimizer steps]).

Note [captured optimizer steps]
    SGD, Adam and AdamW keep their hand-written updates (bit for bit as torch's single-tensor
    path: Note [optimizer arithmetic as torch rounds it] in compile.py). Every other optimizer
    (Adadelta, Adagrad, Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop, a user's subclass written
    in torch ops) is captured: a shallow copy of the user's optimizer (its class, defaults and
    attributes; no hooks) is given one param group holding the graph's parameter (or this
    replica's shard of it), its reduced gradient as ``.grad`` and an ``optimizer.state`` entry
    holding the program's state variables, and its own ``step()`` runs under capture. So torch
    enumerates the optimizers and writes the formulas.

    * State: what the optimizer keeps per parameter is found once, on the host, by a probe step
      of a copy of the parameter (a zero gradient) that records every state entry as it is
      first set, which gives its initial value (Adagrad's ``initial_accumulator_value``,
      Rprop's step sizes). An entry of the parameter's shape is a state variable placed as
      SGD/Adam state is (sharded with RTS, remote or on chip); a scalar one (ASGD's ``eta``,
      NAdam's ``mu_product``) is a small on-chip variable; a 0-dim ``step`` is the program's
      step count. Anything else (Adafactor's factored rows and columns, Python numbers) is
      refused with an error. A second probe with another parameter and gradient finds state
      made from them in the first step (SGD's momentum buffer, a clone of the first
      gradient): for such an optimizer the program runs both torch's first step (empty
      state) and its later step and keeps the first where the step count is 0.
    * Hyperparameters: ``lr`` is read at run time from ``hyper/i`` (float64, as torch's Python
      float), so LR schedulers need no rebuild; the other values of a group are structure
      (they pick torch's code paths: ``if weight_decay != 0``, ``centered``): changing one
      rebuilds the program and carries the state over. A tensor-valued ``alpha=`` / ``value=``
      (``param.add_(delta, alpha=-lr)``) runs torch's own kernel with the number read at run
      time (``opdefs/scalar_tensor.py``), so the rounding is eager's.
    * The step count: torch's ``_get_value(step)`` calls ``.item()`` unless capturable; under
      capture it gives the step as a float64 tensor, so ``1 - beta2 ** step`` is computed in
      double as eager computes it in Python. An optimizer whose step branches on such a value
      (RAdam's ``rho_t > 5``, ASGD's ``mu != 1``) is found by a trial capture and then runs
      its ``capturable=True`` path (tensor arithmetic, ``torch.where``); its scalars then
      round differently from eager's Python floats (relative differences of ~1e-7).
    * Sharding: the probe watches the ops of the step. An update that reduces over the whole
      parameter (a norm, a sum, a matmul) cannot run on a shard without the other shards'
      partial results, so such an optimizer is refused with RTS (``rts_threshold``) on a
      parameter it would shard; elementwise updates run on shards as SGD/Adam do.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .capture import call_torch
from .dtypes import dtype as _dtype
from .errors import DataDependentError
from .ir.ir import Ir
from .ir.tensor import graph_input
from .opdefs import scalar_tensor as _scalar_ops

__all__ = ["StateLayout", "probe", "torch_step"]

aten = torch.ops.aten

# aten ops that combine the elements of a tensor (an update using one on a parameter-sized
# tensor cannot run on a shard alone)
_REDUCTIONS = {
    aten.sum, aten.mean, aten.norm, aten.linalg_vector_norm, aten.amax, aten.amin, aten.max,
    aten.min, aten.prod, aten.std, aten.var, aten.var_mean, aten.std_mean, aten.dot, aten.vdot,
    aten.mm, aten.mv, aten.bmm, aten.addmm, aten.matmul, aten.cumsum, aten.sort, aten.topk,
    aten.median, aten.kthvalue, aten.any, aten.all, aten.argmax, aten.argmin, aten.logsumexp,
    aten._linalg_svd, aten.linalg_qr,
}  # fmt: skip


@dataclass(frozen=True)
class StateLayout:
    """What a captured optimizer keeps for one param group (part of the program's structure)."""

    cls: type
    param_state: tuple[str, ...]  # entries of the parameter's shape
    scalar_state: tuple[str, ...]  # 0-dim entries other than ``step``
    has_step: bool
    hyper: tuple  # the group's values other than params and lr, frozen
    capturable: bool  # runs torch's capturable=True path (Note [captured optimizer steps])
    reduces: str | None  # the first reduction op the step runs on a parameter-sized tensor
    # an entry's initial value depends on the gradient or the parameter (made in the first
    # step, as SGD's momentum buffer): the first step runs torch's own initialisation
    lazy: bool = False


def _frozen(v):
    if isinstance(v, torch.Tensor):
        return float(v) if v.numel() == 1 else repr(v)
    if isinstance(v, list | tuple):
        return tuple(_frozen(x) for x in v)
    try:
        hash(v)
    except TypeError:
        return repr(v)
    return v


def shadow(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` to run its ``step()`` on other tensors: its class,
    defaults and attributes, no param groups, state or hooks."""
    out = copy.copy(optimizer)
    out.__dict__.pop("step", None)  # an LR scheduler's wrapper bound to the original
    out._optimizer_step_pre_hooks = collections.OrderedDict()
    out._optimizer_step_post_hooks = collections.OrderedDict()
    out.param_groups = []
    out.state = collections.defaultdict(dict)
    return out


class _InitLog(dict):
    """An ``optimizer.state[p]`` entry that remembers each value as it was first set."""

    def __init__(self):
        super().__init__()
        self.initial: dict = {}

    def __setitem__(self, key, value):
        if key not in self.initial:
            self.initial[key] = value.clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)


class _ReductionSpy(TorchDispatchMode):
    def __init__(self, numel: int):
        super().__init__()
        self.numel = numel
        self.found: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        if (
            self.found is None
            and packet in _REDUCTIONS
            and func._overloadname not in ("other", "out", "dim_max", "dim_min")
            and self.numel > 1
            and any(isinstance(a, torch.Tensor) and a.numel() > 1 for a in args)
        ):
            self.found = str(func)
        return func(*args, **kwargs)


def _run_step(opt: torch.optim.Optimizer) -> None:
    # the class's step, not an instance attribute (an LR scheduler's wrapper)
    with torch.no_grad():
        type(opt).step(opt)


def probe(optimizer, group: dict, p: torch.Tensor) -> tuple[StateLayout, dict]:
    """The state ``optimizer`` keeps for ``p`` in ``group`` and its initial values, from one
    eager step of a copy of ``p`` with a zero gradient (Note [captured optimizer steps])."""
    values = {k: v for k, v in group.items() if k != "params"}
    for k, v in (("foreach", False), ("fused", None), ("differentiable", False)):
        if k in values:
            values[k] = v
    if "capturable" in values:
        values["capturable"] = False
    initial, reduces = _probe_step(optimizer, values, p.detach().clone(), 0.0)
    # a second probe with another parameter and gradient: does the initial state depend on
    # them (state made from the first gradient)?
    other, _ = _probe_step(optimizer, values, p.detach() + 1.0, 1.0)
    lazy = initial.keys() != other.keys() or any(
        isinstance(v, torch.Tensor) and not torch.equal(v, other[k]) for k, v in initial.items()
    )
    param_state, scalar_state, has_step, init = [], [], False, {}
    for k, v in initial.items():
        if k == "step" and isinstance(v, torch.Tensor) and v.dim() == 0:
            has_step = True
        elif isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape):
            param_state.append(k)
            init[k] = v
        elif isinstance(v, torch.Tensor) and v.dim() == 0:
            scalar_state.append(k)
            init[k] = v
        else:
            what = f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise TypeError(
                f"popxl.compile: {type(optimizer).__name__} keeps optimizer state {k!r} of "
                f"{what} for a parameter of shape {tuple(p.shape)}; the compiled step keeps "
                "state of the parameter's shape and 0-dim tensors only."
            )
    hyper = tuple(sorted((k, _frozen(v)) for k, v in values.items() if k != "lr"))
    layout = StateLayout(type(optimizer), tuple(param_state), tuple(scalar_state), has_step,
                         hyper, False, reduces, lazy)  # fmt: skip
    return layout, init


def _probe_step(optimizer, values: dict, q: torch.Tensor, grad: float) -> tuple[dict, str | None]:
    """One eager step on ``q`` with a constant gradient: the state entries as first set, and
    the first reduction over a parameter-sized tensor (or None)."""
    opt = shadow(optimizer)
    q.grad = torch.full_like(q, grad)
    opt.param_groups = [dict(values, params=[q])]
    log = _InitLog()
    opt.state = collections.defaultdict(dict, {q: log})
    spy = _ReductionSpy(q.numel())
    try:
        with spy:
            _run_step(opt)
    except Exception as e:
        raise TypeError(
            f"popxl.compile: a probe step of {type(optimizer).__name__} (no closure, a "
            f"constant gradient) failed: {type(e).__name__}: {e}. popxl.compile runs an "
            "optimizer's step() without a closure."
        ) from e
    return log.initial, spy.found


# ---- the step under capture ---------------------------------------------------------------


class _TensorScalars(TorchFunctionMode):
    """``t.add_(x, alpha=a)``, ``t.addcdiv_(x, y, value=v)``, ``t.addcmul_(...)`` with a
    tensor ``a`` / ``v`` (a run-time hyperparameter) run torch's kernel with the number read
    at run time (``opdefs/scalar_tensor.py``) instead of calling ``.item()``; ``out=t``
    becomes ``t.copy_(...)`` and ``t[mask] = number`` a ``torch.where`` (the replicas' vmap has
    no rule for out= ops or boolean-mask indexing)."""

    _OPS = {"add_": "alpha", "sub_": "alpha", "add": "alpha", "sub": "alpha",
            "addcdiv_": "value", "addcmul_": "value", "addcdiv": "value", "addcmul": "value"}  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        out = kwargs.pop("out", None)
        if isinstance(out, torch.Tensor):  # vmap (the replicas) has no rule for out= ops
            return out.copy_(func(*args, **kwargs))
        if out is not None:
            kwargs["out"] = out
        if name == "__setitem__" and _is_mask(args[1]) and not isinstance(args[2], torch.Tensor):
            # ``t[mask] = 0`` (Rprop): vmap has no rule for boolean-mask indexing
            t, mask, value = args
            t.copy_(torch.where(mask, value, t))
            return None
        key = self._OPS.get(name)
        s = kwargs.get(key) if key else None
        if not isinstance(s, torch.Tensor) or kwargs.keys() - {key}:
            if name in _ARITHMETIC and len(args) == 2:
                args = _as_python_float(*args)
            return func(*args, **kwargs)
        target = args[0] if name.endswith("_") else args[0].clone()
        if name.startswith("sub"):
            s = -s
        if key == "alpha":
            _scalar_ops.add_alpha_(target, args[1], s)
        elif name.startswith("addcdiv"):
            _scalar_ops.addcdiv_value_(target, args[1], args[2], s)
        else:
            _scalar_ops.addcmul_value_(target, args[1], args[2], s)
        return target


_ARITHMETIC = {f"{pre}{op}{post}" for op in ("add", "sub", "mul", "div", "truediv")
               for pre, post in (("", ""), ("", "_"), ("__", "__"), ("__r", "__"), ("__i", "__"))}  # fmt: skip
_HALF_OR_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def _as_python_float(a, b):
    """A 0-dim float64 tensor (a hyperparameter or a value derived from the step count, a
    Python float in eager torch) with a float32/16-bit tensor: as float32, which is what torch
    computes with for a Python float; a 0-dim float64 tensor would promote a 0-dim float32
    one to float64 (NAdam's ``mu_product *= mu``)."""

    def scalar(x):
        return isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype == torch.float64

    def low(x):
        return isinstance(x, torch.Tensor) and x.dtype in _HALF_OR_FLOAT

    if scalar(a) and low(b):
        return a.float(), b
    if scalar(b) and low(a):
        return a, b.float()
    return a, b


def _is_mask(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bool


def _tensor_value(x):
    # torch.optim's _get_value without .item(): the value as a float64 tensor (torch's
    # Python floats are doubles)
    return x.double() if isinstance(x, torch.Tensor) else x


def _with_cpu(orig):
    def devices(*args, **kwargs):
        return [*orig(*args, **kwargs), "cpu"]

    return devices


@contextlib.contextmanager
def _captured_helpers(capturable: bool):
    """torch.optim's ``_get_value`` keeps tensors; a capturable step passes torch's device
    check (the captured tensors are fake CPU tensors)."""
    patches = {"_get_value": lambda orig: _tensor_value}
    if capturable:
        patches["_get_capturable_supported_devices"] = _with_cpu
    saved = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torch.optim") or mod is None:
            continue
        for attr, patch in patches.items():
            if hasattr(mod, attr):
                orig = getattr(mod, attr)
                saved.append((mod, attr, orig))
                setattr(mod, attr, patch(orig))
    try:
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def _step(p, g, step, hyper, *state, opt, layout: StateLayout, capturable: bool):
    """One step of ``opt`` on ``p`` (a parameter or a shard) with gradient ``g`` and the state
    tensors ``state`` (param-shaped entries, then scalar ones), in place."""
    names = layout.param_state + layout.scalar_state
    if not layout.lazy:
        entry = dict(zip(names, state, strict=True))
        if layout.has_step:
            entry["step"] = step.clone()
        _step_with(p, g, hyper, entry, opt, layout, capturable)
        return
    # The first step makes the state as torch does (from the gradient); later ones update it.
    p0, p1 = p.clone(), p.clone()
    first: dict = {}
    _step_with(p0, g, hyper, first, opt, layout, capturable)
    later = {k: t.clone() for k, t in zip(names, state, strict=True)}
    if layout.has_step:
        later["step"] = step.clone()
    _step_with(p1, g, hyper, later, opt, layout, capturable)
    is_first = step == 0
    for t, a, b in zip((p, *state), (p0, *[first[k] for k in names]),
                       (p1, *[later[k] for k in names]), strict=True):  # fmt: skip
        t.copy_(torch.where(is_first, a, b))


def _step_with(p, g, hyper, entry: dict, opt, layout: StateLayout, capturable: bool) -> None:
    group = dict(layout.hyper, params=[p], lr=hyper[0])
    if capturable:
        group["capturable"] = True
    opt.param_groups = [group]
    opt.state = collections.defaultdict(dict, {p: entry})
    p.grad = g
    try:
        with _captured_helpers(capturable), _TensorScalars():
            _run_step(opt)
    finally:
        p.grad = None
        opt.param_groups, opt.state = [], collections.defaultdict(dict)


def _skippable_step(p, g, step, hyper, found, *state, opt, layout, capturable):
    """The step, undone where ``found`` says the gradients overflowed (Note [loss scaling])."""
    old = [t.clone() for t in (p, *state)]
    _step(p, g, step, hyper, *state, opt=opt, layout=layout, capturable=capturable)
    for t, o in zip((p, *state), old, strict=True):
        t.copy_(torch.where(found > 0, o, t))


def needs_capturable(opt, layout: StateLayout, p: torch.Tensor, init: dict) -> bool:
    """Whether the non-capturable step branches on a tensor value (a trial capture)."""
    if not any(k == "capturable" for k, _ in layout.hyper):
        return False
    ir = Ir()
    graph = ir.create_empty_graph("optimizer_probe")

    def inp(t, name):
        return graph_input(tuple(t.shape), _dtype.as_dtype(t.dtype), name)

    with graph:
        args = [inp(p, "p"), inp(p, "g"), inp(torch.zeros(()), "step"),
                inp(torch.zeros(5, dtype=torch.float64), "hyper")]  # fmt: skip
        args += [inp(init[k], k) for k in layout.param_state + layout.scalar_state]
        try:
            call_torch(_step, tuple(args), {"opt": opt, "layout": layout, "capturable": False})
        except DataDependentError:
            return True
    return False


def torch_step(p, g, step, hyper, state, *, opt, layout: StateLayout, found=None) -> None:
    """Record ``opt``'s step on graph tensors (Note [captured optimizer steps])."""
    kwargs = {"opt": opt, "layout": layout, "capturable": layout.capturable}
    if found is not None:
        call_torch(_skippable_step, (p, g, step, hyper, found, *state), kwargs)
    else:
        call_torch(_step, (p, g, step, hyper, *state), kwargs)


_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_probe(optimizer, group: dict, p: torch.Tensor) -> tuple[StateLayout, dict]:
    """``probe`` (with the capturable decision), cached per optimizer, parameter and group
    values."""
    cache = _PROBES.setdefault(optimizer, {})
    values = tuple(sorted((k, _frozen(v)) for k, v in group.items() if k not in ("params", "lr")))
    key = (id(p), tuple(p.shape), p.dtype, values)
    hit = cache.get(key)
    if hit is None:
        layout, init = probe(optimizer, group, p)
        if needs_capturable(shadow(optimizer), layout, p, init):
            layout = dataclasses.replace(layout, capturable=True)
        hit = cache[key] = (layout, init)
    return hit
