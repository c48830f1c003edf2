"""``popxl.compile``: a ``torch.nn.Module`` to a replicated, sharded, off-chip PopXL program.

The program is written with the public low-level API only, the way an IPU programmer would
write it by hand:

* every parameter and buffer is a ``popxl.variable``; every parameter has a gradient
  accumulator;
* the forward is the module run on the graph's inputs (``torch.func.functional_call`` under
  capture) followed by ``loss_fn``; ``popxl.transforms.autodiff`` builds the backward from
  ``torch.autograd``;
* a ``repeat`` over ``gradient_accumulation`` micro-batches loads each micro-batch from the
  host, runs forward and backward and accumulates the gradients;
* the gradients are then mean-reduced over the replicas (all-reduce, or reduce-scatter when
  the optimizer state is sharded) and the optimizer update runs with exactly the torch
  optimizer's formulas. Sharded state (RTS, ZeRO-1 style) updates one shard of every large
  parameter per replica and all-gathers the result; off-chip state lives in remote buffers and
  is loaded and stored around the update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import ops
from . import remote as _remote
from .capture import call_torch
from .dtypes import dtype as _dtype
from .ir.context import in_sequence
from .ir.ir import Ir
from .ir.remote_buffer import remote_buffer
from .ir.streams import d2h_stream, h2d_stream
from .ir.tensor import Tensor, constant, graph_input, graph_output, variable
from .runtime import distributed as _distributed
from .runtime.session import Session
from .transforms.autodiff import autodiff

__all__ = ["compile", "Trainer", "InferenceProgram"]

_STATE = ("on_chip", "remote")


# ---- optimizers: torch's formulas, written as in-place torch ops ------------------------


@dataclass(frozen=True)
class _Hyper:
    kind: str  # "sgd" | "adam" | "adamw"
    lr: float
    weight_decay: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    @property
    def state_names(self) -> tuple[str, ...]:
        if self.kind == "sgd":
            return ("momentum_buffer",) if self.momentum else ()
        return ("exp_avg", "exp_avg_sq")


def _hyper_for_groups(
    optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]
) -> dict[str, _Hyper]:
    by_id = {id(p): n for n, p in params.items()}
    out: dict[str, _Hyper] = {}
    for group in optimizer.param_groups:
        hyper = _hyper(optimizer, group)
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(
                    "popxl.compile: the optimizer holds a parameter that is not a parameter of the "
                    "model. Build the optimizer from model.parameters()."
                )
            out[by_id[id(p)]] = hyper
    missing = [n for n in params if n not in out]
    if missing:
        raise ValueError(
            f"popxl.compile: parameters {missing} are not in the optimizer; they would never train."
        )
    return out


def _hyper(optimizer, group) -> _Hyper:
    if isinstance(optimizer, torch.optim.AdamW) or type(optimizer).__name__ == "AdamW":
        kind = "adamw"
    elif isinstance(optimizer, torch.optim.Adam):
        kind = "adam"
    elif isinstance(optimizer, torch.optim.SGD):
        kind = "sgd"
    else:
        raise TypeError(
            f"popxl.compile supports torch.optim.SGD, Adam and AdamW; got {type(optimizer).__name__}."
        )
    lr = float(group["lr"])
    if kind == "sgd":
        if group.get("nesterov") and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                "Nesterov momentum needs momentum > 0 and dampening == 0 (as in torch)."
            )
        if group.get("maximize"):
            raise ValueError("popxl.compile does not support maximize=True.")
        return _Hyper("sgd", lr, float(group["weight_decay"]), float(group["momentum"]),
                      float(group["dampening"]), bool(group["nesterov"]))  # fmt: skip
    if group.get("amsgrad") or group.get("maximize"):
        raise ValueError(
            "popxl.compile does not support amsgrad=True or maximize=True for Adam/AdamW."
        )
    b1, b2 = group["betas"]
    return _Hyper(
        kind,
        lr,
        float(group["weight_decay"]),
        beta1=float(b1),
        beta2=float(b2),
        eps=float(group["eps"]),
    )


def _sgd_update(p, g, step, *state, h: _Hyper):
    d_p = g
    if h.weight_decay:
        d_p = d_p + p * h.weight_decay
    if h.momentum:
        (buf,) = state
        # torch initialises the buffer with the first gradient (no dampening on step 1).
        new = buf * h.momentum + d_p * (1.0 - h.dampening)
        buf.copy_(torch.where(step == 0, d_p, new))
        d_p = d_p + buf * h.momentum if h.nesterov else buf
    p.add_(d_p, alpha=-h.lr)


def _adam_update(p, g, step, exp_avg, exp_avg_sq, h: _Hyper):
    t = step + 1.0
    if h.kind == "adamw":
        p.mul_(1.0 - h.lr * h.weight_decay)
    elif h.weight_decay:
        g = g + p * h.weight_decay
    # torch's formulas; out-of-place + copy_ because vmap has no batching rule for
    # lerp_ / addcmul_ (it would fall back to a slow per-replica loop).
    exp_avg.copy_(torch.lerp(exp_avg, g, 1.0 - h.beta1))
    exp_avg_sq.copy_(torch.addcmul(exp_avg_sq * h.beta2, g, g, value=1.0 - h.beta2))
    bias_correction1 = 1.0 - torch.pow(h.beta1, t)
    bias_correction2 = 1.0 - torch.pow(h.beta2, t)
    step_size = h.lr / bias_correction1
    denom = exp_avg_sq.sqrt() / bias_correction2.sqrt() + h.eps
    p.sub_(exp_avg / denom * step_size)


def _optimizer_update(p: Tensor, g: Tensor, step: Tensor, state: list[Tensor], h: _Hyper) -> None:
    fn = _sgd_update if h.kind == "sgd" else _adam_update
    call_torch(fn, (p, g, step, *state), {"h": h})


# ---- the trainer --------------------------------------------------------------------------


@dataclass
class _Slot:
    """One parameter: its variable, accumulator and optimizer state placement."""

    name: str
    var: Any
    accum: Any
    hyper: _Hyper
    sharded: bool
    state: dict[str, Any]  # name -> Variable handle (host side)
    shards: dict[str, Any]  # name -> on-device shard tensor (replica_sharded_variable)
    buffers: dict[str, Any]  # name -> RemoteBuffer (remote state)


class Trainer:
    """A compiled training program. ``step(inputs, targets)`` runs one optimizer step."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 replication_factor: int = 1, gradient_accumulation: int = 1,
                 rts_threshold: int | None = None, optimizer_state: str = "on_chip",
                 device: str = "cpu", executor: str = "fast"):  # fmt: skip
        _check_positive("replication_factor", replication_factor)
        _check_positive("gradient_accumulation", gradient_accumulation)
        if optimizer_state not in _STATE:
            raise ValueError(
                f"optimizer_state must be 'on_chip' or 'remote'; got {optimizer_state!r}."
            )
        if rts_threshold is not None and (not isinstance(rts_threshold, int) or rts_threshold < 1):
            raise ValueError(
                f"rts_threshold must be a positive int or None; got {rts_threshold!r}."
            )
        if not callable(loss_fn):
            raise TypeError(
                "popxl.compile: loss_fn must be callable as loss_fn(output, target) -> scalar."
            )
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.replication_factor = replication_factor
        self.gradient_accumulation = gradient_accumulation
        self.rts_threshold = rts_threshold
        self.optimizer_state = optimizer_state
        self.device = device
        self.executor = executor
        self._params = dict(model.named_parameters())
        self._buffers = dict(model.named_buffers())
        self._hyper = _hyper_for_groups(optimizer, self._params)
        self.ir: Ir | None = None
        self.session: Session | None = None
        self._shapes = None
        self._dirty = False
        self._pending: dict[str, Any] | None = None  # load_state_dict before the first step
        _install_lazy_sync(model, self)

    # ---- building -------------------------------------------------------------------------

    def _shard(self, numel: int) -> bool:
        return (
            self.rts_threshold is not None
            and self.replication_factor > 1
            and numel >= self.rts_threshold
        )

    def _build(self, x: np.ndarray, t: np.ndarray) -> None:
        R, GA = self.replication_factor, self.gradient_accumulation
        micro = x.shape[0] // (_distributed.local_replicas(R) * GA)
        self._target_dtype = t.dtype
        ir = _distributed.make_ir(R)
        ir.num_host_transfers = GA
        with ir.main_graph, in_sequence(True):
            x_stream = _h2d((micro, *x.shape[1:]), x.dtype, "inputs")
            t_stream = _h2d((micro, *t.shape[1:]), t.dtype, "targets")
            loss_stream = None
            slots = [self._make_slot(n, p) for n, p in self._params.items()]
            buffer_vars = {
                n: variable(_host(b), _dtype.as_dtype(b.dtype), name=n)
                for n, b in self._buffers.items()
            }
            step = variable(np.zeros((), np.float32), name="optimizer_step")

            fwd = self._forward_graph(ir, x_stream, t_stream)
            n_params = len(slots)
            param_inputs = list(fwd.inputs[2 : 2 + n_params])
            bwd = autodiff(
                fwd,
                grads_provided=fwd.outputs[:1],
                grads_required=param_inputs,
                _allow_modifying=True,
            )

            body = ir.create_empty_graph("micro_batch")
            with body:
                accs = [
                    graph_input(s.accum.shape, s.accum.dtype, f"accum/{s.name}", by_ref=True)
                    for s in slots
                ]
                ps = [graph_input(s.var.shape, s.var.dtype, s.name) for s in slots]
                bs = [graph_input(v.shape, v.dtype, n, by_ref=True) for n, v in buffer_vars.items()]
                xb, tb = ops.host_load(x_stream, "x"), ops.host_load(t_stream, "target")
                info = ops.call_with_info(fwd, xb, tb, *ps, *bs)
                loss = info.outputs[0]
                # d(loss / GA): accumulating GA micro-batch gradients gives their mean.
                seed = constant(np.float32(1.0 / GA), loss.dtype, "loss_grad")
                grads = ops.call(bwd.graph, seed, inputs_dict=bwd.inputs_dict(info))
                for acc, g in zip(accs, grads, strict=True):
                    ops.var_updates.accumulate_(acc, g)
                loss_stream = d2h_stream(loss.shape, loss.dtype, "loss")
                ops.host_store(loss_stream, loss)
            ops.repeat(
                body, GA, *[s.accum for s in slots], *[s.var for s in slots], *buffer_vars.values()
            )

            for s in slots:
                self._update(s, step, R)
            ops.var_updates.accumulate_(step, constant(np.float32(1.0)))
        self.ir, self._slots, self._buffer_vars, self._step_var = ir, slots, buffer_vars, step
        self._streams = (x_stream, t_stream, loss_stream)
        self._shapes = (x.shape, x.dtype, t.shape, t.dtype)
        self.session = Session(ir, "ipu_hw", device=self.device, executor=self.executor)
        self.session.__enter__()
        if self._pending is not None:  # a checkpoint loaded before the program existed
            state, self._pending = self._pending, None
            self.load_state_dict(state)

    def _make_slot(self, name: str, p: torch.nn.Parameter) -> _Slot:
        data = _host(p)
        dt = _dtype.as_dtype(p.dtype)
        var = variable(data, dt, name=name)
        accum = variable(np.zeros_like(data), dt, name=f"accum/{name}")
        # Only summed over replicas by the update's reduction: the fast executor may keep it
        # as that sum (Note [replica-sum accumulators] in runtime/lower.py).
        accum._set_hints(replica_sum=True)
        hyper = self._hyper[name]
        sharded = self._shard(data.size)
        state, shards, buffers = {}, {}, {}
        for sname in hyper.state_names:
            zeros = np.zeros_like(data)
            vname = f"{sname}/{name}"
            if sharded and self.optimizer_state == "remote":
                buf = _remote.replica_sharded_buffer(zeros.shape, dt)
                state[sname] = _remote.remote_replica_sharded_variable(
                    zeros, buf, 0, dt, name=vname
                )
                buffers[sname] = buf
            elif sharded:
                state[sname], shards[sname] = _remote.replica_sharded_variable(
                    zeros, dt, name=vname
                )
            elif self.optimizer_state == "remote":
                buf = remote_buffer(zeros.shape, dt, 1)
                state[sname] = _remote.remote_variable(zeros, buf, 0, dt, name=vname)
                buffers[sname] = buf
            else:
                state[sname] = variable(zeros, dt, name=vname)
        return _Slot(name, var, accum, hyper, sharded, state, shards, buffers)

    def _forward_graph(self, ir: Ir, x_stream, t_stream):
        graph = ir.create_empty_graph("forward")
        with graph:
            x = graph_input(x_stream.shape, x_stream.dtype, "x")
            t = graph_input(t_stream.shape, t_stream.dtype, "target")
            params = {
                n: graph_input(p.shape, _dtype.as_dtype(p.dtype), n)
                for n, p in self._params.items()
            }
            bufs = {
                n: graph_input(b.shape, _dtype.as_dtype(b.dtype), n, by_ref=True)
                for n, b in self._buffers.items()
            }
            out = call_torch(torch.func.functional_call, (self.model, {**params, **bufs}, (x,)), {})
            if self._target_dtype == np.int64:  # streamed as int32 (PopXL downcasts host data)
                t = call_torch(torch.Tensor.long, (t,), {})
            loss = call_torch(self.loss_fn, (out, t), {})
            if not isinstance(loss, Tensor) or loss.shape != ():
                raise ValueError(
                    f"popxl.compile: loss_fn must return a scalar tensor; got "
                    f"{getattr(loss, 'shape', type(loss).__name__)}."
                )
            graph_output(loss)
        return graph

    def _update(self, s: _Slot, step, R: int) -> None:
        if s.sharded:
            g = ops.collectives.replicated_reduce_scatter(
                s.accum, "mean", configure_output_for_replicated_tensor_sharding=True)  # fmt: skip
            p_shard = ops.collectives.replica_sharded_slice(s.var)
            state = self._load_state(s)
            _optimizer_update(p_shard, g, step, state, s.hyper)
            self._store_state(s, state)
            full = ops.collectives.replicated_all_gather(p_shard)
            ops.var_updates.copy_var_update_(s.var, full)
        else:
            g = ops.collectives.replicated_all_reduce(s.accum, "mean") if R > 1 else s.accum
            state = self._load_state(s)
            _optimizer_update(s.var, g, step, state, s.hyper)
            self._store_state(s, state)
        ops.var_updates.accumulator_zero_(s.accum)

    def _load_state(self, s: _Slot) -> list[Tensor]:
        out = []
        for name in s.hyper.state_names:
            if name in s.buffers:
                out.append(ops.remote_load(s.buffers[name], 0, f"{name}/{s.name}"))
            elif name in s.shards:
                out.append(s.shards[name])
            else:
                out.append(s.state[name])
        return out

    def _store_state(self, s: _Slot, state: list[Tensor]) -> None:
        for name, t in zip(s.hyper.state_names, state, strict=True):
            if name in s.buffers:
                ops.remote_store(s.buffers[name], 0, t)

    # ---- running --------------------------------------------------------------------------

    def _split(self, a: np.ndarray) -> np.ndarray:
        R, GA = _distributed.local_replicas(self.replication_factor), self.gradient_accumulation
        micro = a.shape[0] // (R * GA)
        a = a.reshape(GA, R, micro, *a.shape[1:])
        if R == 1:
            a = a[:, 0]
        if GA == 1:
            a = a[0]
        return a

    def step(self, inputs, targets) -> float:
        """One optimizer step on a global batch of ``R * GA * micro`` samples; returns the loss.

        Under torchrun every process passes its own share, the ``R/W * GA * micro`` samples of
        its local replicas; the returned loss is the mean over all instances.
        """
        x, t = _array(inputs, "inputs"), _array(targets, "targets")
        R, GA = _distributed.local_replicas(self.replication_factor), self.gradient_accumulation
        if x.shape[0] != t.shape[0]:
            raise ValueError(f"inputs have {x.shape[0]} samples but targets have {t.shape[0]}.")
        if x.shape[0] == 0 or x.shape[0] % (R * GA):
            raise ValueError(
                f"The global batch of {x.shape[0]} samples must be a positive multiple of "
                f"replication_factor * gradient_accumulation = {R} * {GA} = {R * GA}."
            )
        if self.ir is None:
            self._build(x, t)
        elif (x.shape, x.dtype, t.shape, t.dtype) != self._shapes:
            raise ValueError(
                f"popxl.compile programs have static shapes: the first step used inputs "
                f"{self._shapes[0]} {self._shapes[1]} and targets {self._shapes[2]} {self._shapes[3]}; "
                f"this step got {x.shape} {x.dtype} and {t.shape} {t.dtype}."
            )
        x_stream, t_stream, loss_stream = self._streams
        out = self.session.run({x_stream: self._split(x), t_stream: self._split(t)})
        self._dirty = True
        return _distributed.mean_over_instances(float(np.mean(out[loss_stream])))

    # ---- state ----------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Copy the trained parameters and buffers back into ``model``."""
        if self.session is None or not self._dirty:
            return
        self._dirty = False
        handles = [s.var for s in self._slots] + list(self._buffer_vars.values())
        data = self.session.get_tensors_data(handles)
        with torch.no_grad():
            for s in self._slots:
                self._params[s.name].copy_(torch.from_numpy(np.array(data[s.var])))
            for n, v in self._buffer_vars.items():
                value = data[v]
                self._buffers[n].copy_(torch.from_numpy(np.array(value)))
        self._dirty = False

    def state_dict(self) -> dict[str, Any]:
        """Torch-style state: ``{"model": ..., "optimizer": {"state": {name: {...}}, "step": n}}``.

        Sharded and off-chip state is returned unsharded (full tensors).
        """
        self.sync_weights()
        out = {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()}}
        opt: dict[str, Any] = {"state": {}, "step": 0}
        if self.session is not None:
            handles = [v for s in self._slots for v in s.state.values()] + [self._step_var]
            data = self.session.get_tensors_data(handles)
            for s in self._slots:
                opt["state"][s.name] = {
                    k: torch.from_numpy(np.array(data[v])) for k, v in s.state.items()
                }
            opt["step"] = int(data[self._step_var])
        out["optimizer"] = opt
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint made by ``state_dict`` (sharded or not)."""
        if "model" not in state or "optimizer" not in state:
            raise ValueError("load_state_dict expects the dict returned by Trainer.state_dict().")
        self.model.load_state_dict(state["model"])
        if self.session is None:  # applied when the first step builds the program
            self._pending = state
            return
        writes = {}
        for s in self._slots:
            writes[s.var] = _host(self._params[s.name]).astype(s.var.dtype.as_numpy())
            for k, v in s.state.items():
                writes[v] = np.array(state["optimizer"]["state"][s.name][k].detach().cpu().numpy(),
                                     dtype=v.dtype.as_numpy())  # fmt: skip
        for n, v in self._buffer_vars.items():
            writes[v] = np.array(_host(self._buffers[n]), dtype=v.dtype.as_numpy())
        writes[self._step_var] = np.array(state["optimizer"]["step"], dtype=np.float32)
        self.session.write_variables_data(writes)
        self._dirty = False

    def memory_report(self, cost_model=None):
        if self.session is None:
            raise ValueError(
                "memory_report() is available after the first step (the program is built then)."
            )
        return (
            self.session.memory_report(cost_model)
            if cost_model is not None
            else self.session.memory_report()
        )


class InferenceProgram:
    """A compiled inference program: ``program(inputs) -> outputs`` (split over replicas)."""

    def __init__(self, model: torch.nn.Module, replication_factor: int = 1, device: str = "cpu",
                 executor: str = "fast"):  # fmt: skip
        _check_positive("replication_factor", replication_factor)
        self.model = model
        self.replication_factor = replication_factor
        self.device = device
        self.executor = executor
        self.ir = None
        self.session = None
        self._shape = None

    def _build(self, x: np.ndarray) -> None:
        R = _distributed.local_replicas(self.replication_factor)
        ir = _distributed.make_ir(self.replication_factor)
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        with ir.main_graph, in_sequence(True):
            x_stream = _h2d((x.shape[0] // R, *x.shape[1:]), x.dtype, "inputs")
            pv = {
                n: variable(_host(p), _dtype.as_dtype(p.dtype), name=n) for n, p in params.items()
            }
            bv = {
                n: variable(_host(b), _dtype.as_dtype(b.dtype), name=n) for n, b in buffers.items()
            }
            xt = ops.host_load(x_stream, "x")
            y = call_torch(torch.func.functional_call, (self.model, {**pv, **bv}, (xt,)), {})
            y_stream = d2h_stream(y.shape, y.dtype, "outputs")
            ops.host_store(y_stream, y)
        self.ir, self._streams, self._shape = ir, (x_stream, y_stream), (x.shape, x.dtype)
        self.session = Session(ir, "ipu_hw", device=self.device, executor=self.executor)
        self.session.__enter__()

    def __call__(self, inputs) -> torch.Tensor:
        x = _array(inputs, "inputs")
        R = _distributed.local_replicas(self.replication_factor)  # this instance's share
        if x.shape[0] == 0 or x.shape[0] % R:
            raise ValueError(
                f"The batch of {x.shape[0]} samples must be a positive multiple of replication_factor={R}."
            )
        if self.ir is None:
            self._build(x)
        elif (x.shape, x.dtype) != self._shape:
            raise ValueError(
                f"popxl.compile programs have static shapes: built for {self._shape}, got {(x.shape, x.dtype)}."
            )
        x_stream, y_stream = self._streams
        feed = x.reshape(R, x.shape[0] // R, *x.shape[1:]) if R > 1 else x
        out = self.session.run({x_stream: feed})[y_stream]
        return torch.from_numpy(np.array(out).reshape(x.shape[0], *out.shape[2 if R > 1 else 1 :]))


def compile(model: torch.nn.Module, loss_fn: Callable | None = None, optimizer: torch.optim.Optimizer | None = None,
            *, replication_factor: int = 1, gradient_accumulation: int = 1, rts_threshold: int | None = None,
            optimizer_state: str = "on_chip", device: str = "cpu", executor: str = "fast"):  # fmt: skip
    """Compile ``model`` into a PopXL program.

    With ``loss_fn`` and ``optimizer`` the result is a :class:`Trainer`; without them an
    :class:`InferenceProgram`. See the README section "popxl.compile".
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"popxl.compile expects a torch.nn.Module; got {type(model).__name__}.")
    if (loss_fn is None) != (optimizer is None):
        raise ValueError(
            "popxl.compile: give both loss_fn and optimizer for training, or neither for inference."
        )
    if optimizer is None:
        if gradient_accumulation != 1 or rts_threshold is not None or optimizer_state != "on_chip":
            raise ValueError(
                "gradient_accumulation, rts_threshold and optimizer_state only apply to training."
            )
        return InferenceProgram(model, replication_factor, device, executor)
    return Trainer(model, loss_fn, optimizer, replication_factor, gradient_accumulation, rts_threshold,
                   optimizer_state, device, executor)  # fmt: skip


