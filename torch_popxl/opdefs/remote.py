"""Remote memory (streaming memory, popxl.md §4): ``remote_load``, ``remote_load_`` and
``remote_store``. Each replica owns a private copy of every remote buffer, so nothing crosses
replicas or instances: under torch.distributed each instance holds its replicas' rows and the
ops run there unchanged (these ops have no ``distributed`` rule).

Two layers, as for the collectives: the IR records runtime ops whose kind is their definition
here (``load_opdef``, ..., Note [op definitions] in ir/opdef.py) built by the public wrappers; the fast executor runs them through the per-replica custom ops
``torch_popxl::remote_load`` / ``remote_store_``, whose vmap rules call the stacked C++
kernels ``remote_load_stacked`` / ``remote_store_stacked_`` (csrc/remote.cpp).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import dtypes as _dtypes
from ..dtypes import nbytes
from ..ir.attrs import RemoteTransfer
from ..ir.context import gcg
from ..ir.graph import Op
from ..ir.remote_buffer import RemoteBuffer
from ..ir.tensor import Tensor as Handle
from ..ir.tensor import _fake_like, constant
from ._common import ops, stacked
from .lowering import LowerAnalysis, LowerEmission
from .registry import Effect, OpDef, Traffic, register

__all__ = [
    "load_opdef",
    "load_per_replica",
    "reference_load",
    "reference_store",
    "remote_load",
    "remote_load_",
    "remote_store",
    "slot_bytes",
    "store_opdef",
    "store_per_replica",
]


# ---- traffic ---------------------------------------------------------------------------------


def slot_bytes(rb: RemoteBuffer) -> int:
    """Bytes of one entry of ``rb`` on one replica."""
    return nbytes(rb.tensor_shape, rb.tensor_dtype)


def _traffic(kind: str):
    def traffic(op: Op, num_replicas: int) -> Traffic:
        return Traffic(kind, num_replicas * slot_bytes(op.attrs.buffer))

    return traffic


# ---- reference semantics ---------------------------------------------------------------------


def _offset_index(buffer: Tensor, offset, replica: int, buffer_id: int | None = None) -> int:
    """``offset`` (an int or a 0-d tensor) as a range-checked Python int.

    The value is read at full width (a Python int has no overflow), so 2**32 is out of range
    rather than wrapping to slot 0; a float offset is a type error that names NaN when it is one.
    """
    which = "a buffer" if buffer_id is None else f"RemoteBuffer[id={buffer_id}]"
    if isinstance(offset, torch.Tensor):
        if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
            nan = " holding NaN" if bool(torch.isnan(offset).any()) else ""
            raise TypeError(
                f"replica {replica}: offsets must be integers, got dtype {offset.dtype}{nan} "
                f"for {which}."
            )
        offset = offset.item()
    if isinstance(offset, float):
        what = "NaN" if math.isnan(offset) else repr(offset)
        raise TypeError(f"replica {replica}: offsets must be integers, got {what} for {which}.")
    offset = int(offset)
    entries = buffer.shape[0]
    if not 0 <= offset < entries:
        raise ValueError(
            f"replica {replica}: offset {offset} is out of range for {which} with {entries} "
            f"entries; offsets must be in [0, {entries})"
        )
    return offset


def reference_load(
    buffers: list[Tensor], offsets: list[int], buffer_id: int | None = None
) -> list[Tensor]:
    """Replica r reads slot ``offsets[r]`` of its own buffer copy ``buffers[r]`` (popxl.md §4.1)."""
    out = []
    for r, (buffer, offset) in enumerate(zip(buffers, offsets, strict=True)):
        out.append(buffer[_offset_index(buffer, offset, r, buffer_id)].clone())
    return out


def reference_store(
    buffers: list[Tensor],
    offsets: list[int],
    values: list[Tensor],
    buffer_id: int | None = None,
) -> None:
    """Replica r writes ``values[r]`` into slot ``offsets[r]`` of its own buffer copy, in place.

    All offsets are checked first, so nothing is written if any is out of range.
    """
    slots = [
        _offset_index(buffer, offset, r, buffer_id)
        for r, (buffer, offset) in enumerate(zip(buffers, offsets, strict=True))
    ]
    for buffer, slot, value in zip(buffers, slots, values, strict=True):
        buffer[slot].copy_(value)


# ---- checks shared by the fakes --------------------------------------------------------------


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


# ---- the stacked kernels ---------------------------------------------------------------------


@torch.library.register_fake("torch_popxl::remote_load_stacked")
def _load_stacked_fake(buffer, offsets, buffer_id):
    if buffer.dim() < 2:
        raise ValueError(
            f"remote_load: expected the stacked RemoteBuffer[id={buffer_id}] of shape "
            f"[R, entries, *slot_shape], got shape {tuple(buffer.shape)}."
        )
    _check_offset_dtype("remote_load", offsets)
    return buffer.new_empty((buffer.shape[0], *buffer.shape[2:]))


@torch.library.register_fake("torch_popxl::remote_store_stacked_")
def _store_stacked_fake(buffer, offsets, value, buffer_id):
    if buffer.dim() < 2:
        raise ValueError(
            f"remote_store: expected the stacked RemoteBuffer[id={buffer_id}] of shape "
            f"[R, entries, *slot_shape], got shape {tuple(buffer.shape)}."
        )
    _check_offset_dtype("remote_store", offsets)
    _check_slot_value(
        "remote_store", (buffer.shape[0], *buffer.shape[2:]), buffer, value.shape, value
    )


@torch.library.register_fake("torch_popxl::remote_slot_view")
def _slot_view_fake(buffer, offset, buffer_id):
    if buffer.dim() < 2:
        raise ValueError(
            f"remote_slot_view: expected the stacked RemoteBuffer[id={buffer_id}] of shape "
            f"[R, entries, *slot_shape], got shape {tuple(buffer.shape)}."
        )
    return buffer.select(1, offset)


# ---- the per-replica ops ---------------------------------------------------------------------


@torch.library.custom_op("torch_popxl::remote_load", mutates_args=())
def load_per_replica(buffer: Tensor, offset: Tensor, buffer_id: int) -> Tensor:
    """This replica reads slot ``offset`` of its copy ``buffer`` (``[entries, *shape]``)."""
    _check_replica_offset("remote_load", offset)
    return ops.remote_load_stacked(buffer.unsqueeze(0), offset.reshape(1), buffer_id).squeeze(0)


@load_per_replica.register_fake
def _(buffer, offset, buffer_id):
    _check_replica_buffer("remote_load", buffer, buffer_id)
    _check_replica_offset("remote_load", offset)
    return buffer.new_empty(buffer.shape[1:])


@load_per_replica.register_vmap
def _(info, in_dims, buffer, offset, buffer_id):
    buffer_dim, offset_dim = in_dims[:2]
    if offset_dim is not None and offset.dim() != 1:
        raise ValueError(
            "remote_load: offset must be a 0-d integer tensor per replica, got per-replica "
            f"shape {tuple(offset.movedim(offset_dim, 0).shape[1:])}."
        )
    stacked_buffer = stacked(buffer, buffer_dim, info.batch_size)
    offsets = stacked(offset, offset_dim, info.batch_size)
    return ops.remote_load_stacked(stacked_buffer, offsets, buffer_id), 0


@torch.library.custom_op("torch_popxl::remote_store_", mutates_args=("buffer",))
def store_per_replica(buffer: Tensor, offset: Tensor, value: Tensor, buffer_id: int) -> None:
    """This replica writes ``value`` into slot ``offset`` of its copy ``buffer``, in place."""
    _check_replica_offset("remote_store_", offset)
    ops.remote_store_stacked_(buffer.unsqueeze(0), offset.reshape(1), value.unsqueeze(0), buffer_id)


@store_per_replica.register_fake
def _(buffer, offset, value, buffer_id):
    _check_replica_buffer("remote_store_", buffer, buffer_id)
    _check_replica_offset("remote_store_", offset)
    _check_slot_value("remote_store_", buffer.shape[1:], buffer, value.shape, value)


@store_per_replica.register_vmap
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
    offsets = stacked(offset, offset_dim, info.batch_size)
    values = stacked(value, value_dim, info.batch_size)
    ops.remote_store_stacked_(stacked_buffer, offsets, values, buffer_id)
    return None, None


# ---- the public wrappers (popxl.ops.remote_load, ...; spec §4.3) ----------------------------


def _buffer(rb, name: str):
    if not isinstance(rb, RemoteBuffer):
        raise TypeError(f"{name} expects a RemoteBuffer; got {type(rb).__name__}.")
    if rb._ir is not gcg().ir:
        raise ValueError(f"{name}: {rb!r} belongs to another Ir.")
    return rb


_INT32_MAX = 2**31 - 1


def _offset(offset, name: str, rb) -> Handle:
    """The offset as a 0-d int tensor; a Python int is range-checked against ``rb.entries``."""
    if isinstance(offset, Handle):
        if offset.rank != 0 or not (offset.dtype.is_int):
            raise ValueError(
                f"{name}: a tensor offset must be a 0-d integer tensor; got {offset.dtype.name}"
                f"{list(offset.shape)}."
            )
        return offset
    if isinstance(offset, float) and math.isnan(offset):
        raise ValueError(
            f"{name}: offset is NaN; expected a non-negative int below {rb.entries} (the entries "
            f"of {rb!r}) or a 0-d int tensor."
        )
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(
            f"{name}: offset must be a non-negative int or a 0-d int tensor; got {offset!r}."
        )
    # Checked as an unbounded Python int, before it becomes a tensor: narrowing first would
    # turn 2**32 into 0 and silently address slot 0.
    if offset >= rb.entries:
        raise ValueError(
            f"{name}: offset {offset} is out of range for {rb!r}; valid offsets are 0 to "
            f"{rb.entries - 1}. Use a smaller offset or create the buffer with more entries."
        )
    # PopXL passes offsets as int32; only a buffer with more than 2**31 entries needs int64.
    dtype = _dtypes.int32 if offset <= _INT32_MAX else _dtypes.int64
    return constant(offset, dtype, "offset")


def remote_load(remote_buffer, offset: int | Handle, name: str | None = None) -> Handle:
    """Load slot ``offset`` of this replica's copy of ``remote_buffer``."""
    rb = _buffer(remote_buffer, "remote_load")
    off = _offset(offset, "remote_load", rb)
    graph = gcg()
    out = Handle._create(
        graph, name or "remote_load", _fake_like(rb.tensor_shape, rb.tensor_dtype), rb.meta_shape
    )
    graph._append_op(Op(load_opdef, "RemoteLoad", (off,), (out,), RemoteTransfer(rb)))
    return out


