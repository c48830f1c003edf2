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

Note [batch-reduced outputs of an inference program]
    With replicas each replica runs the forward on its share of the batch, so an output the
    forward reduces over the batch (a validation loss from given labels, ``model(x,
    labels=y).loss``; a model's ``(logits, mse)``) would be a value per replica, not eager's
    on the whole batch. It is put together as the trainer puts its loss together (Note
    [exact losses over micro-batches] in compile_loss.py): while the forward is captured the
    loss splitter follows the batch through it and writes each such number as a combination
    of terms; each replica streams its terms (``Split.summands``: a counted mean as its
    numerator and its count, such as a token mean over the labels that are not -100) and the
    host adds them up (``add_up``): sums added, means of a fixed count averaged, a counted
    mean's numerators and counts each added and divided once. Without a gradient nothing
    needs the global count before the run, so every count is computed by the program (no
    host recipe: Note [counts computed in the forward]). A forward that pairs the samples
    of the batch (a contrastive loss over it) has terms that look right but whose parts do
    not add up, so when a program is built its first batch also runs eagerly in eval mode,
    whole and in its replicas' parts: they must add up, else the output is refused by name;
    where they add up only with divisions by the replica's rows read as means (``sum /
    x.shape[0]``: Note [a sum divided by the batch's size]) the program is captured again
    so. A reduction that is no combination of terms (``sqrt`` of a mean, a max over the
    batch) is refused by name when the program is built. A batch that does not split over
    the replicas is padded by whole replicas (each replica's share the smallest divisor of
    the batch not below ``ceil(n / R)``: 7 rows on 2 replicas run as 7 on one), whose values
    are dropped. Under torchrun each process returns the value of its own share.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from . import ops
from .capture import call_torch, values_read_by
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
    cumulative_batch_norms,
    host_float,
    loss_dtype,
    options_key,
)
from .compile_guards import GuardedReads, Guards, ValuesDiffer, first_holding, micro_batches
from .compile_loss import LossDecompositionError, LossSplitter, add_up
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
        # a signature's programs with guards, the most recently built first (Note [guarded
        # specialisation] in compile_guards.py)
        self._variants: dict[tuple, list[tuple]] = {}
        self.max_programs = _MAX_PROGRAMS
        # the structures (key without shapes) whose programs return batch-reduced outputs:
        # padded by whole replicas (Note [batch-reduced outputs of an inference program])
        self._reducing: set[tuple] = set()

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
               options: tuple[tuple[str, Any], ...], n_real: int) -> tuple:  # fmt: skip
        """The program for these inputs (``n_real`` of their rows real), captured again where its
        batch-reduced outputs add up only with divisions by the rows read as means (Note
        [batch-reduced outputs of an inference program])."""
        try:
            return self._capture(args, kwargs, in_spec, options, n_real, over_rows=False)
        except _OverRows:
            return self._capture(args, kwargs, in_spec, options, n_real, over_rows=True)

    def _capture(self, args: list[np.ndarray], kwargs: dict[str, np.ndarray], in_spec,
                 options: tuple[tuple[str, Any], ...], n_real: int, over_rows: bool
                 ) -> tuple:  # fmt: skip
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
            rows = streams[0].shape[0] if streams else 0
            reads = None
            sources = (*[("io", i) for i in range(len(loaded))], *[("tensor", n) for n in tensors])
            if R == self.replication_factor:  # Note [guarded specialisation]
                handles = (*loaded, *tensors.values())
                arrays = [*args, *kwargs.values()]
                reads = GuardedReads(
                    ir.main_graph, handles, lambda: self._values(sources, handles, arrays, R), R,
                    len(ir.main_graph._ops), n=R,
                )  # fmt: skip
            with (
                _attributes_restored(self.model),
                _nested_paths_as_eager(self.model),
                cumulative_batch_norms(self.model),  # Note [cumulative batch norm]
                values_read_by(ir.main_graph, reads) if reads else contextlib.nullcontext(),
            ):
                y, reduced = call_torch(
                    _forward,
                    (self.model, tensors, tuple(a_in), k_in),
                    {"rows": rows, "parts": R, "over_rows": over_rows,
                     "dtype": loss_dtype(self.model)},
                )  # fmt: skip
            guards = None if reads is None else reads.kept(sources)
            leaves, spec = pytree.tree_flatten(y)
            bad = [type(v).__name__ for v in leaves if not isinstance(v, Tensor) and v is not None]
            if bad:
                raise TypeError(
                    f"popxl.compile: the model returned non-tensor outputs ({bad}); an inference "
                    "program returns tensors (in a tuple, list or dict)."
                )
            out_streams: list[DeviceToHostStream | _Reduced | None] = []
            for i, v in enumerate(leaves):
                if v is None:
                    out_streams.append(None)
                elif i in reduced:  # Note [batch-reduced outputs of an inference program]
                    kinds, values, const = reduced[i]
                    parts = [d2h_stream(t.shape, t.dtype, f"outputs/{i}/{j}")
                             for j, t in enumerate(values)]  # fmt: skip
                    for st, t in zip(parts, values, strict=True):
                        ops.host_store(st, t)
                    out_streams.append(_Reduced(kinds, parts, const, v.dtype.as_torch()))
                else:
                    out_streams.append(d2h_stream(v.shape, v.dtype, f"outputs/{i}"))
                    ops.host_store(out_streams[-1], v)
        if reduced and R > 1:
            _check_parts(self.model, [*args, *kwargs.values()], in_spec, options, n_real, rows,
                         over_rows)  # fmt: skip
        session = Session(
            ir, "ipu_hw", device=self.device, executor=self.executor, backend=self.backend
        )
        session.__enter__()
        copied = []
        for n, t in [*params.items(), *buffers.items()]:
            if ir._num_instances > 1 or not session._bind_variable(tensors[n], t.detach()):
                copied.append((tensors[n], t))
        return ir, session, streams, out_streams, spec, copied, guards

    def _values(self, sources, handles, arrays: list[np.ndarray], R: int) -> list[list]:
        """Each input's value on each replica's rows, on the host (Note [guarded
        specialisation] in compile_guards.py)."""
        tensors = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        values = []
        for (kind, what), t in zip(sources, handles, strict=True):
            if kind == "io":
                values.append(micro_batches(arrays[what], t.dtype, R))
            else:  # (copies: a forward may write its buffers)
                held = tensors[what].detach().to("cpu")
                values.append([held.clone() for _ in range(R)])
        return values

    def _variant_for(self, key: tuple, built: tuple, arrays: list[np.ndarray]) -> tuple | None:
        """The program built for ``key`` whose guards hold on ``arrays``, ``built`` first."""
        guards: Guards = built[-1]
        R = self.replication_factor
        values = self._values(guards.sources, guards.inputs, arrays, R)
        others = [v for v in self._variants.get(key, ()) if v is not built]
        return first_holding([built, *others], lambda b: b[-1], values, R)

    def _raise_as_eager(self, arrays: list[np.ndarray], in_spec, options,
                        err: ValuesDiffer) -> None:  # fmt: skip
        """Values that differ between the replicas' rows: the model runs eagerly on the whole
        batch (on copies of its tensors); what eager raises is raised, else ``err``."""
        tensors = {n: t.detach().clone() for n, t in
                   (*self.model.named_parameters(), *self.model.named_buffers())}  # fmt: skip
        leaves = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        a_in, k_in = pytree.tree_unflatten(leaves, in_spec)
        with torch.no_grad(), torch.random.fork_rng(devices=[]), _attributes_restored(self.model):
            torch.func.functional_call(self.model, tensors, tuple(a_in),
                                       {**k_in, **dict(options)})  # fmt: skip
        raise err

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
        structure = (  # the program's key but the shapes
            training,
            in_spec,
            options_key(options),
            # Note [the nested-tensor path of TransformerEncoder]
            (torch.is_grad_enabled(), torch.backends.mha.get_fastpath_enabled()),
        )
        share = -(-n // R)
        if structure in self._reducing:  # Note [batch-reduced outputs of an inference program]
            share = next(d for d in range(share, n + 1) if n % d == 0)
        padded = share * R
        if padded != n:
            if training:  # padding rows would join the batch statistics (BatchNorm)
                raise ValueError(
                    f"popxl.compile: a batch of {n} samples does not split over "
                    f"replication_factor={R} replicas in train mode; give a multiple of {R} "
                    "(in eval mode any batch size runs). Nothing was changed."
                )
            # eval mode: rows are independent; copies of the last row fill the replicas and
            # their outputs are dropped (Note [a program per input signature]; whole
            # replicas of them: Note [batch-reduced outputs of an inference program])
            args = [_pad_rows(a, padded) for a in args]
            kwargs = {k: _pad_rows(a, padded) for k, a in kwargs.items()}
            arrays = [*args, *kwargs.values()]
        key = (
            training,
            tuple((a.shape, a.dtype) for a in args),
            tuple((k, a.shape, a.dtype) for k, a in kwargs.items()),
            *structure[1:],
        )
        held = self._programs.pop(key, None)
        try:
            built = held
            if built is not None and built[-1] is not None:  # Note [guarded specialisation]
                built = self._variant_for(key, built, arrays)
            if built is None:
                built = self._build(args, kwargs, in_spec, options, n)
        except BaseException as e:
            if held is not None:  # nothing changes on error
                self._programs[key] = held
            if isinstance(e, _ByWholeReplicas):
                self._reducing.add(structure)
                return self(inputs)
            if isinstance(e, ValuesDiffer):
                self._raise_as_eager([a[:n] for a in arrays], in_spec, options, e)
            raise
        if built[-1] is not None and all(v is not built for v in self._variants.get(key, ())):
            self._variants[key] = [built, *self._variants.get(key, ())][: max(self.max_programs, 1)]
        self._programs[key] = built  # the most recently used last
        while len(self._programs) > max(self.max_programs, 1):
            dropped = next(iter(self._programs))
            del self._programs[dropped]
            self._variants.pop(dropped, None)
        ir, session, streams, out_streams, spec, copied, _ = built
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
            if isinstance(st, _Reduced):  # the replicas holding real rows, added up
                real = -(-n // share)
                values = [np.asarray(out[p]).reshape(-1)[:real] for p in st.parts]
                leaves.append(torch.tensor(add_up(st.kinds, values, st.const), dtype=st.dtype))
                continue
            o = numpy_to_torch(out[st], st.dtype)
            if R > 1 and o.ndim >= 2:  # [R, micro, ...] -> [batch, ...]
                o = o.reshape(padded, *o.shape[2:])
            if padded != n and o.ndim and o.shape[0] == padded:
                o = o[:n]
            leaves.append(o)
        return pytree.tree_unflatten(leaves, spec)


# ---- Note [batch-reduced outputs of an inference program] ---------------------------------


class _Reduced(NamedTuple):
    """An output the forward reduces over the batch: its summands' streams (``kinds``:
    ``Split.summands``'), added up on the host."""

    kinds: tuple[str, ...]
    parts: list[DeviceToHostStream]
    const: float
    dtype: torch.dtype


class _OverRows(Exception):
    """The batch-reduced outputs add up only with divisions by the rows read as means."""


class _ByWholeReplicas(Exception):
    """The program has batch-reduced outputs and its padding does not fill whole replicas."""


def _forward(model, tensors, args, kwargs, *, rows: int, parts: int, over_rows: bool,
             dtype: torch.dtype):  # fmt: skip
    """The model on one replica's ``rows`` (its outputs without caches) and, with ``parts >
    1`` replicas, the summands of every output it reduces over the batch, by leaf index:
    (kinds, values, const)."""
    if parts == 1:
        return _without_caches(torch.func.functional_call(model, tensors, args, kwargs)), {}
    splitter = LossSplitter((args, kwargs), rows if over_rows else None)
    with splitter:
        y = _without_caches(torch.func.functional_call(model, tensors, args, kwargs))
    reduced = {}
    for i, (path, v) in enumerate(pytree.tree_flatten_with_path(y)[0]):
        if not isinstance(v, torch.Tensor) or (v.ndim and v.shape[0] == rows):
            continue  # a row per sample: the replicas' rows put together
        where = f"output{pytree.keystr(path)}"
        if v.ndim:
            raise _not_eagers(where, v, rows, parts, "only a number is put together")
        try:
            summands, const = splitter.split(v, parts).summands(dtype)
        except LossDecompositionError as e:
            raise _not_eagers(where, v, rows, parts, e.why or str(e)) from e
        reduced[i] = (tuple(k for k, _ in summands), [t for _, t in summands], const)
    return y, reduced


def _not_eagers(where: str, v, rows: int, parts: int, why: str) -> ValueError:
    return ValueError(
        f"popxl.compile: the model's {where} has shape {list(v.shape)} on each replica's "
        f"{rows} rows, not one row per sample: the forward reduces it over the batch, and "
        f"with replication_factor={parts} the replicas' values cannot be put together as "
        f"eager's ({why}). A sum or mean of the batch (a loss: mean, sum, a token mean over "
        "labels that are not -100) is put together exactly; return per-sample values and "
        "reduce them after the call (for Hugging Face models: leave out `labels` and compute "
        "the loss from the logits), or compile with replication_factor=1."
    )


def _check_parts(model, arrays: list[np.ndarray], in_spec, options, n: int, rows: int,
                 over_rows: bool) -> None:  # fmt: skip
    """The batch-reduced outputs of the first ``n`` rows, computed eagerly on the host in eval
    mode, whole and as the program adds up its replicas' parts of ``rows`` rows each, must
    agree (Note [batch-reduced outputs of an inference program]); raises ``_OverRows`` where
    they agree only with divisions by the rows read as means, a ValueError naming the output
    where they do not agree at all."""
    if n % rows:
        raise _ByWholeReplicas
    if n == rows:  # one replica holds every real row: its value is eager's
        return
    tensors = {k: t.detach().clone() for k, t in
               (*model.named_parameters(), *model.named_buffers())}  # fmt: skip

    def run(lo: int, hi: int, parts: int, over: bool):
        values = [torch.from_numpy(np.ascontiguousarray(a[lo:hi])) for a in arrays]
        args, kwargs = pytree.tree_unflatten(values, in_spec)
        kwargs = {**kwargs, **dict(options)}
        return _forward(model, tensors, tuple(args), kwargs, rows=hi - lo, parts=parts,
                        over_rows=over, dtype=torch.float64)  # fmt: skip

    def mismatch(over: bool) -> tuple[str, float, float] | None:
        whole, _ = run(0, n, 1, over)
        leaves = pytree.tree_flatten_with_path(whole)[0]
        shares = [run(r * rows, (r + 1) * rows, n // rows, over)[1] for r in range(n // rows)]
        for i in shares[0]:
            path, value = leaves[i]
            kinds, _, const = shares[0][i]
            parts = [[float(s[i][1][j]) for s in shares] for j in range(len(kinds))]
            total, want = add_up(list(kinds), parts, const), float(value)
            if not (math.isclose(total, want, rel_tol=1e-3, abs_tol=1e-6)
                    or math.isnan(total) and math.isnan(want)):  # fmt: skip
                return f"output{pytree.keystr(path)}", want, total
        return None

    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), _attributes_restored(model):
            model.eval()
            found = mismatch(over_rows)
            if found is not None and not over_rows and mismatch(True) is None:
                raise _OverRows
    except _OverRows:
        raise
    except Exception:  # (it does not run eagerly on the host arrays: the structural split only)
        return
    if found is not None:
        where, whole, total = found
        raise ValueError(
            f"popxl.compile: the model's {where} is reduced over the batch, and on the first "
            f"batch (run eagerly in eval mode) its value is {whole:.6g} while its "
            f"{n // rows} replicas' parts add up to {total:.6g}: each part depends on the "
            "other samples of its replica's rows, as a loss that pairs the samples of the "
            "batch with each other does (in-batch negatives, a ratio of sums over the batch). "
            "Return per-sample values and reduce them after the call, or compile with "
            "replication_factor=1."
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
