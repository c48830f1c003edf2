"""``popxl.compile``'s step arithmetic: the optimizer updates written with torch's formulas,
their hyperparameters, loss scaling and gradient clipping (the functions the trainer's
program captures)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._prims_common import get_computation_dtype

from . import compile_optim as _optim
from .capture import call_torch
from .opdefs import scalar_tensor as _scalar_ops
from .opdefs import sgd as _sgd_ops

# ---- optimizers: torch's formulas, written as in-place torch ops ------------------------
#
# Note [hyperparameters at run time]
#     The torch optimizer's ``param_groups`` stay the source of truth: every numeric
#     hyperparameter (lr, weight decay, momentum, dampening, betas, eps) of a group lives in a
#     small variable that is written before each step when the group's values changed, so LR
#     schedulers and manual edits take effect without a rebuild. Only the program's structure
#     is fixed when it is built (the optimizer kind, the param-to-group assignment, nesterov,
#     whether momentum / weight decay are used at all); a change of it rebuilds the program
#     and carries the state over (``_GroupSpec``). A captured optimizer (Note [captured
#     optimizer steps]) reads ``lr`` at run time; its other values are structure.

# sgd: lr, weight_decay, momentum, dampening, -; adam: lr, weight_decay, b1, b2, eps; a
# captured optimizer: lr and its live values (Note [captured optimizer steps])
_N_HYPER = _optim.N_HYPER


@dataclass(frozen=True)
class _GroupSpec:
    """The structure of one param group (what the program is built for)."""

    kind: str  # "sgd" | "adam" | "adamw" | "torch" (Note [captured optimizer steps])
    names: tuple[str, ...]
    momentum: bool = False
    nesterov: bool = False
    weight_decay: bool = False
    maximize: bool = False  # SGD's (Adam/AdamW with maximize run torch's own step)
    # Adam/AdamW built with ``fused=True``: (beta1, beta2, eps, weight_decay), which torch's
    # fused kernel takes as plain numbers (Note [fused optimizer updates]); None otherwise.
    fused: tuple[float, float, float, float] | None = None
    # kind "torch": the state the captured step keeps, per parameter of ``names`` (Note
    # [captured optimizer steps]; Adafactor keeps other entries for a matrix than a vector)
    layouts: tuple[_optim.StateLayout, ...] = ()

    def layout_of(self, name: str) -> _optim.StateLayout:
        return self.layouts[self.names.index(name)]

    def state_of(self, name: str) -> tuple[str, ...]:
        """The state entries (but ``step``) torch keeps for parameter ``name``."""
        if self.kind == "sgd":
            return ("momentum_buffer",) if self.momentum else ()
        if self.layouts:
            return self.layout_of(name).state_names
        return ("exp_avg", "exp_avg_sq")

    @property
    def has_step(self) -> bool:
        """Whether torch keeps a ``step`` tensor per parameter."""
        if self.kind != "torch":
            return self.kind != "sgd"
        return any(lay.has_step for lay in self.layouts)

    def state_shape(self, name: str, key: str, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of state entry ``key`` of parameter ``name`` (of ``param_shape``)."""
        if not self.layouts:
            return tuple(param_shape)
        return self.layout_of(name).state_shape(key, tuple(param_shape))


def _optimizer_kind(optimizer) -> str:
    # Options the hand-written SGD/Adam/AdamW updates do not have run torch's own step
    # (Note [captured optimizer steps]).
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"popxl.compile expects a torch.optim.Optimizer; got {type(optimizer).__name__}."
        )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise TypeError(
            "popxl.compile: SparseAdam updates sparse gradients (nn.Embedding(sparse=True)) "
            "and refuses dense ones; the compiled step computes dense gradients. Use "
            "torch.optim.Adam or AdamW (the same update on dense gradients)."
        )
    captured = any(g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups)
    if isinstance(optimizer, torch.optim.AdamW) or type(optimizer).__name__ == "AdamW":
        return "torch" if captured else "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "torch" if captured else "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"  # maximize included
    return "torch"  # Note [captured optimizer steps]


