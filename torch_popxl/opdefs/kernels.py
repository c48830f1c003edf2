"""Python side of the ``torch_popxl`` operators: fake impls, vmap rules, autograd, counters.

Two layers of ops live in the ``torch_popxl`` namespace:

* **Stacked ops** (C++, ``csrc/``): ``all_reduce_stacked``, ``all_gather_stacked``,
  ``reduce_scatter_stacked``, ``take_own_stacked``, ``remote_load_stacked`` and
  ``remote_store_stacked_``. Dim 0 of every tensor is the replica dim, of size R, so one call
  simulates all replicas at once.
* **Per-replica ops** (``torch.library.custom_op``, defined here): ``replicated_all_reduce``,
  ``replicated_all_gather``, ``replicated_take_own``, ``replicated_reduce_scatter``,
  ``remote_load`` and ``remote_store_``. They describe ONE replica's view, which is what a
  captured PopXL program records. Running the per-replica program under
  ``torch.func.vmap`` over a leading replica dim turns each call into the stacked op: the vmap
  batch size *is* the replica count R (torch-techniques.md §3.1).

Outside vmap a per-replica op sees a single replica, so it only accepts ``group_size == 1``.
Limits that follow from how vmap dispatches custom ops:

* The replica dim is the vmap level that batches the op's inputs. Inside vmap an op whose
  inputs are all unbatched never reaches its vmap rule (torch runs the plain kernel), so it
  behaves as a single replica; batch such a value over replicas first.
* Under nested vmaps the innermost level that batches the inputs is taken as the replica dim.
* Gradients work with ``torch.autograd`` over a vmapped program. ``torch.func.grad`` combined
  with these ops (``vmap(grad(f))`` or ``grad(vmap(f))``) is rejected by torch ("must override
  the setup_context staticmethod"), a limitation of custom-op autograd under functorch.

Note [collective gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Gradients follow PopXL's autodiff rules (popxl.md §5), not the derivative of the stacked
function. PopXL treats each replica's incoming gradient as that replica's local contribution
and leaves any cross-replica sum to collectives the program calls explicitly (for example the
reduce-scatter of weight gradients in RTS training). So:

* all_gather       -> grad is ``take_own``: each replica keeps its own row, no summing;
* take_own         -> grad is ``all_gather`` (PopXL's grad of a 'local' reduce-scatter);
* reduce_scatter   -> grad is ``all_gather`` of the gradient shard for op 'local'; PopXL has
                      no gradient for any other op, so backward raises;
* all_reduce       -> PopXL has no gradient, so backward raises.

The same rules are registered on the stacked ops, because ``torch.autograd`` over a vmapped
program records the stacked calls made by the vmap rules, not the per-replica ops.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

try:
    import torch_popxl._C  # noqa: F401  (loading the library registers the stacked ops)
except ImportError as error:  # pragma: no cover - depends on the build state
    raise ImportError(
        "torch_popxl._C, the compiled runtime extension, could not be imported "
        f"({error}). Build it in place from the repository root with "
        "`pip install --no-build-isolation -e .` (MAX_JOBS=2 limits the compile jobs)."
    ) from error

__all__ = [
    "VALID_OPS",
    "Collectives",
    "SimulatorCollectives",
    "add_host_bytes",
    "collectives",
    "remote_load",
    "remote_store_",
    "replicated_all_gather",
    "replicated_all_reduce",
    "replicated_reduce_scatter",
    "replicated_take_own",
    "reset_traffic_counters",
    "traffic_counters",
    "traffic_scope",
    "use_collectives",
]

_ops = torch.ops.torch_popxl

VALID_OPS = ("add", "mean", "mul", "min", "max", "and", "or", "square_add")
_ARITHMETIC_OPS = ("add", "mean", "mul", "square_add")

_COUNTER_NAMES = (
    "collective_bytes",
    "remote_load_bytes",
    "remote_store_bytes",
    "host_bytes",
    "num_collectives",
    "num_remote_loads",
    "num_remote_stores",
)


# --------------------------------------------------------------------------------------------
# Traffic counters (see Note [traffic accounting] in csrc/traffic.cpp)


def traffic_counters() -> dict[str, int]:
    """Bytes and call counts accumulated by the collective and remote-buffer kernels."""
    return dict(zip(_COUNTER_NAMES, _ops.traffic_counters(), strict=True))


def reset_traffic_counters() -> None:
    """Zero the process-wide counters (sessions never call this: see ``traffic_scope``)."""
    _ops.reset_traffic_counters()


# Held by every traffic_scope: scopes in different threads take turns, so the counters move
# only for the scope that is open while it measures. Re-entrant: a nested scope (same thread)
# measures its own part, which the outer scope's figures include.
_SCOPE_LOCK = threading.RLock()


@contextlib.contextmanager
def traffic_scope() -> Iterator[dict[str, int]]:
    """Measure the traffic of the enclosed code: yields a dict that holds, on exit, how much
    each counter grew inside the scope (the names of ``traffic_counters()``).

    The process-wide counters keep accumulating (a scope never resets them), so several
    sessions, or a caller measuring around them, see independent figures. Scopes serialise
    across threads; counting done by other threads outside any scope is not excluded.
    """
    with _SCOPE_LOCK:
        delta: dict[str, int] = {}
        before = _ops.traffic_counters()
        try:
            yield delta
        finally:
            after = _ops.traffic_counters()
            delta.update(
                zip(
                    _COUNTER_NAMES, (a - b for a, b in zip(after, before, strict=True)), strict=True
                )
            )


def add_host_bytes(n: int) -> None:
    """Record ``n`` bytes moved between host and device (called by the host-IO layer)."""
    _ops.add_host_bytes(n)


# --------------------------------------------------------------------------------------------
# Validation shared by the fake impls, so shape errors surface while tracing, with the same
# wording as the C++ kernels.


def check_grouping(name: str, replicas, group_size: int, stride: int) -> None:
    """Raise ``ValueError`` unless ``(group_size, stride)`` tiles ``replicas`` (popxl.md §2.1).

    The same rule and wording as ``check_grouping`` in csrc/collective_common.h. Every
    shortcut that trusts a grouping (the full-group fast paths, the fused kernels) must run
    this first, so an invalid grouping is never silently treated as the whole replica set.
    """
    if group_size < 1 or stride < 1:
        raise ValueError(
            f"{name}: group_size and stride must be >= 1, got group_size={group_size}, "
            f"stride={stride}."
        )
    if group_size == 1:
        stride = 1
    if replicas < 1 or replicas % (group_size * stride) != 0:
        raise ValueError(
            f"{name}: the replica grouping (group_size={group_size}, stride={stride}) does not "
            f"tile R={replicas} replicas; R must be a positive multiple of "
            f"group_size*stride={group_size * stride}. Pick a group_size and stride whose "
            "product divides the replica count."
        )


def _check_op(name: str, op: str, dtype: torch.dtype, allow_local: bool = False) -> None:
    valid = VALID_OPS + (("local",) if allow_local else ())
    if op not in valid:
        raise ValueError(f"{name}: unknown op {op!r}; valid ops are {', '.join(valid)}.")
    if dtype == torch.bool and op in _ARITHMETIC_OPS:
        raise TypeError(
            f"{name}: op {op!r} needs a numeric dtype, got bool. Use 'or', 'and', 'min' or "
            "'max' for boolean masks, or convert the tensor to an integer dtype first."
        )


def _check_stacked(name: str, x: Tensor) -> None:
    if x.dim() < 1:
        raise ValueError(
            f"{name}: expected a stacked tensor [R, ...] with the replica dim first, "
            "got a 0-d tensor."
        )


def _chunk(numel, group_size: int):
    return (numel + group_size - 1) // group_size  # ceil(n / G), popxl.md §4.5


def _check_offset_dtype(name: str, offset: Tensor) -> None:
    if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
        raise TypeError(f"{name}: offsets must be an integer tensor, got dtype {offset.dtype}.")


def _check_slot_value(name: str, slot_shape, buffer: Tensor, value_shape, value: Tensor) -> None:
    if tuple(value_shape) != tuple(slot_shape):
        raise ValueError(
            f"{name}: value of shape {tuple(value_shape)} does not match the remote buffer: "
            f"expected shape {tuple(slot_shape)}."
        )
    if value.dtype != buffer.dtype:
        raise ValueError(
            f"{name}: value has dtype {value.dtype} but the remote buffer holds {buffer.dtype}; "
            f"convert the value with .to({buffer.dtype}) before storing."
        )


# --------------------------------------------------------------------------------------------
# Stacked ops: fake impls and autograd


@torch.library.register_fake("torch_popxl::all_reduce_stacked")
def _all_reduce_stacked_fake(x, op, group_size, stride):
    _check_stacked("all_reduce", x)
    check_grouping("all_reduce", x.shape[0], group_size, stride)
    _check_op("all_reduce", op, x.dtype)
    return x.new_empty(x.shape)


@torch.library.register_fake("torch_popxl::all_gather_stacked")
def _all_gather_stacked_fake(x, group_size, stride):
    _check_stacked("all_gather", x)
    check_grouping("all_gather", x.shape[0], group_size, stride)
    return x.new_empty((x.shape[0], group_size, *x.shape[1:]))


@torch.library.register_fake("torch_popxl::reduce_scatter_stacked")
def _reduce_scatter_stacked_fake(x, op, group_size, stride):
    if x.dim() != 2:
        raise ValueError(
            f"reduce_scatter: expected a stacked tensor [R, n], got shape {tuple(x.shape)}."
        )
    check_grouping("reduce_scatter", x.shape[0], group_size, stride)
    _check_op("reduce_scatter", op, x.dtype, allow_local=True)
    return x.new_empty((x.shape[0], _chunk(x.shape[1], group_size)))


@torch.library.register_fake("torch_popxl::take_own_stacked")
def _take_own_stacked_fake(x, group_size, stride):
    _check_stacked("take_own", x)
    check_grouping("take_own", x.shape[0], group_size, stride)
    if x.dim() < 2 or x.shape[1] != group_size:
        raise ValueError(
            f"take_own: expected a stacked tensor [R, group_size={group_size}, ...], "
            f"got shape {tuple(x.shape)}."
        )
    return x.new_empty((x.shape[0], *x.shape[2:]))


@torch.library.register_fake("torch_popxl::remote_load_stacked")
def _remote_load_stacked_fake(buffer, offsets, buffer_id):
    if buffer.dim() < 2:
        raise ValueError(
            f"remote_load: expected the stacked RemoteBuffer[id={buffer_id}] of shape "
            f"[R, entries, *slot_shape], got shape {tuple(buffer.shape)}."
        )
    _check_offset_dtype("remote_load", offsets)
    return buffer.new_empty((buffer.shape[0], *buffer.shape[2:]))


@torch.library.register_fake("torch_popxl::remote_store_stacked_")
def _remote_store_stacked_fake(buffer, offsets, value, buffer_id):
    if buffer.dim() < 2:
        raise ValueError(
            f"remote_store: expected the stacked RemoteBuffer[id={buffer_id}] of shape "
            f"[R, entries, *slot_shape], got shape {tuple(buffer.shape)}."
        )
    _check_offset_dtype("remote_store", offsets)
    _check_slot_value(
        "remote_store", (buffer.shape[0], *buffer.shape[2:]), buffer, value.shape, value
    )


def _save_grouping(ctx, inputs, output):
    ctx.group_size, ctx.stride = inputs[-2], inputs[-1]


def _save_reduce_scatter(ctx, inputs, output):
    x, ctx.op, ctx.group_size, ctx.stride = inputs
    ctx.input_shape = x.shape


def _no_gradient(name: str, op: str | None = None):
    detail = f" with op={op!r}" if op is not None else ""
    return RuntimeError(
        f"{name}{detail} has no gradient: PopXL defines no grad op for it (popxl.md §5). "
        "Detach its input, or compute the gradient before the collective."
    )


def _all_reduce_stacked_backward(ctx, grad):
    raise _no_gradient("replicated_all_reduce")


def _all_gather_stacked_backward(ctx, grad):
    return _ops.take_own_stacked(grad, ctx.group_size, ctx.stride), None, None


def _take_own_stacked_backward(ctx, grad):
    return _ops.all_gather_stacked(grad, ctx.group_size, ctx.stride), None, None


def _reduce_scatter_stacked_backward(ctx, grad):
    if ctx.op != "local":
        raise _no_gradient("replicated_reduce_scatter", ctx.op)
    replicas, numel = ctx.input_shape
    gathered = _ops.all_gather_stacked(grad, ctx.group_size, ctx.stride)  # [R, G, chunk]
    padded = gathered.reshape(replicas, ctx.group_size * grad.shape[1])
    return padded[:, :numel], None, None, None


torch.library.register_autograd("torch_popxl::all_reduce_stacked", _all_reduce_stacked_backward)
torch.library.register_autograd(
    "torch_popxl::all_gather_stacked", _all_gather_stacked_backward, setup_context=_save_grouping
)
torch.library.register_autograd(
    "torch_popxl::take_own_stacked", _take_own_stacked_backward, setup_context=_save_grouping
)
torch.library.register_autograd(
    "torch_popxl::reduce_scatter_stacked",
    _reduce_scatter_stacked_backward,
    setup_context=_save_reduce_scatter,
)


# --------------------------------------------------------------------------------------------
# Collective backends (Note [collective backends])
#
# Note [collective backends]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The vmap rules of the per-replica collectives hand the stacked local replicas to the active
# backend. The default, ``SimulatorCollectives``, holds every replica in this process, so the
# vmap batch is all R replicas and the stacked C++ kernels are the whole story. Under
# ``torch.distributed`` each process is one PopXL instance holding a contiguous block of the
# global replicas; ``runtime/distributed.py`` implements the same protocol with the stacked
# kernels for the local part and ``torch.distributed`` across instances. A distributed
# ``Session`` activates its backend (``use_collectives``) only while it runs a program.


class Collectives(Protocol):
    """What the collective vmap rules need. Tensors are stacked over the LOCAL replicas
    (``[R_local, ...]``); groupings ``(group_size, stride)`` are over the GLOBAL replicas."""

    def num_replicas(self, batch_size: int) -> int:
        """The global replica count, given the vmap batch (the local replica count)."""
        ...

    def all_reduce(self, x: Tensor, op: str, group_size: int, stride: int) -> Tensor: ...

    def all_reduce_full(self, x: Tensor, op: str) -> Tensor:
        """One group of all replicas: ``[R_local, *s] -> [*s]`` (the same on every replica)."""
        ...

    def all_gather(self, x: Tensor, group_size: int, stride: int) -> Tensor: ...

    def all_gather_full(self, x: Tensor) -> Tensor:
        """One group of all replicas: ``[R_local, *s] -> [R, *s]``."""
        ...

    def reduce_scatter(self, x: Tensor, op: str, group_size: int, stride: int) -> Tensor: ...

    def take_own(self, x: Tensor, group_size: int, stride: int) -> Tensor: ...

    def mm_all_reduce(self, a: Tensor, b: Tensor, op: str) -> Tensor: ...

    def reference(self, fn, values: list[Tensor], *args):
        """Run an ``opdefs.reference`` function (one list entry per replica) over all
        replicas and return the local replicas' entries (the reference executor's path)."""
        ...


class SimulatorCollectives:
    """Every replica lives in this process: the stacked kernels over the vmap dim."""

    def num_replicas(self, batch_size: int) -> int:
        return batch_size

    def all_reduce(self, x, op, group_size, stride):
        return _ops.all_reduce_stacked(x, op, group_size, stride)

    def all_reduce_full(self, x, op):
        return _ops.all_reduce_full(x, op)

    def all_gather(self, x, group_size, stride):
        return _ops.all_gather_stacked(x, group_size, stride)

    def all_gather_full(self, x):
        return _ops.all_gather_full(x)

    def reduce_scatter(self, x, op, group_size, stride):
        return _ops.reduce_scatter_stacked(x, op, group_size, stride)

    def take_own(self, x, group_size, stride):
        return _ops.take_own_stacked(x, group_size, stride)

    def mm_all_reduce(self, a, b, op):
        return _ops.mm_all_reduce_stacked(a, b, op)

    def reference(self, fn, values, *args):
        return fn(values, *args)


_SIMULATOR = SimulatorCollectives()
_active: list[Collectives] = []


def collectives() -> Collectives:
    """The backend the collective vmap rules use now (the simulator unless a distributed
    Session is running)."""
    return _active[-1] if _active else _SIMULATOR


@contextlib.contextmanager
def use_collectives(backend: Collectives | None):
    """Route collectives to ``backend`` inside the block (``None``: leave them as they are)."""
    if backend is None:
        yield
        return
    _active.append(backend)
    try:
        yield
    finally:
        _active.pop()


# --------------------------------------------------------------------------------------------
# Per-replica ops


def _require_single_replica(name: str, group_size: int) -> None:
    if group_size != 1:
        raise RuntimeError(
            f"{name}: called on a single replica (outside torch.func.vmap, or inside vmap with "
            f"no input batched over replicas) with group_size={group_size}. A collective over "
            f"{group_size} replicas needs every member's value: run the per-replica program "
            "under torch.func.vmap with the input batched over the replica dim (for a value "
            "that is the same on every replica use x.expand(R, *x.shape)), or use group_size=1."
        )


def _stacked(x: Tensor, in_dim: int | None, batch_size: int) -> Tensor:
    """The physical tensor with the replica dim first; an unbatched input is the same value on
    every replica, so it is broadcast to all of them."""
    if in_dim is None:
        return x.expand(batch_size, *x.shape)
    return x.movedim(in_dim, 0)


@torch.library.custom_op("torch_popxl::replicated_all_reduce", mutates_args=())
def replicated_all_reduce(x: Tensor, op: str, group_size: int, stride: int) -> Tensor:
    """One replica's all-reduce over its group (popxl.md §5.1); ``x`` keeps its shape."""
    _require_single_replica("replicated_all_reduce", group_size)
    return _ops.all_reduce_stacked(x.unsqueeze(0), op, group_size, stride).squeeze(0)