# ---- helpers ------------------------------------------------------------------------------

_SYNC_ON = frozenset({"_parameters", "_buffers", "_modules", "state_dict", "parameters",
                      "named_parameters", "buffers", "named_buffers", "forward", "__call__"})  # fmt: skip


def _install_lazy_sync(model: torch.nn.Module, trainer: Trainer) -> None:
    """Make ``model`` pull trained weights from the session when its tensors are read.

    The model's class is swapped for a subclass whose attribute access syncs first (only
    when a step ran since the last sync), so ``model.fc.weight`` is always current.
    """
    cls = type(model)
    if getattr(cls, "_popxl_lazy_sync", False):
        cls = cls.__mro__[1]

    def __getattribute__(self, name):
        if name in _SYNC_ON:
            tr = object.__getattribute__(self, "__dict__").get("_popxl_trainer")
            if tr is not None and tr._dirty:
                tr.sync_weights()
        return cls.__getattribute__(self, name)

    model.__class__ = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "_popxl_lazy_sync": True,
                                                  "__module__": cls.__module__, "__qualname__": cls.__qualname__})  # fmt: skip
    model.__dict__["_popxl_trainer"] = trainer


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}.")


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def _array(x, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"{what} must have a batch dimension; got a scalar.")
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    return x


def _h2d(shape, np_dtype, name):
    dt = _dtype.as_dtype(np.dtype(np_dtype))
    if dt.name == "int64":  # host data is downcast to int32 (as PopXL does)
        dt = _dtype.as_dtype("int32")
    return h2d_stream(shape, dt, name)