def _group_specs(
    optimizer: torch.optim.Optimizer,
    params: dict[str, torch.nn.Parameter],
    no_grad_path: frozenset[str] = frozenset(),
) -> tuple[_GroupSpec, ...]:
    kind = _optimizer_kind(optimizer)
    by_id = {id(p): n for n, p in params.items()}
    specs, seen = [], set()
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(
                    "popxl.compile: the optimizer holds a parameter that is not a parameter of the "
                    "model. Build the optimizer from model.parameters()."
                )
            # torch's optimizers skip a frozen one, or one the loss does not reach (its grad
            # is None: Note [parameters without a gradient] in compile.py)
            if p.requires_grad and by_id[id(p)] not in no_grad_path:
                names.append(by_id[id(p)])
        seen.update(names)
        if kind == "torch":  # maximize, if any, is torch's business here
            specs.append(_torch_group_spec(optimizer, group, names, params))
            continue
        if kind == "sgd":
            if group.get("nesterov") and (group["momentum"] <= 0 or group["dampening"] != 0):
                raise ValueError(
                    "Nesterov momentum needs momentum > 0 and dampening == 0 (as in torch)."
                )
            specs.append(_GroupSpec(kind, tuple(names), float(group["momentum"]) != 0,
                                    bool(group["nesterov"]), float(group["weight_decay"]) != 0,
                                    bool(group.get("maximize", False))))  # fmt: skip
        else:
            if group.get("amsgrad"):
                raise ValueError(
                    "popxl.compile does not support amsgrad=True or maximize=True for Adam/AdamW."
                )
            fused = None
            if group.get("fused"):
                b1, b2 = group["betas"]
                fused = (float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]))
            specs.append(_GroupSpec(kind, tuple(names), weight_decay=float(group["weight_decay"]) != 0,
                                    fused=fused))  # fmt: skip
    # Note [frozen parameters]: a parameter outside the optimizer or with requires_grad=False
    # is an input of the program, as a buffer is: no gradient, accumulator or optimizer state,
    # never written. Freezing or unfreezing one changes the specs, so the program is rebuilt.
    return tuple(specs)


def _torch_group_spec(optimizer, group: dict, names: list[str], params: dict) -> _GroupSpec:
    """A captured optimizer's group (Note [captured optimizer steps]): each parameter's
    layout; one step count for all of them."""
    if not names:
        return _GroupSpec("torch", ())
    layouts = tuple(_optim.cached_probe(optimizer, group, params[n])[0] for n in names)
    if len({lay.has_step for lay in layouts}) > 1:
        raise TypeError(
            f"popxl.compile: {type(optimizer).__name__} keeps a step count for some parameters "
            "of one param group and not for others; the compiled step keeps one for all."
        )
    lives = {lay.live for lay in layouts}
    if len(lives) > 1:  # the values read at run time are the group's: those all read so
        common = tuple(kv for kv in layouts[0].live if all(kv in lv for lv in lives))
        layouts = tuple(_optim.with_live(lay, common, group) for lay in layouts)
    return _GroupSpec("torch", tuple(names), layouts=layouts)


def _group_values(
    optimizer: torch.optim.Optimizer, specs: tuple[_GroupSpec, ...]
) -> tuple[tuple[float, ...], ...]:
    """Every group's numeric hyperparameters, as written to the program's ``hyper/i``."""
    out = []
    for g, spec in zip(optimizer.param_groups, specs, strict=True):
        if spec.kind == "torch":  # lr and the live values (Note [captured optimizer steps])
            live = spec.layouts[0] if spec.layouts else None
            out.append(
                _optim.live_values(g, live) if live else (float(g["lr"]), 0.0, 0.0, 0.0, 0.0)
            )
        elif spec.kind == "sgd":
            out.append((float(g["lr"]), float(g["weight_decay"]), float(g["momentum"]),
                        float(g["dampening"]), 0.0))  # fmt: skip
        else:
            b1, b2 = g["betas"]
            out.append(
                (float(g["lr"]), float(g["weight_decay"]), float(b1), float(b2), float(g["eps"]))
            )
    return tuple(out)