@replicated_all_reduce.register_fake
def _(x, op, group_size, stride):
    _check_op("replicated_all_reduce", op, x.dtype)
    return x.new_empty(x.shape)


@replicated_all_reduce.register_vmap
def _(info, in_dims, x, op, group_size, stride):
    # A full-group result is the same on every replica: return it unbatched (stored once),
    # which lets the executor keep replica-invariant values unbatched (see runtime/lower.py).
    backend = collectives()
    check_grouping(
        "replicated_all_reduce", backend.num_replicas(info.batch_size), group_size, stride
    )
    if group_size == backend.num_replicas(info.batch_size) > 1:
        stacked = _stacked(x, in_dims[0], info.batch_size)
        return backend.all_reduce_full(stacked, op), None
    if in_dims[0] is None and group_size == 1:
        return _ops.all_reduce_stacked(x.unsqueeze(0), op, 1, 1).squeeze(0), None
    return backend.all_reduce(_stacked(x, in_dims[0], info.batch_size), op, group_size, stride), 0


replicated_all_reduce.register_autograd(_all_reduce_stacked_backward)


@torch.library.custom_op("torch_popxl::replicated_all_gather", mutates_args=())
def replicated_all_gather(x: Tensor, group_size: int, stride: int) -> Tensor:
    """One replica's all-gather: ``[*s] -> [G, *s]``, row i is member i's value (§5.5)."""
    _require_single_replica("replicated_all_gather", group_size)
    return _ops.all_gather_stacked(x.unsqueeze(0), group_size, stride).squeeze(0)