def remote_load_(remote_buffer, offset: int | Handle, t: Handle) -> Handle:
    """Load slot ``offset`` into ``t`` in place; sets ``t.meta_shape`` to the buffer's."""
    rb = _buffer(remote_buffer, "remote_load_")
    rb.validate_tensor_matches_buffer(t)
    off = _offset(offset, "remote_load_", rb)
    graph = gcg()
    t._meta_shape = rb.meta_shape
    graph._append_op(
        Op(load_inplace_opdef, "RemoteLoadInplace", (t, off), (t,), RemoteTransfer(rb))
    )
    return t


def remote_store(remote_buffer, offset: int | Handle, t: Handle) -> None:
    """Store ``t`` into slot ``offset`` of this replica's copy of ``remote_buffer``."""
    rb = _buffer(remote_buffer, "remote_store")
    if not isinstance(t, Handle):
        raise TypeError(f"remote_store expects a popxl Tensor to store; got {type(t).__name__}.")
    rb.validate_tensor_matches_buffer(t)
    off = _offset(offset, "remote_store", rb)
    graph = gcg()
    graph._append_op(Op(store_opdef, "RemoteStore", (t, off), (), RemoteTransfer(rb)))


# ---- the definitions of the IR ops -----------------------------------------------------------


def _offsets(offset: Tensor, batched: bool, num_replicas: int) -> Tensor:
    return offset if batched else offset.expand(num_replicas)