# Note [optimizer arithmetic as torch rounds it]
#     torch's single-tensor SGD / Adam (the CPU default) compute their scalars in double
#     (Python floats) and hand them to kernels that compute in float32 ("opmath") and round
#     the result once to the parameter's dtype, per torch op: ``grad.add(param, alpha=wd)``,
#     ``exp_avg.lerp_(grad, 1 - beta1)``, ``exp_avg_sq.mul_(beta2)`` then ``.addcmul_(...)``,
#     ``param.addcdiv_(exp_avg, denom, value=-step_size)``. The compiled update does the same,
#     with the hyperparameters read at run time from ``hyper/i`` (so LR schedulers need no
#     rebuild): that variable is float64 (not downcast), every scalar is derived from it in
#     float64 and cast to float32 once. The ops taking a scalar ``alpha`` / ``value`` run
#     torch's own kernels through ``opdefs/scalar_tensor.py`` (the scalar a tensor there): those
#     kernels may fuse the multiply and the add into one rounding, which no chain of separate
#     ops reproduces. Ops taking a plain tensor scalar (``mul``, ``lerp``, ``div``) compute in
#     float32 (``_f``) and round to the parameter's dtype (``_r``) where torch rounds; an added
#     scalar (``add_(eps)``) is first rounded to the tensor's dtype (``_alpha``), as torch's
#     CPU kernels do for float16 and bfloat16. The update then equals eager torch's bit for bit
#     for float32, float16 and bfloat16 parameters given the same gradients
#     (tests/test_compile_optimizer_exact.py). "float32" above is torch's computation dtype
#     (``get_computation_dtype``): a float64 parameter's kernels compute in float64, and its
#     group's scalars stay float64 (``scalar_dtype``; Note [float64 models] in
#     compile_common.py).


def _f(t):
    return t.to(get_computation_dtype(t.dtype))


def _r(t, like):
    return t.to(like.dtype)


def _alpha(scalar, like):
    return scalar.to(like.dtype).to(get_computation_dtype(like.dtype))


def scalar_dtype(dtypes) -> torch.dtype:
    """The dtype a param group's scalars are cast to once: the widest computation dtype of
    its parameters' ``dtypes`` (float32 at least; Note [optimizer arithmetic ...])."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, get_computation_dtype(d))
    return out


def _group_scalars(h, step, *, kind: str, dtype: torch.dtype = torch.float32):
    """Per-group scalars, computed once per step (not once per parameter), in float64 and
    then cast to ``dtype`` (``scalar_dtype``) as torch's kernels take them (Note [optimizer
    arithmetic ...])."""
    lr, wd = h[0], h[1]
    out: tuple[torch.Tensor, ...]
    if kind == "sgd":
        out = (lr, wd, h[2], 1.0 - h[3])
    else:
        t = step.double() + 1.0
        b1, b2, eps = h[2], h[3], h[4]
        step_size = lr / (1.0 - torch.pow(b1, t))
        bias_correction2_sqrt = torch.sqrt(1.0 - torch.pow(b2, t))
        out = (1.0 - lr * wd, wd, 1.0 - b1, b2, 1.0 - b2, step_size, bias_correction2_sqrt, eps)
    return tuple(v.to(dtype) for v in out)


def _sgd_update(p, g, step, lr, wd, momentum, one_minus_dampening, *state, spec: _GroupSpec):
    # Every ``add(..., alpha=a)`` of torch's SGD runs torch's kernel with ``a`` read at run
    # time (Note [optimizer arithmetic as torch rounds it]).
    d_p = -g if spec.maximize else g
    if spec.weight_decay:
        d_p = d_p.clone()
        _scalar_ops.add_alpha_(d_p, p, wd)  # grad.add(param, alpha=weight_decay)
    if spec.momentum:
        (buf,) = state
        new = _r(_f(buf) * momentum, buf)  # buf.mul_(momentum)
        _scalar_ops.add_alpha_(new, d_p, one_minus_dampening)  # .add_(grad, alpha=1 - d)
        # torch initialises the buffer with the first gradient (no dampening on step 1).
        buf.copy_(torch.where(step == 0, d_p, new))
        if spec.nesterov:
            d_p = d_p.clone()
            _scalar_ops.add_alpha_(d_p, buf, momentum)  # grad.add(buf, alpha=momentum)
        else:
            d_p = buf
    _scalar_ops.add_alpha_(p, d_p, -lr)  # param.add_(grad, alpha=-lr)


def _sgd_one_pass(p, buf, grad_out, g, hyper, step, factors, *, spec: _GroupSpec) -> None:
    """``_sgd_update`` after the gradient's ``factors`` and its copy into ``grad_out``
    (``p.grad``, or None), in one pass (Note [one-pass SGD update] in opdefs/sgd.py); ``hyper``
    is the group's hyperparameter vector, ``buf`` the momentum buffer or None."""
    _sgd_ops.sgd_update_(p, buf, grad_out, g, hyper, step, factors, spec.weight_decay,
                         spec.nesterov, spec.maximize)  # fmt: skip