@replicated_all_gather.register_fake
def _(x, group_size, stride):
    return x.new_empty((group_size, *x.shape))


@replicated_all_gather.register_vmap
def _(info, in_dims, x, group_size, stride):
    backend = collectives()
    check_grouping(
        "replicated_all_gather", backend.num_replicas(info.batch_size), group_size, stride
    )
    if group_size == backend.num_replicas(info.batch_size) > 1:  # full group: the same [G, *s]
        return backend.all_gather_full(_stacked(x, in_dims[0], info.batch_size)), None
    if in_dims[0] is None and group_size == 1:
        return _ops.all_gather_stacked(x.unsqueeze(0), 1, 1).squeeze(0), None
    return backend.all_gather(_stacked(x, in_dims[0], info.batch_size), group_size, stride), 0


@torch.library.custom_op("torch_popxl::replicated_take_own", mutates_args=())
def replicated_take_own(x: Tensor, group_size: int, stride: int) -> Tensor:
    """One replica keeps its own row ``i(r)`` of a ``[G, *s]`` tensor: ``-> [*s]``."""
    _require_single_replica("replicated_take_own", group_size)
    return _ops.take_own_stacked(x.unsqueeze(0), group_size, stride).squeeze(0)


@replicated_take_own.register_fake
def _(x, group_size, stride):
    if x.dim() < 1 or x.shape[0] != group_size:
        raise ValueError(
            f"replicated_take_own: expected one row per group member, [group_size={group_size}, "
            f"...], got shape {tuple(x.shape)}."
        )
    return x.new_empty(x.shape[1:])