def _explicit_load(op: Op, batched, num_replicas: int):
    """Note [explicit batching] (runtime/explicit.py): ``fn(stacked_buffer, offset)``, one
    ``remote_load_stacked`` call for every replica."""
    bid = op.attrs.buffer.remote_buffer_id
    (offset_batched,) = batched

    def run(buffer, offset):
        return ops.remote_load_stacked(buffer, _offsets(offset, offset_batched, num_replicas), bid)

    return run


def _explicit_load_inplace(op: Op, batched, num_replicas: int):
    """``fn(stacked_buffer, t, offset)``: loads into the (batched) stacked ``t``."""
    bid = op.attrs.buffer.remote_buffer_id
    t_batched, offset_batched = batched
    if not t_batched:  # the analysis makes a loaded-into value batched; anything else is a bug
        return None

    def run(buffer, t, offset):
        offsets = _offsets(offset, offset_batched, num_replicas)
        return t.copy_(ops.remote_load_stacked(buffer, offsets, bid))

    return run


def _explicit_store(op: Op, batched, num_replicas: int):
    """``fn(stacked_buffer, value, offset)``: one ``remote_store_stacked_`` call; an unbatched
    value is the same on every replica."""
    bid = op.attrs.buffer.remote_buffer_id
    value_batched, offset_batched = batched

    def run(buffer, value, offset):
        values = stacked(value, 0 if value_batched else None, num_replicas)
        offsets = _offsets(offset, offset_batched, num_replicas)
        ops.remote_store_stacked_(buffer, offsets, values, bid)

    return run