def _adam_update(p, g, step, decay, wd, one_minus_b1, b2, one_minus_b2, step_size, bc2_sqrt, eps,
                 exp_avg, exp_avg_sq, *, spec: _GroupSpec):  # fmt: skip
    if spec.kind == "adamw":
        if spec.weight_decay:
            p.mul_(decay)  # param.mul_(1 - lr * weight_decay): float32 scalar, one rounding
    elif spec.weight_decay:
        g = g.clone()
        _scalar_ops.add_alpha_(g, p, wd)  # grad.add(param, alpha=weight_decay)
    if all(
        t.dtype == torch.float32 and t.device.type == "cpu" for t in (p, g, exp_avg, exp_avg_sq)
    ):
        # the rest of the chain in three passes, bit for bit (Note [Adam chain in three
        # passes] in csrc/adam.cpp)
        _scalar_ops.adam_chain(p, g, exp_avg, exp_avg_sq, one_minus_b1, b2, one_minus_b2,
                               step_size, bc2_sqrt, eps)  # fmt: skip
        return
    # Out-of-place + copy_ because vmap has no batching rule for lerp_ (it would fall back
    # to a slow per-replica loop).
    exp_avg.copy_(_r(torch.lerp(_f(exp_avg), _f(g), one_minus_b1), exp_avg))
    exp_avg_sq.copy_(_r(_f(exp_avg_sq) * b2, exp_avg_sq))  # exp_avg_sq.mul_(beta2)
    # .addcmul_(grad, grad, value=1 - beta2): torch's kernel, the value read at run time
    # (Note [optimizer arithmetic as torch rounds it])
    _scalar_ops.addcmul_value_(exp_avg_sq, g, g, one_minus_b2)
    # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): three roundings
    root = exp_avg_sq.sqrt()
    denom = _r(_f(_r(_f(root) / bc2_sqrt, root)) + _alpha(eps, root), root)
    _scalar_ops.addcdiv_value_(p, exp_avg, denom, -step_size)  # param.addcdiv_(.., -step_size)


def _adam_one_pass(p, grad_out, g, factors, decay, wd, one_minus_b1, b2, one_minus_b2, step_size,
                   bc2_sqrt, eps, exp_avg, exp_avg_sq, *, spec: _GroupSpec) -> None:  # fmt: skip
    """``_adam_update`` after the gradient's ``factors`` and its copy into ``grad_out``
    (``p.grad``, or None), both inside the chain kernel's first pass (Note [Adam chain in three
    passes] in csrc/adam.cpp); ``_one_pass_reason`` says when it applies (float32 CPU tensors,
    no coupled weight decay)."""
    if spec.kind == "adamw" and spec.weight_decay:
        p.mul_(decay)  # param.mul_(1 - lr * weight_decay): float32 scalar, one rounding
    _scalar_ops.adam_chain(p, g, exp_avg, exp_avg_sq, one_minus_b1, b2, one_minus_b2, step_size,
                           bc2_sqrt, eps, grad_out, factors)  # fmt: skip