@replicated_take_own.register_vmap
def _(info, in_dims, x, group_size, stride):
    stacked = _stacked(x, in_dims[0], info.batch_size)
    return collectives().take_own(stacked, group_size, stride), 0


def _replicated_all_gather_backward(ctx, grad):
    return replicated_take_own(grad, ctx.group_size, ctx.stride), None, None


def _replicated_take_own_backward(ctx, grad):
    return replicated_all_gather(grad, ctx.group_size, ctx.stride), None, None


replicated_all_gather.register_autograd(
    _replicated_all_gather_backward, setup_context=_save_grouping
)
replicated_take_own.register_autograd(_replicated_take_own_backward, setup_context=_save_grouping)


@torch.library.custom_op("torch_popxl::replicated_reduce_scatter", mutates_args=())
def replicated_reduce_scatter(x: Tensor, op: str, group_size: int, stride: int) -> Tensor:
    """One replica's reduce-scatter (§5.2): ``x`` of any shape -> ``[ceil(n / G)]``.

    ``op == "local"`` is PopXL's no-reduction variant (``replica_sharded_slice``, §5.3).
    """
    _require_single_replica("replicated_reduce_scatter", group_size)
    return _ops.reduce_scatter_stacked(x.reshape(1, x.numel()), op, group_size, stride).squeeze(0)