# How the reference executor runs each op (the ``run`` rule): ``rt.buffer(op)`` is the list
# of per-replica rows of the op's buffer; values are lists of per-replica tensors.
def _run_load(rt, op: Op, ins):
    return [reference_load(rt.buffer(op), ins[0], op.attrs.buffer.remote_buffer_id)]


def _run_load_inplace(rt, op: Op, ins):
    loaded = reference_load(rt.buffer(op), ins[1], op.attrs.buffer.remote_buffer_id)
    for target, value in zip(ins[0], loaded, strict=True):
        target.copy_(value)
    return [ins[0]]


def _run_store(rt, op: Op, ins):
    reference_store(rt.buffer(op), ins[1], ins[0], op.attrs.buffer.remote_buffer_id)
    return []


# ---- the fast compiler (Note [lowering rules] in opdefs/lowering.py) --------------------------


def _analyse_load(op: Op, f, a: LowerAnalysis):
    if a.uniform(op.attrs.buffer.remote_buffer_id):
        # Note [replica-invariant remote buffers] (runtime/lower.py): only a fixed slot is
        # read as row 0
        if a.constant_offset(f) is None:
            return a.not_uniform(op.attrs.buffer.remote_buffer_id)
        a.set(f.outs[0], False)
        return None
    a.set(f.outs[0], a.rows)
    return None


def _analyse_load_inplace(op: Op, f, a: LowerAnalysis):
    if a.uniform(op.attrs.buffer.remote_buffer_id):
        return a.not_uniform(op.attrs.buffer.remote_buffer_id)
    return a.write(f.ins[0], a.rows)


def _analyse_store(op: Op, f, a: LowerAnalysis):
    bid = op.attrs.buffer.remote_buffer_id
    if a.uniform(bid) and any(a.b(n) for n in f.ins):
        return a.not_uniform(bid)  # a per-replica value or slot
    return a.whole_values(f.ins)