def _skippable_update(p, g, step, found, *args, spec: _GroupSpec):
    """The update, undone where ``found`` says the gradients overflowed (Note [loss scaling])."""
    n_state = len(spec.state_of(""))  # (sgd / adam: the same for every parameter)
    state = args[len(args) - n_state :] if n_state else ()
    old = [p.clone(), *[t.clone() for t in state]]
    fn = _sgd_update if spec.kind == "sgd" else _adam_update
    fn(p, g, step, *args, spec=spec)
    for t, o in zip([p, *state], old, strict=True):
        t.copy_(torch.where(found > 0, o, t))


def _optimizer_update(p, g, step, scalars, state, spec: _GroupSpec, found=None) -> None:
    if found is not None:
        call_torch(_skippable_update, (p, g, step, found, *scalars, *state), {"spec": spec})
        return
    fn = _sgd_update if spec.kind == "sgd" else _adam_update
    call_torch(fn, (p, g, step, *scalars, *state), {"spec": spec})


# Note [fused optimizer updates]
#     An Adam/AdamW built with ``fused=True`` updates a whole param group with one
#     ``torch._fused_adam_`` / ``_fused_adamw_`` call, which rounds differently from the
#     single-tensor chain above. The compiled step does the same: one call of the same kernel
#     over all of the group's parameters, so the numbers are eager's fused ones, and on CPU it
#     is ~3x faster than the per-parameter chain (benchmarks/bench_optimizer.py). Every member
#     is prepared as the chain prepares it (``Trainer._update_target``, ``_load_state``): a
#     sharded (RTS) member gives this replica's shard of its parameter, its reduce-scattered
#     gradient and its state shards, off-chip state is loaded from its remote buffer; after the
#     call each member's state is stored and each shard all-gathered into its parameter
#     (``_finish_update``). The kernel updates every list element on its own, so the fast
#     executor runs the call once over stacked shards and replica-invariant weights together,
#     and shards that divide their parameter give the unsharded update bit for bit (a padded
#     shard may move a value by an ulp: Note [per-element list ops] in runtime/explicit.py).
#     The one call holds every member's loaded state at once where the chain holds one
#     parameter's state and its temporaries (the memory report's live intermediates count
#     it); the traffic is the chain's. The kernel takes the learning rate as a tensor (read
#     from ``hyper/i`` at every step, so LR schedulers work) but betas, eps and weight decay
#     as plain numbers: they are part of the group's structure (``_GroupSpec.fused``) and
#     changing them rebuilds the program, carrying the state over. Where the kernel cannot
#     apply, the group keeps the per-parameter chain and ``Trainer.fused_reasons`` says why:
#     dynamic loss scaling (its skipped step is written for the chain), mixed dtypes in one
#     group (eager torch splits such a group into one call per dtype), a CUDA simulator
#     (untested). SGD has its own kernel for the default (single-tensor) update: Note
#     [one-pass SGD update] in opdefs/sgd.py.


def _fused_adam_group(*tensors, n: int, kind: str, beta1: float, beta2: float, eps: float,
                      weight_decay: float) -> None:  # fmt: skip
    """One fused Adam/AdamW step over ``n`` parameters, as torch's ``fused=True`` path runs it:
    ``tensors`` are the parameters, gradients, exp_avgs and exp_avg_sqs (``n`` of each), the
    step count before this step and the group's hyperparameter vector (lr first)."""
    ps, gs, ms, vs = (list(tensors[i * n : (i + 1) * n]) for i in range(4))
    step, hyper = tensors[4 * n :]
    # torch increments its per-parameter step tensors before the kernel reads them.
    t = step.float() + 1.0
    fn = torch._fused_adamw_ if kind == "adamw" else torch._fused_adam_
    fn(ps, gs, ms, vs, [], [t] * n, amsgrad=False, lr=hyper[0], beta1=beta1, beta2=beta2,
       weight_decay=weight_decay, eps=eps, maximize=False)  # fmt: skip


