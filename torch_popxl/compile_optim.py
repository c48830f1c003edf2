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
      step count; an entry of another shape (Adafactor's row and column variances of a
      matrix) is a whole variable, remote or on chip (Note [steps on whole parameters]). Each
      parameter has its own layout (Adafactor keeps ``variance`` for a vector, ``row_var`` and
      ``col_var`` for a matrix of the same group). State that is no tensor (a Python number)
      is refused with an error. A second probe with another parameter and gradient finds state
      made from them in the first step (SGD's momentum buffer, a clone of the first
      gradient): for such an optimizer the program runs both torch's first step (empty
      state) and its later step and keeps the first where the step count is 0.
    * Hyperparameters: ``lr`` is read at run time from ``hyper/i`` (float64, as torch's Python
      float), so LR schedulers need no rebuild. So are ``betas`` and ``momentum``, which
      OneCycleLR and CyclicLR cycle, where the step neither branches on them (a trial
      capture: RMSprop's ``if momentum > 0`` keeps momentum structure) nor rounds them
      otherwise than as Python floats (two host steps with them as tensors and as floats
      must agree bit for bit: torch's Adam casts a tensor beta1 to the parameter's dtype,
      so a captured Adam keeps its betas structure). The group's other values are structure
      (they pick torch's code paths: ``if weight_decay != 0``, ``centered``): changing one
      rebuilds the program and carries the state over. A tensor-valued ``alpha=`` /
      ``value=`` (``param.add_(delta, alpha=-lr)``) runs torch's own kernel with the number
      read at run time (``opdefs/scalar_tensor.py``), so the rounding is eager's.
    * ``foreach=True``: torch's multi-tensor step runs, each ``torch._foreach_*`` op as one
      op per tensor of its lists (``_per_tensor``), which is what torch's CPU kernels for
      them do, so it rounds as eager's foreach step (NAdam's and Adafactor's differ from
      their single-tensor steps by an ulp).
    * The step count: torch's ``_get_value(step)`` calls ``.item()`` unless capturable; under
      capture it gives the step as a float64 tensor, so ``1 - beta2 ** step`` is computed in
      double as eager computes it in Python. A step's own ``.item()`` (Adafactor's
      ``step_t.item()``, ``p.norm().item()``) likewise gives a float64 0-dim tensor, and
      ``min`` / ``max`` in torch.optim's modules and the optimizer class's module take such
      tensors (``min(lr, 1 / step ** 0.5)`` is ``clamp_max``) while the step is captured; a
      ``lerp_`` weight made from them runs in float32 as torch's Python-float weight does.
      Adafactor is so bit for bit at R=1. An optimizer whose step branches on such a value
      (RAdam's ``rho_t > 5``, ASGD's ``mu != 1``) is found by a trial capture and then runs
      its ``capturable=True`` path (tensor arithmetic, ``torch.where``); its scalars then
      round differently from eager's Python floats (relative differences of ~1e-7).
    * Sharding: the probe watches the ops of the step on a parameter-sized tensor. A full
      reduction (a norm, a sum, a mean, a max, a dot product: Note [whole-parameter
      reductions on shards]) runs on shards; elementwise updates run on shards as SGD/Adam
      do; any other op that mixes the elements of a parameter cannot run on a shard alone
      (Note [steps on whole parameters]).