@replicated_reduce_scatter.register_fake
def _(x, op, group_size, stride):
    _check_op("replicated_reduce_scatter", op, x.dtype, allow_local=True)
    return x.new_empty((_chunk(x.numel(), group_size),))


@replicated_reduce_scatter.register_vmap
def _(info, in_dims, x, op, group_size, stride):
    stacked = _stacked(x, in_dims[0], info.batch_size)
    flat = stacked.reshape(stacked.shape[0], math.prod(stacked.shape[1:]))
    return collectives().reduce_scatter(flat, op, group_size, stride), 0


def _replicated_reduce_scatter_backward(ctx, grad):
    if ctx.op != "local":
        raise _no_gradient("replicated_reduce_scatter", ctx.op)
    gathered = replicated_all_gather(grad, ctx.group_size, ctx.stride)  # [G, chunk]
    numel = math.prod(ctx.input_shape)
    return gathered.reshape(-1)[:numel].reshape(ctx.input_shape), None, None, None


replicated_reduce_scatter.register_autograd(
    _replicated_reduce_scatter_backward, setup_context=_save_reduce_scatter
)


def _check_replica_offset(name: str, offset: Tensor) -> None:
    _check_offset_dtype(name, offset)
    if offset.dim() != 0:
        raise ValueError(
            f"{name}: offset must be a 0-d integer tensor (this replica's slot index), "
            f"got shape {tuple(offset.shape)}."
        )