def _fused_reason(spec: _GroupSpec, slots: list, dynamic_scaling: bool, device):
    """Why a param group keeps the per-parameter update chain, or None when it runs the fused
    kernel (Note [fused optimizer updates], Note [one-pass SGD update] in opdefs/sgd.py)."""
    if spec.kind == "sgd":
        return _sgd_kernel_reason(slots, dynamic_scaling, device)
    if spec.fused is None:
        return "the optimizer was not built with fused=True"
    if torch.device(device).type != "cpu":
        # CUDA's fused kernel takes its learning-rate tensor differently; untested here.
        return f"the fused update is used on the CPU simulator only (device={str(device)!r})"
    if dynamic_scaling:
        return "dynamic loss scaling skips steps in the per-parameter update"
    dtypes = {s.var.dtype.name for s in slots}
    if len(dtypes) > 1:
        return f"the group mixes parameter dtypes {sorted(dtypes)}"
    return None


def _kernel_reason(kernel: str, slots: list, dynamic_scaling: bool, device) -> str | None:
    """Why a group's parameters cannot go through one of the extension's float32 CPU kernels
    (``kernel`` names it), or None."""
    if torch.device(device).type != "cpu":
        return f"the {kernel} runs on the CPU simulator only (device={str(device)!r})"
    if dynamic_scaling:
        return "dynamic loss scaling skips steps in the per-parameter update"
    dtypes = sorted({s.var.dtype.name for s in slots} - {"float32"})
    if dtypes:
        return f"the {kernel} takes float32 parameters; the group has {dtypes}"
    return None


def _sgd_kernel_reason(slots: list, dynamic_scaling: bool, device) -> str | None:
    return _kernel_reason("one-pass SGD kernel", slots, dynamic_scaling, device)


def _one_pass_reason(spec: _GroupSpec, slots: list, dynamic_scaling: bool, device) -> str | None:
    """Why a param group's update does not take the gradient's rescaling and its ``p.grad``
    copy into its kernel (SGD: Note [one-pass SGD update] in opdefs/sgd.py; Adam and AdamW
    without ``fused=True``: the chain kernel, Note [Adam chain in three passes] in
    csrc/adam.cpp), or None when it does."""
    if spec.kind == "sgd":
        return _sgd_kernel_reason(slots, dynamic_scaling, device)
    if spec.kind not in ("adam", "adamw") or spec.fused is not None:
        return f"the {spec.kind} update{' (fused)' if spec.fused else ''} has no one-pass form"
    if spec.kind == "adam" and spec.weight_decay:
        return "Adam's weight decay adds the parameter to the rescaled gradient"
    return _kernel_reason("chain kernel", slots, dynamic_scaling, device)


def _factors(*factors):
    """The gradient's pending multipliers as the one-pass kernel takes them (float32)."""
    return torch.stack([f.reshape(()).float() for f in factors])


# ---- loss scaling (Note [loss scaling]) ----------------------------------------------------
#
# Note [loss scaling]
#     As torch.amp.GradScaler: the backward is seeded with ``scale / GA`` instead of
#     ``1 / GA`` (GradScaler's ``scaler.scale(loss / GA).backward()``), the replica-reduced
#     gradients are multiplied by ``float32(1 / double(scale))`` (``unscale_``), then clipped
#     and applied. Dynamic scaling also checks the gradients for inf/nan (a sharded gradient's
#     count is summed over the replicas): on an overflow the optimizer step is skipped
#     (parameters, state and step count unchanged) and the scale is multiplied by
#     ``backoff_factor``; after ``growth_interval`` clean steps in a row it is multiplied by
#     ``growth_factor`` (``GradScaler.update``). Static scaling (a number) only scales and
#     unscales, as PopTorch's static loss scaling does: no check, no skipped step.