Note [steps on whole parameters]
    A captured step that mixes a parameter's elements other than by a full reduction (a
    reduction over one dim, a matmul, sorting, indexing, a transpose: Adafactor's row and
    column means of a matrix, ``row_var @ col_var``) or keeps state of another shape than the
    parameter's cannot update a 1-D RTS shard: a shard holds a run of the flattened parameter,
    not whole rows or columns. Such a parameter is updated whole even where ``rts_threshold``
    would shard it: its gradient is all-reduced (not reduce-scattered) and its state is whole
    on every replica (remote or on chip as ``optimizer_state`` says), as at
    ``rts_threshold=None``; the other parameters of the model stay sharded. The slot's
    ``sharded`` flag and the memory report show which. (Gathering the shards for the step
    and slicing them again would move more and save nothing: the weights are whole on every
    replica here, and Adafactor's factored state is small: rows + columns.) The probe runs on
    the full parameter, so it sees the step a matrix takes (``p.dim() > 1``), never a shard's.
    Where a step does run on shards, ``numel()`` of a shard-shaped tensor is the parameter's
    element count (an RMS, ``p.norm() / p.numel() ** 0.5``, as Adafactor's vector update);
    ``p.shape`` stays the shard's.

Note [whole-parameter reductions on shards]
    LARS/LAMB-style updates scale a parameter's step by ``p.norm() / update.norm()``. Where RTS
    shards the parameter, each replica's step sees only its shard (1-D, ``ceil(n / G)``
    elements, the last shards zero-padded: popxl.md §4.5), so under capture a full reduction of
    a shard-shaped tensor (``aten.sum``, ``mean``, ``linalg_vector_norm``, ``norm``,
    ``amax``/``amin``/``max``/``min``, ``dot``/``vdot``) is rewritten as: the shard's partial
    result (a sum, a sum of ``|x|^ord``, a count of nonzeros, a max), padding elements replaced
    by the neutral value (padding is zero in the parameter, gradient and state, but an update
    computed from them need not be: ``p + 1``), one ``replicated_all_reduce`` over the
    sharding group, then the finish (``sqrt``, ``** (1 / ord)``, ``/ n`` with ``n`` the
    parameter's real element count). Which shard elements are padding comes from this replica's
    index in the group (a ``'local'`` reduce-scatter of ``arange(G)``); when the shards divide
    the parameter there is no padding and no mask. The result equals eager's up to float32
    summation order (the shards' partials are added in another order than torch's pairwise
    sum). The probe runs on the full parameter, so it decides which reductions are full
    (``dim`` None or every dim); a parameter whose step mixes its elements otherwise is
    updated whole (Note [steps on whole parameters]).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import sys
import weakref
from collections.abc import Callable
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

__all__ = ["Sharding", "StateLayout", "probe", "torch_step"]

aten = torch.ops.aten

# aten ops that combine the elements of a tensor (an update using one on a parameter-sized
# tensor cannot run on a shard alone, unless it is a full reduction of _WHOLE)
_REDUCTIONS = {
    aten.sum, aten.mean, aten.norm, aten.linalg_vector_norm, aten.amax, aten.amin, aten.max,
    aten.min, aten.prod, aten.std, aten.var, aten.var_mean, aten.std_mean, aten.dot, aten.vdot,
    aten.mm, aten.mv, aten.bmm, aten.addmm, aten.matmul, aten.cumsum, aten.sort, aten.topk,
    aten.median, aten.kthvalue, aten.any, aten.all, aten.argmax, aten.argmin, aten.logsumexp,
    aten._linalg_svd, aten.linalg_qr, aten.index, aten.index_select, aten.gather, aten.flip,
    aten.roll, aten.cumprod, aten.msort, aten.argsort,
}  # fmt: skip
N_HYPER = 5  # the values of a group's ``hyper/i`` variable (lr first)
# group values an LR scheduler may move besides lr (OneCycleLR and CyclicLR cycle SGD's
# momentum and Adam's beta1): read at run time where the step does not branch on them
_SCHEDULED = ("betas", "momentum")
# full reductions that run on shards (Note [whole-parameter reductions on shards])
_WHOLE = {aten.sum, aten.mean, aten.norm, aten.linalg_vector_norm, aten.amax, aten.amin,
          aten.max, aten.min, aten.dot, aten.vdot}  # fmt: skip
# where each op takes its ``dim`` (positional index), for the full-reduction test
_DIM_ARG = {aten.sum: 1, aten.mean: 1, aten.amax: 1, aten.amin: 1, aten.linalg_vector_norm: 2,
            aten.norm: 2}  # fmt: skip


def _is_whole(func, args, kwargs, ndim: int) -> bool:
    """Whether ``func`` reduces its first argument (of ``ndim`` dims) to one value."""
    packet = func.overloadpacket
    if packet not in _WHOLE:
        return False
    if packet in (aten.max, aten.min):
        return func._overloadname == "default"
    if packet in (aten.dot, aten.vdot):
        return True
    i = _DIM_ARG[packet]
    dim = args[i] if len(args) > i else kwargs.get("dim")
    if dim is None:
        return True
    dims = [dim] if isinstance(dim, int) else list(dim)
    return not dims or {d % max(ndim, 1) for d in dims} == set(range(ndim))


@dataclass(frozen=True)
class StateLayout:
    """What a captured optimizer keeps for one param group (part of the program's structure)."""

    cls: type
    param_state: tuple[str, ...]  # entries of the parameter's shape
    scalar_state: tuple[str, ...]  # 0-dim entries other than ``step``
    has_step: bool
    hyper: tuple  # the group's values other than params and lr, frozen
    capturable: bool  # runs torch's capturable=True path (Note [captured optimizer steps])
    # the first op that mixes a parameter-sized tensor's elements other than a full
    # reduction: the parameter is updated whole (Note [steps on whole parameters])
    reduces: str | None
    # an entry's initial value depends on the gradient or the parameter (made in the first
    # step, as SGD's momentum buffer): the first step runs torch's own initialisation
    lazy: bool = False
    # entries of other shapes (Adafactor's row and column variances), with their shapes
    other_state: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # group values read at run time after lr (Note [captured optimizer steps]): (key, n), n
    # the length of a tuple value (betas) or 0 for a number (momentum)
    live: tuple[tuple[str, int], ...] = ()

    @property
    def state_names(self) -> tuple[str, ...]:
        """Every state entry but ``step``, in the order the step takes them."""
        return self.param_state + self.scalar_state + tuple(k for k, _ in self.other_state)

    @property
    def whole(self) -> bool:
        """Whether the step needs the whole parameter (Note [steps on whole parameters])."""
        return self.reduces is not None or bool(self.other_state)

    def state_shape(self, name: str, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        if name in self.scalar_state:
            return ()
        return dict(self.other_state).get(name, tuple(param_shape))


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
    """Finds the first op of a step that mixes the elements of a parameter-sized tensor in a
    way a shard cannot run alone (Note [whole-parameter reductions on shards])."""

    def __init__(self, shape: tuple):
        super().__init__()
        self.shape = shape
        self.numel = 1
        for d in shape:
            self.numel *= d
        self.found: str | None = None

    def _mixes(self, func, args, kwargs) -> bool:
        packet = getattr(func, "overloadpacket", None)
        if self.numel <= 1 or not any(
            isinstance(a, torch.Tensor) and a.numel() == self.numel for a in args
        ):
            return False
        if packet in (aten.slice, aten.select, aten.narrow):
            return True  # part of a parameter: another replica may hold it
        if packet in (aten.t, aten.transpose, aten.permute):
            return len(self.shape) > 1
        if packet not in _REDUCTIONS or func._overloadname in ("other", "out"):
            return False
        return not (
            isinstance(args[0], torch.Tensor)
            and args[0].numel() == self.numel
            and _is_whole(func, args, kwargs, args[0].dim())
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None and self._mixes(func, args, kwargs):
            self.found = str(func)
        return func(*args, **kwargs)


def _run_step(opt: torch.optim.Optimizer) -> None:
    # the class's step, not an instance attribute (an LR scheduler's wrapper)
    with torch.no_grad():
        type(opt).step(opt)


def _step_values(group: dict) -> dict:
    """A group's values but its params, for the step the program runs: not fused, not
    differentiable, not capturable (unless it must be); foreach stays (its steps run as
    torch's per-tensor ops: ``_per_tensor``)."""
    values = {k: v for k, v in group.items() if k != "params"}
    for k, v in (("fused", None), ("differentiable", False), ("capturable", False)):
        if k in values:
            values[k] = v
    return values


def probe(optimizer, group: dict, p: torch.Tensor) -> tuple[StateLayout, dict]:
    """The state ``optimizer`` keeps for ``p`` in ``group`` and its initial values, from one
    eager step of a copy of ``p`` with a zero gradient (Note [captured optimizer steps])."""
    values = _step_values(group)
    initial, reduces = _probe_step(optimizer, values, p.detach().clone(), 0.0)
    # a second probe with another parameter and gradient: does the initial state depend on
    # them (state made from the first gradient)?
    other, _ = _probe_step(optimizer, values, p.detach() + 1.0, 1.0)
    lazy = initial.keys() != other.keys() or any(
        isinstance(v, torch.Tensor) and not torch.equal(v, other[k]) for k, v in initial.items()
    )
    param_state, scalar_state, other_state, has_step, init = [], [], [], False, {}
    for k, v in initial.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(
                f"popxl.compile: {type(optimizer).__name__} keeps optimizer state {k!r} as a "
                f"{type(v).__name__} for a parameter of shape {tuple(p.shape)}; the compiled "
                "step keeps tensor state only (a program variable per entry). Keep it as a "
                "tensor (torch.tensor(value)) in the optimizer's step."
            )
        if k == "step" and v.dim() == 0:
            has_step = True
            continue
        if tuple(v.shape) == tuple(p.shape):
            param_state.append(k)
        elif v.dim() == 0:
            scalar_state.append(k)
        else:  # Note [steps on whole parameters]
            other_state.append((k, tuple(v.shape)))
        init[k] = v
    hyper = tuple(sorted((k, _frozen(v)) for k, v in values.items() if k != "lr"))
    layout = StateLayout(type(optimizer), tuple(param_state), tuple(scalar_state), has_step,
                         hyper, False, reduces, lazy, tuple(other_state))  # fmt: skip
    return layout, init


def _probe_step(optimizer, values: dict, q: torch.Tensor, grad: float) -> tuple[dict, str | None]:
    """One eager step on ``q`` with a constant gradient: the state entries as first set, and
    the first reduction over a parameter-sized tensor (or None)."""
    opt = shadow(optimizer)
    q.grad = torch.full_like(q, grad)
    opt.param_groups = [dict(values, params=[q])]
    log = _InitLog()
    opt.state = collections.defaultdict(dict, {q: log})
    spy = _ReductionSpy(tuple(q.shape))
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
        if name == "item" and len(args) == 1 and not kwargs:
            # a number the step computes with in Python (Adafactor's ``step_t.item()``,
            # ``p.norm().item()``): kept as a tensor, a double as Python's float
            return _tensor_value(args[0])
        if name in ("lerp", "lerp_") and _is_scalar64(args[2] if len(args) > 2 else None):
            # ``t.lerp_(end, weight)`` with a weight from the step count (a Python float in
            # eager torch): torch computes in float32 with the weight as float32 and rounds once
            # (out of place + copy_: vmap has no rule for lerp_)
            t, end, weight = args
            out = torch.lerp(t.float(), end.float(), weight.float()).to(t.dtype)
            return t.copy_(out) if name == "lerp_" else out
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

    def low(x):
        return isinstance(x, torch.Tensor) and x.dtype in _HALF_OR_FLOAT

    if _is_scalar64(a) and low(b):
        return a.float(), b
    if _is_scalar64(b) and low(a):
        return a, b.float()
    return a, b


def _is_scalar64(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype == torch.float64


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


def _per_tensor(name: str):
    """``torch._foreach_<op>`` as one ``<op>`` per tensor of its lists, which is what torch's
    CPU kernels for them do (their slow path), so a ``foreach=True`` step rounds as eager's;
    the replicas' vmap has no rule for foreach ops, and their scalar lists take no tensors
    (a step's numbers under capture)."""
    base = name[len("_foreach_") :]
    inplace = base.endswith("_")

    def one(args, kwargs):
        if base.startswith("norm"):  # torch's slow path: linalg_vector_norm of each
            return torch.linalg.vector_norm(args[0], *(args[1:] or (2,)), **kwargs)
        if not isinstance(args[0], torch.Tensor):  # _foreach_pow(scalar, tensors)
            return getattr(torch, base)(*args, **kwargs)
        method = getattr(torch.Tensor, base, None)
        if method is not None:
            return method(*args, **kwargs)
        assert inplace, name  # (maximum_, minimum_: no Tensor method)
        return args[0].copy_(getattr(torch, base[:-1])(*args, **kwargs))

    def per_tensor(*args, **kwargs):
        lists = [i for i, a in enumerate(args) if isinstance(a, list | tuple)]
        per_value = base.startswith(("addcdiv", "addcmul")) and len(args) == 4
        out = []
        for k in range(len(args[lists[0]])):
            a = [x[k] if i in lists else x for i, x in enumerate(args)]
            kw = dict(kwargs)
            if per_value:  # the scalars: a list, or a tensor of them (each as its .item())
                value = a.pop()
                many = isinstance(value, torch.Tensor) and value.dim() > 0
                kw["value"] = value[k] if many else value
            out.append(one(a, kw))
        return None if inplace else out

    return per_tensor


def _extremum(builtin, clamp: str, pick):
    """``min`` / ``max`` that also take tensors: a step's numbers are 0-dim tensors under
    capture (``min(lr, 1 / step ** 0.5)``), where Python's would need a bool of a value."""

    def extremum(*args, **kwargs):
        if kwargs or len(args) != 2 or not any(isinstance(a, torch.Tensor) for a in args):
            return builtin(*args, **kwargs)
        a, b = args
        if not isinstance(a, torch.Tensor):
            return getattr(b, clamp)(a)
        if not isinstance(b, torch.Tensor):
            return getattr(a, clamp)(b)
        return pick(a, b)

    return extremum


_EXTREMA = {"min": _extremum(min, "clamp_max", torch.minimum),
            "max": _extremum(max, "clamp_min", torch.maximum)}  # fmt: skip


@contextlib.contextmanager
def _captured_helpers(capturable: bool, cls: type):
    """torch.optim's ``_get_value`` keeps tensors; a capturable step passes torch's device
    check (the captured tensors are fake CPU tensors); ``min`` / ``max`` in torch.optim's
    modules and the optimizer's own take tensors; ``torch._foreach_*`` run per tensor (Note
    [captured optimizer steps])."""
    patches = {"_get_value": lambda orig: _tensor_value}
    if capturable:
        patches["_get_capturable_supported_devices"] = _with_cpu
    saved, added = [], []
    for attr in dir(torch):
        if attr.startswith("_foreach_"):
            saved.append((torch, attr, getattr(torch, attr)))
            setattr(torch, attr, _per_tensor(attr))
    for name, mod in list(sys.modules.items()):
        own = name == cls.__module__
        if mod is None or not (own or name.startswith("torch.optim")):
            continue
        for attr, patch in patches.items():
            if hasattr(mod, attr):
                orig = getattr(mod, attr)
                saved.append((mod, attr, orig))
                setattr(mod, attr, patch(orig))
        for attr, fn in _EXTREMA.items():
            if attr not in vars(mod):  # (a module's own min/max is left alone)
                setattr(mod, attr, fn)
                added.append((mod, attr))
    try:
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)
        for mod, attr in added:
            delattr(mod, attr)


@dataclass(frozen=True)
class Sharding:
    """How the captured step's parameter is sharded (Note [whole-parameter reductions on
    shards]): its real element count and the sharding group."""

    numel: int
    group_size: int
    stride: int

    @property
    def shard(self) -> int:
        return -(-self.numel // self.group_size)


class _ShardedReductions(TorchDispatchMode):
    """Rewrites a full reduction of a shard-shaped tensor as the shard's partial result,
    all-reduced over the sharding group, then finished (Note [whole-parameter reductions on
    shards])."""

    def __init__(self, sharding: Sharding):
        super().__init__()
        self.sharding = sharding
        self._mask: torch.Tensor | None = None

    def mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """True on this replica's real (non-padding) elements; None without padding."""
        sh = self.sharding
        if sh.shard * sh.group_size == sh.numel:
            return None
        if self._mask is None:
            ranks = torch.arange(sh.group_size, dtype=torch.float32, device=x.device)
            mine = torch.ops.torch_popxl.replicated_reduce_scatter(
                ranks, "local", sh.group_size, sh.stride
            )
            start = mine.long() * sh.shard
            pos = start + torch.arange(sh.shard, dtype=torch.int64, device=x.device)
            self._mask = pos < sh.numel
        return self._mask

    def _neutral(self, x: torch.Tensor, value: float) -> torch.Tensor:
        m = self.mask(x)
        return x if m is None else torch.where(m, x, torch.full((), value, dtype=x.dtype))

    def _all(self, x: torch.Tensor, op: str) -> torch.Tensor:
        sh = self.sharding
        return torch.ops.torch_popxl.replicated_all_reduce(x, op, sh.group_size, sh.stride)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        x = args[0] if args else None
        if (
            packet not in _WHOLE
            or not isinstance(x, torch.Tensor)
            or tuple(x.shape) != (self.sharding.shard,)
            or not _is_whole(func, args, kwargs, 1)
        ):
            return func(*args, **kwargs)
        out = self._whole(packet, args, kwargs)
        keepdim = kwargs.get("keepdim", False)
        if packet in _DIM_ARG and len(args) > _DIM_ARG[packet] + 1:
            keepdim = args[_DIM_ARG[packet] + 1]
        return out.reshape(1) if keepdim else out

    def _whole(self, packet, args, kwargs) -> torch.Tensor:
        x = args[0]
        if packet in (aten.dot, aten.vdot):
            x = x.conj() * args[1] if packet is aten.vdot else x * args[1]
        out_dtype = kwargs.get("dtype") or x.dtype
        if packet is aten.sum and not out_dtype.is_floating_point and not out_dtype.is_complex:
            out_dtype = torch.int64  # torch sums integers and booleans as int64
        # 16-bit values: partials and the all-reduce in float32 (torch accumulates their sums
        # in float32 too; the collectives take no bfloat16), rounded once at the end
        wide = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
        x = x.to(wide)
        return self._reduced(packet, x, args, kwargs).to(out_dtype)

    def _reduced(self, packet, x: torch.Tensor, args, kwargs) -> torch.Tensor:
        if packet in (aten.amax, aten.max):
            return self._all(self._neutral(x, -float("inf")).amax(), "max")
        if packet in (aten.amin, aten.min):
            return self._all(self._neutral(x, float("inf")).amin(), "min")
        if packet in (aten.sum, aten.mean, aten.dot, aten.vdot):
            total = self._all(self._neutral(x, 0.0).sum(), "add")
            return total / self.sharding.numel if packet is aten.mean else total
        # norms: linalg_vector_norm(x, ord=2, dim, keepdim, *, dtype), norm(x, p, dim, ...)
        order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p"))
        order = 2.0 if order is None else float(order)
        a = x.abs()
        if order == float("inf"):
            return self._all(self._neutral(a, 0.0).amax(), "max")
        if order == -float("inf"):
            return self._all(self._neutral(a, float("inf")).amin(), "min")
        if order == 0:
            return self._all(self._neutral((a != 0).to(a.dtype), 0.0).sum(), "add")
        if order == 1:
            return self._all(self._neutral(a, 0.0).sum(), "add")
        if order == 2:
            return self._all(self._neutral(a * a, 0.0).sum(), "add").sqrt()
        return self._all(self._neutral(a.pow(order), 0.0).sum(), "add").pow(1.0 / order)


def _step(p, g, step, hyper, *state, opt, layout: StateLayout, capturable: bool):
    """One step of ``opt`` on ``p`` (a parameter or a shard) with gradient ``g`` and the state
    tensors ``state`` (param-shaped entries, then scalar ones), in place."""
    names = layout.state_names
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
    i = 1
    for key, n in layout.live:  # the values after lr in hyper/i, as live_values writes them
        group[key] = tuple(hyper[i + j] for j in range(n)) if n else hyper[i]
        i += max(n, 1)
    if capturable:
        group["capturable"] = True
    opt.param_groups = [group]
    opt.state = collections.defaultdict(dict, {p: entry})
    p.grad = g
    try:
        with _captured_helpers(capturable, type(opt)), _TensorScalars():
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
    return not _captures(opt, layout, p, init, False)


def _captures(opt, layout: StateLayout, p: torch.Tensor, init: dict, capturable: bool) -> bool:
    """Whether the step captures without a value-dependent branch (a trial capture)."""
    ir = Ir()
    graph = ir.create_empty_graph("optimizer_probe")

    def inp(t, name):
        return graph_input(tuple(t.shape), _dtype.as_dtype(t.dtype), name)

    with graph:
        args = [inp(p, "p"), inp(p, "g"), inp(torch.zeros(()), "step"),
                inp(torch.zeros(N_HYPER, dtype=torch.float64), "hyper")]  # fmt: skip
        args += [inp(init[k], k) for k in layout.state_names]
        kwargs = {"opt": opt, "layout": layout, "capturable": capturable}
        try:
            call_torch(_step, tuple(args), kwargs)
        except DataDependentError:
            return False
    return True


def _live_keys(opt, layout: StateLayout, p, init: dict, group: dict) -> tuple:
    """The values of ``_SCHEDULED`` the step does not branch on (a trial capture with each
    read at run time), as ``StateLayout.live`` lists them."""
    live: list[tuple[str, int]] = []
    used = 1  # lr
    for key in _SCHEDULED:
        v = group.get(key)
        if isinstance(v, tuple | list) and all(isinstance(x, float | int) for x in v):
            n = len(v)
        elif isinstance(v, float | int) and not isinstance(v, bool):
            n = 0
        else:
            continue
        if used + max(n, 1) > N_HYPER:
            break
        trial = dataclasses.replace(
            layout, live=(*live, (key, n)), hyper=tuple(kv for kv in layout.hyper if kv[0] != key)
        )
        try:
            ok = _captures(opt, trial, p, init, layout.capturable)
            ok = ok and _same_numbers(opt, group, p, key, layout.capturable)
        except Exception:  # torch's step refuses a tensor there: it stays structure
            ok = False
        if ok:
            live.append((key, n))
            used += max(n, 1)
    return tuple(live)


def with_live(layout: StateLayout, live: tuple, group: dict) -> StateLayout:
    """``layout`` reading only ``live`` at run time; the others are structure again."""
    keys = {k for k, _ in live}
    back = [(k, _frozen(group[k])) for k, _ in layout.live if k not in keys]
    return dataclasses.replace(layout, live=live, hyper=tuple(sorted((*layout.hyper, *back))))


def _same_numbers(optimizer, group: dict, p: torch.Tensor, key: str, capturable: bool) -> bool:
    """Whether two host steps with ``group[key]`` as float64 tensors (as the program reads
    it) give what they give with Python floats, bit for bit: torch's Adam converts a tensor
    beta1 to the parameter's dtype before ``1 - beta1``, which rounds otherwise."""
    outcome = []
    for as_tensor in (False, True):
        gen = torch.Generator().manual_seed(0)
        q = p.detach().clone()
        values = _step_values(group)
        v = values[key]
        if as_tensor:
            as64 = functools.partial(torch.tensor, dtype=torch.float64)
            values[key] = tuple(as64(x) for x in v) if isinstance(v, tuple | list) else as64(v)
        if capturable:
            values["capturable"] = True
        opt = shadow(optimizer)
        opt.param_groups = [dict(values, params=[q])]
        for _ in range(2):
            q.grad = torch.randn(q.shape, generator=gen).to(q.dtype)
            with _captured_helpers(capturable, type(opt)), _TensorScalars():
                _run_step(opt)
        outcome.append([q.detach(), *[t for t in opt.state[q].values() if torch.is_tensor(t)]])
    a, b = outcome
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def live_values(group: dict, layout: StateLayout) -> tuple[float, ...]:
    """What ``hyper/i`` holds for a group: lr, then the live values (``_step_with``)."""
    out = [float(group["lr"])]
    for key, n in layout.live:
        out += [float(x) for x in group[key]] if n else [float(group[key])]
    return (*out, *[0.0] * (N_HYPER - len(out)))


def torch_step(
    p,
    g,
    step,
    hyper,
    state,
    *,
    opt,
    layout: StateLayout,
    found=None,
    sharding: Sharding | None = None,
) -> None:
    """Record ``opt``'s step on graph tensors (Note [captured optimizer steps]); ``sharding``
    where ``p`` is this replica's RTS shard (Note [whole-parameter reductions on shards])."""
    kwargs = {"opt": opt, "layout": layout, "capturable": layout.capturable}
    fn: Callable[..., None] = _step
    args = (p, g, step, hyper, *state)
    if found is not None:
        fn, args = _skippable_step, (p, g, step, hyper, found, *state)
    if sharding is not None:
        fn, kwargs = _on_shards, {"fn": fn, "sharding": sharding, **kwargs}
    call_torch(fn, args, kwargs)


class _ShardNumel(TorchFunctionMode):
    """``numel()`` of a shard-shaped tensor is the parameter's real element count, as the
    full reductions are the parameter's (an RMS: ``p.norm() / p.numel() ** 0.5``)."""

    def __init__(self, sharding: Sharding):
        super().__init__()
        self.sharding = sharding

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            getattr(func, "__name__", "") == "numel"
            and len(args) == 1
            and isinstance(args[0], torch.Tensor)
            and tuple(args[0].shape) == (self.sharding.shard,)
        ):
            return self.sharding.numel
        return func(*args, **(kwargs or {}))


def _on_shards(*args, fn, sharding: Sharding, **kwargs) -> None:
    with _ShardedReductions(sharding), _ShardNumel(sharding):
        fn(*args, **kwargs)


_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_probe(optimizer, group: dict, p: torch.Tensor) -> tuple[StateLayout, dict]:
    """``probe`` with the capturable and live-value decisions, cached per optimizer,
    parameter and the group's values but lr and the live ones."""
    cache = _PROBES.setdefault(optimizer, {})
    values = {k: v for k, v in group.items() if k not in ("params", "lr")}
    base = (id(p), tuple(p.shape), p.dtype)
    scheduled = (*base, "live", _frozen_values(values, set(_SCHEDULED)))
    live = cache.get(scheduled)
    if live is not None:
        known = (*base, _frozen_values(values, {k for k, _ in live}))
        hit = cache.get(known)
        if hit is not None:
            return hit
    layout, init = probe(optimizer, group, p)
    opt = shadow(optimizer)
    if needs_capturable(opt, layout, p, init):
        layout = dataclasses.replace(layout, capturable=True)
    if live is None:
        live = cache[scheduled] = _live_keys(opt, layout, p, init, group)
    keys = {k for k, _ in live}
    layout = dataclasses.replace(
        layout, live=live, hyper=tuple(kv for kv in layout.hyper if kv[0] not in keys)
    )
    hit = (layout, init)
    key = (*base, _frozen_values(values, keys))
    cache[key] = hit
    return hit


def _frozen_values(values: dict, without: set) -> tuple:
    return tuple(sorted((k, _frozen(v)) for k, v in values.items() if k not in without))
