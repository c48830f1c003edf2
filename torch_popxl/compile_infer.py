"""``popxl.compile`` without an optimizer: the inference program (a program per input
signature, split over the replicas).

Note [the nested-tensor path of TransformerEncoder]
    In eval mode with a ``src_key_padding_mask`` (and no gradient to record, fast-path
    kernels enabled, no ``mask``, ...), ``nn.TransformerEncoder.forward`` runs its layers on
    a nested tensor of the unpadded positions and pads the result with zeros, before its
    final ``norm``: eager's outputs at padded positions are then 0 (or the norm of 0), where
    the layers on the padded batch (the slow path, which the captured graph records: under
    capture torch sees its modes and declines the fast path) compute values there; the
    positions that are not padding agree. So while an inference program is captured, every
    ``TransformerEncoder`` of the model asks torch whether it would take that path for this
    call: a copy of it runs eagerly, with capture's modes set aside, on a tiny batch with a
    left-aligned padding mask of the call's dtype (and a ``mask`` and ``is_causal`` where the
    call has them), once as the fast path is set and once with it disabled; the outputs at the
    padded position differ (beyond the rounding of the layers' fused kernels) only where
    torch took the nested path. Where it would, the
    captured graph sets the last layer's outputs at padded positions to 0 (the final norm
    follows as in eager) when the call's mask is left-aligned (torch's ``mask_check``; a
    batch split over replicas checks each replica's rows). The decision depends on the grad
    mode and on ``torch.backends.mha.get_fastpath_enabled()``, so both are part of the
    program's key. (A Trainer's forward records a gradient: the slow path, as in eager.)
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from . import ops
from .capture import call_torch
from .compile_common import (
    _MAX_PROGRAMS,
    _attributes_restored,
    _check_positive,
    _h2d,
    _host,
    _pad_rows,
    _structured,
    _without_caches,
    as_host_dtype,
    host_float,
    options_key,
)
from .dtypes import dtype as _dtype
from .dtypes import numpy_to_torch
from .ir.context import in_sequence
from .ir.streams import DeviceToHostStream, d2h_stream
from .ir.tensor import Tensor, variable
from .runtime import distributed as _distributed
from .runtime.session import Session, check_backend, resolve_device


class InferenceProgram:
    """A compiled inference program: ``program(inputs) -> outputs`` (split over replicas).

    ``inputs`` is a tensor, a tuple/list of tensors (positional arguments of ``forward``) or a
    dict (keyword arguments), each split on dim 0; the result has the model's structure. The
    program reads the module's current parameters and buffers at every call (Note [live
    torch tensors]), also while a Trainer trains the module.
    """

    def __init__(self, model: torch.nn.Module, replication_factor: int = 1,
                 device: str | torch.device | None = None, executor: str = "fast",
                 backend: str = "default"):  # fmt: skip
        _check_positive("replication_factor", replication_factor)
        self.device = resolve_device(device)
        self.model = model
        self.replication_factor = replication_factor
        self.executor = executor
        self.backend = check_backend(backend, executor)
        self.ir = None
        self.session = None
        # (training, input signature) -> (ir, session, ...), least recently used first
        self._programs: dict[tuple, tuple] = {}
        self.max_programs = _MAX_PROGRAMS

    @property
    def programs(self) -> tuple[tuple[bool, str], ...]:
        """The programs built and kept, least recently used first: (training mode, input
        shapes); at most ``max_programs``."""
        return tuple(
            (k[0], ", ".join(f"{tuple(s)} {d}" for s, d in k[1]) + "".join(
                f", {n}={tuple(s)} {d}" for n, s, d in k[2]) + "".join(
                f", {n}={v!r}" for n, _, v in k[4]))
            for k in self._programs
        )  # fmt: skip

    def _build(self, args: list[np.ndarray], kwargs: dict[str, np.ndarray], in_spec,
               options: tuple[tuple[str, Any], ...]) -> tuple:  # fmt: skip
        R = _distributed.local_replicas(self.replication_factor)
        ir = _distributed.make_ir(self.replication_factor)
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        with ir.main_graph, in_sequence(True):
            streams = [
                _h2d((a.shape[0] // R, *a.shape[1:]), a.dtype, f"inputs/{i}")
                for i, a in enumerate([*args, *kwargs.values()])
            ]
            tensors = {n: variable(_host(t), _dtype.as_dtype(t.dtype), name=n)
                       for n, t in [*params.items(), *buffers.items()]}  # fmt: skip
            loaded = [as_host_dtype(ops.host_load(st, f"x{i}"), a.dtype)
                      for i, (st, a) in enumerate(zip(streams, [*args, *kwargs.values()],
                                                      strict=True))]  # fmt: skip
            a_in, k_in = pytree.tree_unflatten(loaded, in_spec)  # Note [nested inputs]
            k_in = {**k_in, **dict(options)}  # Note [keyword options]
            with _attributes_restored(self.model), _nested_paths_as_eager(self.model):
                y = call_torch(
                    torch.func.functional_call, (self.model, tensors, tuple(a_in), k_in), {}
                )
            leaves, spec = pytree.tree_flatten(_without_caches(y))
            bad = [type(v).__name__ for v in leaves if not isinstance(v, Tensor) and v is not None]
            if bad:
                raise TypeError(
                    f"popxl.compile: the model returned non-tensor outputs ({bad}); an inference "
                    "program returns tensors (in a tuple, list or dict)."
                )
            if R > 1:
                _check_per_sample(leaves, spec, streams[0].shape[0] if streams else 0, R)
            out_streams: list[DeviceToHostStream | None] = []
            for i, v in enumerate(leaves):
                if v is None:
                    out_streams.append(None)
                    continue
                out_streams.append(d2h_stream(v.shape, v.dtype, f"outputs/{i}"))
                ops.host_store(out_streams[-1], v)
        session = Session(
            ir, "ipu_hw", device=self.device, executor=self.executor, backend=self.backend
        )
        session.__enter__()
        copied = []
        for n, t in [*params.items(), *buffers.items()]:
            if ir._num_instances > 1 or not session._bind_variable(tensors[n], t.detach()):
                copied.append((tensors[n], t))
        return ir, session, streams, out_streams, spec, copied

    def explain(self) -> list[str]:
        """What of the program runs on a slow path and why (``Session.explain``); an empty
        list when all of it runs on the fast path."""
        if self.session is None:
            raise ValueError("explain(): no program yet; it is built by the first call.")
        return self.session.explain()

    def __call__(self, inputs):
        args, kwargs, in_spec, options = _structured(inputs, "inputs", host_float(self.model))
        arrays = [*args, *kwargs.values()]
        R = _distributed.local_replicas(self.replication_factor)  # this instance's share
        n = arrays[0].shape[0]
        if R > 1 and any(a.shape[0] != n for a in arrays):  # Note [the batch is dim 0]
            raise ValueError(
                f"all inputs must have the same batch size; got {[a.shape[0] for a in arrays]}. "
                f"With replication_factor={R} every input is cut on dim 0: give them "
                "batch-first (a time-major model in a batch-first wrapper: docs/compile.md, "
                "'Structured inputs and time-major models')."
            )
        training = self.model.training  # selects the program, as in eager (dropout, BatchNorm)
        if n == 0:
            raise ValueError("popxl.compile: an inference batch needs at least one sample.")
        padded = -(-n // R) * R
        if padded != n:
            if training:  # padding rows would join the batch statistics (BatchNorm)
                raise ValueError(
                    f"popxl.compile: a batch of {n} samples does not split over "
                    f"replication_factor={R} replicas in train mode; give a multiple of {R} "
                    "(in eval mode any batch size runs). Nothing was changed."
                )
            # eval mode: rows are independent; copies of the last row fill the replicas and
            # their outputs are dropped (Note [a program per input signature])
            args = [_pad_rows(a, padded) for a in args]
            kwargs = {k: _pad_rows(a, padded) for k, a in kwargs.items()}
            arrays = [*args, *kwargs.values()]
        key = (
            training,
            tuple((a.shape, a.dtype) for a in args),
            tuple((k, a.shape, a.dtype) for k, a in kwargs.items()),
            in_spec,
            options_key(options),
            # Note [the nested-tensor path of TransformerEncoder]
            (torch.is_grad_enabled(), torch.backends.mha.get_fastpath_enabled()),
        )
        built = self._programs.pop(key, None)
        if built is None:
            built = self._build(args, kwargs, in_spec, options)
        self._programs[key] = built  # the most recently used last
        while len(self._programs) > max(self.max_programs, 1):
            del self._programs[next(iter(self._programs))]
        ir, session, streams, out_streams, spec, copied = built
        self.ir, self.session = ir, session
        for var, t in copied:  # not bound: the module's current values, every call
            session._set_device_value(var, t.detach())
        feed = {
            st: (a.reshape(R, a.shape[0] // R, *a.shape[1:]) if R > 1 else a)
            for st, a in zip(streams, arrays, strict=True)
        }
        # the arrays are narrowed already, float64 ones only for float64-free models (Note
        # [float64 models])
        out = session.run(feed, downcast_inputs=False)
        leaves = []
        for st in out_streams:
            if st is None:  # a dropped key/value cache
                leaves.append(None)
                continue
            o = numpy_to_torch(out[st], st.dtype)
            if R > 1 and o.ndim >= 2:  # [R, micro, ...] -> [batch, ...]
                o = o.reshape(padded, *o.shape[2:])
            if padded != n and o.ndim and o.shape[0] == padded:
                o = o[:n]
            leaves.append(o)
        return pytree.tree_unflatten(leaves, spec)


def _check_per_sample(leaves, spec, rows: int, R: int) -> None:
    """Every output has a row per sample of the replica's ``rows`` (Note [the batch is dim
    0]), so the replicas' outputs put together are eager's on the whole batch; a value the
    model reduces over the batch (a loss, a statistic) has no such parts: refused, naming it."""
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten(list(range(len(leaves))), spec))[0]]  # fmt: skip
    for path, v in zip(paths, leaves, strict=True):
        if v is not None and (not v.shape or v.shape[0] != rows):
            raise ValueError(
                f"popxl.compile: the model's output{path or ''} has shape {list(v.shape)} on "
                f"each replica's {rows} rows, not one row per sample (a loss or a statistic "
                f"the forward reduces over the batch); with replication_factor={R} the "
                "replicas' values cannot be put together as eager's. Return per-sample values "
                "and reduce them after the call (for Hugging Face models: leave out `labels` "
                "and compute the loss from the logits), or compile with replication_factor=1."
            )


# ---- Note [the nested-tensor path of TransformerEncoder] ----------------------------------


def _takes_nested_path(encoder: torch.nn.TransformerEncoder, src, mask, pad, is_causal) -> bool:
    """Whether eager torch runs ``encoder`` on a nested tensor for a call like this one (a
    copy of it on a tiny batch, with and without the fast path, outside capture)."""
    first = encoder.layers[0]
    batch_first = first.self_attn.batch_first
    d_model = first.self_attn.embed_dim
    gen = torch.Generator().manual_seed(0)
    # (torch warns that nested tensors are a prototype: the probe's, not the user's)
    with _disable_current_modes(), torch._C.DisableTorchFunction(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = torch.randn(2, 3, d_model, generator=gen, dtype=src.dtype)
        x = x if batch_first else x.transpose(0, 1)
        padded = torch.tensor([[False, False, True], [False, False, False]])
        key_mask = padded if pad.dtype == torch.bool else torch.zeros(2, 3, dtype=pad.dtype)
        if pad.dtype != torch.bool:
            key_mask = key_mask.masked_fill(padded, float("-inf"))
        attn = None
        if mask is not None:  # causal where the call says so (the layers' kernels trust it)
            causal = torch.ones(3, 3, dtype=torch.bool).triu(1) & bool(is_causal)
            fill = True if mask.dtype == torch.bool else float("-inf")
            attn = torch.zeros(3, 3, dtype=mask.dtype).masked_fill(causal, fill)
        enabled = torch.backends.mha.get_fastpath_enabled()
        outs = []
        try:
            for fast in (enabled, False):  # (as the user set it, and disabled)
                torch.backends.mha.set_fastpath_enabled(fast)
                y = encoder(x, mask=attn, src_key_padding_mask=key_mask, is_causal=is_causal)
                outs.append(y[0, 2] if batch_first else y[2, 0])
        finally:
            torch.backends.mha.set_fastpath_enabled(enabled)
        # the nested path's zeros (or their norm) against the layers' values; the layers' own
        # fused kernels differ from their ops by rounding only
        return not torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@contextlib.contextmanager
def _nested_paths_as_eager(model: torch.nn.Module) -> Iterator[None]:
    """Note [the nested-tensor path of TransformerEncoder]: while inside, each encoder's last
    layer gives 0 at padded positions where eager torch would."""
    encoders = [m for m in model.modules() if isinstance(m, torch.nn.TransformerEncoder)]
    if not encoders:
        yield
        return
    pending: dict[int, Any] = {}  # id(last layer) -> (padded positions, left-aligned, batch_first)
    # real copies to ask torch with (inside the capture the module holds fake tensors)
    copies = {id(e): copy.deepcopy(e) for e in encoders}

    def before(encoder, args, kwargs):
        call = dict(zip(("src", "mask", "src_key_padding_mask", "is_causal"), args,
                        strict=False)) | kwargs  # fmt: skip
        src, pad = call.get("src"), call.get("src_key_padding_mask")
        if pad is None or src is None or src.dim() != 3:
            return
        if not _takes_nested_path(copies[id(encoder)], src, call.get("mask"), pad,
                                  call.get("is_causal")):  # fmt: skip
            return
        padded = pad if pad.dtype == torch.bool else pad != 0
        aligned = (
            (padded[:, 1:] >= padded[:, :-1]).all()
            if getattr(encoder, "mask_check", True)
            else torch.ones((), dtype=torch.bool)
        )
        batch_first = encoder.layers[0].self_attn.batch_first
        pending[id(encoder.layers[-1])] = (padded, aligned, batch_first)

    def after(layer, _args, out):
        found = pending.pop(id(layer), None)
        if found is None:
            return out
        padded, aligned, batch_first = found
        at = (padded if batch_first else padded.transpose(0, 1)).unsqueeze(-1) & aligned
        return torch.where(at, torch.zeros_like(out), out)

    hooks = []
    try:
        for e in encoders:
            hooks.append(e.register_forward_pre_hook(before, with_kwargs=True))
            hooks.append(e.layers[-1].register_forward_hook(after))
        yield
    finally:
        for h in hooks:
            h.remove()