@dataclass(frozen=True)
class _LossScaling:
    init_scale: float
    dynamic: bool
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def _loss_scaling(value) -> _LossScaling | None:
    if value is None:
        return None
    if isinstance(value, torch.amp.GradScaler):
        if not value.is_enabled():
            return None
        return _LossScaling(value.get_scale(), True, value.get_growth_factor(),
                            value.get_backoff_factor(), value.get_growth_interval())  # fmt: skip
    if value == "dynamic":  # GradScaler's defaults
        return _LossScaling(2.0**16, True)
    if (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        return _LossScaling(float(value), False)
    raise ValueError(
        "loss_scaling must be None, a positive number (static scaling), 'dynamic' (GradScaler's "
        f"defaults) or a torch.amp.GradScaler (its settings); got {value!r}."
    )


def _seed(scale, *, ga: int, dtype: torch.dtype):
    return (scale / ga).to(dtype)


def _inverse_scale(scale):
    return scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it


def _nonfinite_count(g):
    return (~torch.isfinite(g)).sum().float()


def _any_positive(*counts):
    return (torch.stack(counts).sum() > 0).float()


def _update_scale(scale, tracker, found, *, growth: float, backoff: float, interval: int):
    """GradScaler.update (torch._amp_update_scale_), in place."""
    successful = tracker + 1.0
    grow = successful >= interval
    new_scale = torch.where(grow, scale * growth, scale)
    new_scale = torch.where(torch.isfinite(new_scale), new_scale, scale)  # never grow to inf
    skipped = found > 0
    scale.copy_(torch.where(skipped, scale * backoff, new_scale))
    tracker.copy_(torch.where(skipped | grow, torch.zeros_like(tracker), successful))


def _step_increment(found):
    return 1.0 - found


def _unpad(flat, *, shape):
    """The gathered shards without the padding of the last one, in the parameter's shape."""
    return flat[: math.prod(shape)].reshape(shape)


def _sum_of_squares(g):
    g = _f(g)
    return (g * g).sum()


# Note [gradient clipping as torch rounds it]
#     ``max_grad_norm`` is ``torch.nn.utils.clip_grad_norm_`` step by step, so that at R=1 it
#     clips bit for bit as eager does: a norm per gradient (``torch._foreach_norm``, which on
#     CPU is ``linalg.vector_norm`` per tensor, in the gradient's dtype), the norms grouped by
#     dtype in first-seen order as torch groups them, the norm of their stack, then
#     ``clamp(max_norm / (total + 1e-6), max=1)`` multiplied into every gradient. A sharded
#     gradient's norm is the square root of its shards' sums of squares summed over the
#     replicas (another summation order: close, not bit for bit). The total norm before
#     clipping, clip_grad_norm_'s return value, is kept for ``Trainer.last_grad_norm``.


def _norm(g):
    return torch.linalg.vector_norm(g)


def _sharded_norm(total_sq, *, dtype: torch.dtype):
    return total_sq.sqrt().to(dtype)


def _total_norm(*norms):
    # Note [gradient clipping as torch rounds it]
    return torch.linalg.vector_norm(torch.stack(norms))


def _clip_coefficient(total, *, max_norm: float):
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _scale(g, coef):
    return g * coef.to(g.dtype)


def _count_factor(total, *, bound: int):
    # float64, rounded once (Note [exact losses over micro-batches]); a batch that counts
    # nothing has zero gradients, as eager's mean over nothing (a NaN loss) gives: a count of
    # 0 gives a finite factor that multiplies zero gradients
    return (float(bound) / total.double().clamp_min(1e-20)).to(total.dtype)


def _rescale(g, factor):
    return (_f(g) * factor).to(g.dtype)