def _check_replica_buffer(name: str, buffer: Tensor, buffer_id: int) -> None:
    if buffer.dim() < 1:
        raise ValueError(
            f"{name}: expected RemoteBuffer[id={buffer_id}] as [entries, *slot_shape], "
            "got a 0-d tensor."
        )


@torch.library.custom_op("torch_popxl::remote_load", mutates_args=())
def remote_load(buffer: Tensor, offset: Tensor, buffer_id: int) -> Tensor:
    """This replica reads slot ``offset`` of its copy ``buffer`` (``[entries, *shape]``)."""
    _check_replica_offset("remote_load", offset)
    return _ops.remote_load_stacked(buffer.unsqueeze(0), offset.reshape(1), buffer_id).squeeze(0)


@remote_load.register_fake
def _(buffer, offset, buffer_id):
    _check_replica_buffer("remote_load", buffer, buffer_id)
    _check_replica_offset("remote_load", offset)
    return buffer.new_empty(buffer.shape[1:])


@remote_load.register_vmap
def _(info, in_dims, buffer, offset, buffer_id):
    buffer_dim, offset_dim = in_dims[:2]
    if offset_dim is not None and offset.dim() != 1:
        raise ValueError(
            "remote_load: offset must be a 0-d integer tensor per replica, got per-replica "
            f"shape {tuple(offset.movedim(offset_dim, 0).shape[1:])}."
        )
    stacked_buffer = _stacked(buffer, buffer_dim, info.batch_size)
    offsets = _stacked(offset, offset_dim, info.batch_size)
    return _ops.remote_load_stacked(stacked_buffer, offsets, buffer_id), 0


@torch.library.custom_op("torch_popxl::remote_store_", mutates_args=("buffer",))
def remote_store_(buffer: Tensor, offset: Tensor, value: Tensor, buffer_id: int) -> None:
    """This replica writes ``value`` into slot ``offset`` of its copy ``buffer``, in place."""
    _check_replica_offset("remote_store_", offset)
    _ops.remote_store_stacked_(
        buffer.unsqueeze(0), offset.reshape(1), value.unsqueeze(0), buffer_id
    )