def _globals() -> dict:
    """The names the emitted lines below call."""
    return {
        "REMOTE_LOAD": torch.ops.torch_popxl.remote_load,
        "REMOTE_STORE": torch.ops.torch_popxl.remote_store_,
        # the OpOverload (not its raw ``_op``): torch.compile traces it (Note [inductor backend])
        "REMOTE_STORE_STACKED": torch.ops.torch_popxl.remote_store_stacked_.default,
    }


def _emit_load(op: Op, f, e: LowerEmission) -> None:
    bid = op.attrs.buffer.remote_buffer_id
    if e.explicit and e.uniform(bid):
        # Note [replica-invariant remote buffers]: row 0 of the slot (counted as the load
        # of every replica); a view when the value goes back to the same slot
        view = f"{e.slot_view(bid, e.constant_offset(f))}[0]"
        e.line(f"{f.outs[0]} = {view}{'' if e.is_view(f) else '.clone()'}")
        return
    if e.is_view(f):  # Note [remote slot views]
        e.line(f"{f.outs[0]} = {e.slot_view(bid, e.constant_offset(f))}")
        return
    if e.stacked_call(f):
        return
    e.line(f"{f.outs[0]} = REMOTE_LOAD(rt.buffers[{bid}], {f.ins[0]}, {bid})")


def _emit_load_inplace(op: Op, f, e: LowerEmission) -> None:
    if e.stacked_call(f):
        return
    bid = op.attrs.buffer.remote_buffer_id
    e.line(f"{f.ins[0]}.copy_(REMOTE_LOAD(rt.buffers[{bid}], {f.ins[1]}, {bid}))")


def _emit_store(op: Op, f, e: LowerEmission) -> None:
    bid = op.attrs.buffer.remote_buffer_id
    slot = e.stored_slot_view(f)
    if slot is not None:
        # Note [remote slot views]: the value is the slots themselves, so the kernel only
        # checks and counts the store; called directly with every replica's offset as one
        # constant, skipping the ``explicit`` rule's Python (35 -> 16 us a store in the MLP step).
        offsets = e.global_name(torch.full((e.rows,), slot, dtype=torch.int64))
        e.line(f"REMOTE_STORE_STACKED(rt.buffers[{bid}], {offsets}, {f.ins[0]}, {bid})")
        return
    if e.stacked_call(f):
        return
    e.line(f"REMOTE_STORE(rt.buffers[{bid}], {f.ins[1]}, {f.ins[0]}, {bid})")


def _define(name: str, effects: Effect, popart_type: str, rules: dict, **inplace) -> OpDef:
    return register(OpDef(name, effects, rules, popart_type, attrs=RemoteTransfer, **inplace))


load_opdef = _define(
    "remote_load",
    Effect.REMOTE | Effect.BUFFER_READ,
    "RemoteLoad",
    {
        "traffic": _traffic("remote_load"),
        "reference": reference_load,
        "run": _run_load,
        "wrapper": remote_load,
        "explicit": _explicit_load,
        "lower_analyse": _analyse_load,
        "lower_emit": _emit_load,
        "lower_globals": _globals,
    },
)
# remote_load_(t, offset) writes t (input 0) and returns it (output 0).
load_inplace_opdef = _define(
    "remote_load_",
    Effect.REMOTE | Effect.BUFFER_READ | Effect.INPLACE,
    "RemoteLoad",
    {
        "traffic": _traffic("remote_load"),
        "reference": reference_load,
        "run": _run_load_inplace,
        "wrapper": remote_load_,
        "explicit": _explicit_load_inplace,
        "lower_analyse": _analyse_load_inplace,
        "lower_emit": _emit_load_inplace,
        "lower_globals": _globals,
    },
    writes=frozenset({0}),
    aliases={0: 0},
)
store_opdef = _define(
    "remote_store",
    Effect.REMOTE | Effect.BUFFER_WRITE,
    "RemoteStore",
    {
        "traffic": _traffic("remote_store"),
        "reference": reference_store,
        "run": _run_store,
        "wrapper": remote_store,
        "explicit": _explicit_store,
        "lower_analyse": _analyse_store,
        "lower_emit": _emit_store,
        "lower_globals": _globals,
    },
)