@remote_store_.register_fake
def _(buffer, offset, value, buffer_id):
    _check_replica_buffer("remote_store_", buffer, buffer_id)
    _check_replica_offset("remote_store_", offset)
    _check_slot_value("remote_store_", buffer.shape[1:], buffer, value.shape, value)


@remote_store_.register_vmap
def _(info, in_dims, buffer, offset, value, buffer_id):
    buffer_dim, offset_dim, value_dim = in_dims[:3]
    if buffer_dim is None:
        # One shared tensor cannot hold R different writes. Remote buffers are per replica
        # anyway (popxl.md §4.1), so the caller must stack them.
        raise ValueError(
            "remote_store_: the buffer is not batched over replicas but the offset or value "
            "is. Every replica owns a private copy of a remote buffer (popxl.md §4.1): pass "
            f"it stacked as [R={info.batch_size}, entries, *slot_shape] with in_dims=0."
        )
    if offset_dim is not None and offset.dim() != 1:
        raise ValueError(
            "remote_store_: offset must be a 0-d integer tensor per replica, got per-replica "
            f"shape {tuple(offset.movedim(offset_dim, 0).shape[1:])}."
        )
    # movedim returns a view, so the in-place store writes through to the caller's tensor.
    stacked_buffer = buffer.movedim(buffer_dim, 0)
    offsets = _stacked(offset, offset_dim, info.batch_size)
    values = _stacked(value, value_dim, info.batch_size)
    _ops.remote_store_stacked_(stacked_buffer, offsets, values, buffer_id)
    return None, None


# ---- fused matmul + full-group all-reduce (Note [fold replicas into the matmul]) ----------


@torch.library.custom_op("torch_popxl::mm_all_reduce", mutates_args=())
def mm_all_reduce(a: Tensor, b: Tensor, op: str) -> Tensor:
    """``replicated_all_reduce(a @ b, op)`` over all replicas; on one replica just ``a @ b``."""
    if op not in ("add", "mean"):
        raise ValueError(f"mm_all_reduce: op must be 'add' or 'mean'; got {op!r}.")
    return a @ b


@mm_all_reduce.register_fake
def _(a, b, op):
    return a.new_empty((a.shape[0], b.shape[1]))


@mm_all_reduce.register_vmap
def _(info, in_dims, a, b, op):
    R = info.batch_size
    a = _stacked(a, in_dims[0], R)  # [R, M, K]
    b = _stacked(b, in_dims[1], R)  # [R, K, N]
    return collectives().mm_all_reduce(a, b, op), None


@torch.library.register_fake("torch_popxl::all_reduce_full")
def _(x, op):
    _check_op("all_reduce_full", op, x.dtype)
    return x.new_empty(x.shape[1:])


@torch.library.register_fake("torch_popxl::all_gather_full")
def _(x):
    return x.new_empty(x.shape)


@torch.library.register_fake("torch_popxl::mm_all_reduce_stacked")
def _(a, b, op):
    return a.new_empty((a.shape[1], b.shape[2]))


# ---- replica sums (Note [replica-sum accumulators] in runtime/lower.py) -------------------


@torch.library.custom_op("torch_popxl::replica_sum", mutates_args=())
def replica_sum(x: Tensor) -> Tensor:
    """The sum of ``x`` over all replicas, as one value (not a collective: no traffic)."""
    return x.clone()


@replica_sum.register_fake
def _(x):
    return torch.empty_like(x)


@replica_sum.register_vmap
def _(info, in_dims, x):
    if in_dims[0] is None:
        return x * info.batch_size, None
    return x.sum(in_dims[0]), None


@torch.library.custom_op("torch_popxl::mm_replica_sum", mutates_args=())
def mm_replica_sum(a: Tensor, b: Tensor) -> Tensor:
    """``sum_r a_r @ b_r`` as one value; on one replica ``a @ b``."""
    return a @ b


@mm_replica_sum.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


@mm_replica_sum.register_vmap
def _(info, in_dims, a, b):
    R = info.batch_size
    a, b = _stacked(a, in_dims[0], R), _stacked(b, in_dims[1], R)  # [R, M, K], [R, K, N]
    M, K, N = a.shape[1], a.shape[2], b.shape[2]
    # Fold the replicas into the contraction: one [M, R*K] @ [R*K, N] matmul.
    return a.permute(1, 0, 2).reshape(M, R * K) @ b.reshape(R * K, N), None
