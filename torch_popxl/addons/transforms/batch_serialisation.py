"""Batch serialisation (popxl-addons' ``transforms.batch_serialisation``; issue 16).

Note [batch serialisation]
    ``batch_serialise(graph, steps, ...)`` returns a graph that runs ``graph`` ``steps`` times,
    one micro batch per step: each step loads the inputs named in ``load_handles`` (from a host
    stream, or from a remote buffer), calls ``graph``, and stores what ``store_streams`` /
    ``store_buffers`` name (to a host stream or a remote buffer). Inputs without a load handle
    become inputs of the returned graph, passed unchanged to every step (by reference where
    ``graph`` takes them by reference, so accumulators add up over the steps). Outputs with no
    store handle are dropped. Only one micro batch of intermediates is alive at a time; the
    full batch lives in streaming memory.

    The returned graph's first input is a row index ``r`` (``call(0)``). A remote buffer is a
    matrix of ``rows`` rows by ``steps`` columns: step ``s`` with handle row offset ``o``
    addresses entry ``(r + o) * steps + s``; an offset of ``None`` always addresses row 0
    (entry ``s``); an offset that is a function maps ``r`` (an int32 tensor) to the row itself,
    entry ``f(r) * steps + s`` (T5's finetuning reads its encoder and decoder masks from the
    rows of one buffer this way). Buffers grow (``entries``) to hold the rows they are
    addressed with by an int offset, as in popxl-addons; a function's rows must already fit.

    ``batch_serialise_fwd_and_grad`` serialises a forward graph and its gradient graph
    together: each activation the gradient graph needs is stored by the forward loop into a
    buffer of its own (sharded over a replica group where ``store_buffers`` maps it to a
    ``ReplicaGrouping``) and loaded by the gradient loop at the same step; activations that are
    variables (``named_inputs_for_grad_graph``) become named inputs of the gradient loop.

    A handle is a ``RemoteHandle``, a ``RemoteBuffer`` (row offset 0), or a tuple in
    popxl-addons' older spellings: ``(buffer, row_offset)`` or, for an activation buffer sharded
    over a replica group, ``(buffer, row_offset, grouping)`` (``RemoteHandle(*handle)``
    upstream). ``entries=`` is popxl-addons 3.0's name for ``rows``; a ``RemoteHandle`` unpacks
    as that version's ``(buffer, row_offset)`` tuple.

    ``io_mode`` says where loads and stores run on an IPU: "compute" tiles, "io" tiles, or IO
    tiles overlapped with compute ("io_overlapped", with at least 2 steps: the prologue / loop /
    epilogue schedule of ``_overlapped``, where each step's inputs are loaded one step ahead and
    its results stored one step later). The simulator has no tiles (the IO modes tag the
    transfers with the IO tile set); every mode gives the same numbers. A random
    seed input (``seed_input``) is passed unchanged to every step: the simulator's random ops
    draw from the session's generator, not from seed tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

from ... import dtypes as _dtypes
from ...errors import given
from ...ir.context import in_sequence, io_tiles
from ...ir.remote_buffer import RemoteBuffer
from ...ir.replica_grouping import ReplicaGrouping
from ...ir.streams import DeviceToHostStream, HostToDeviceStream
from ...ir.tensor import Tensor, graph_input, graph_output
from ...ops import collectives, host_load, host_store, remote_load, remote_store
from ...ops.call import repeat
from ...transforms.autodiff import ExpectedConnectionType, GradGraphInfo
from ..graph import GraphWithNamedArgs
from ..named_tensors import NamedTensors
from ..remote import create_remote_buffer
from ..rts import gather_replica_sharded_tensor

__all__ = [
    "batch_serialise", "batch_serialise_fwd_and_grad", "batch_serial_buffer", "BatchSerialResult",
    "RemoteHandle",
]  # fmt: skip

IoMode = Literal["compute", "io", "io_overlapped"]


@dataclass
class RemoteHandle:
    """Where a tensor lives in streaming memory: a buffer, the row offset into it (``None``:
    always row 0; a function of the row index: the row; see Note [batch serialisation]) and
    the replica group it is sharded over (``None``: not sharded)."""

    buffer: RemoteBuffer
    row_offset: int | Callable[[Tensor], Tensor] | None = 0
    shard_group: ReplicaGrouping | None = None

    def __iter__(self):
        # popxl-addons 3.0 returned (buffer, row_offset) tuples: ``buffer, _ = handle``.
        return iter((self.buffer, self.row_offset))


@dataclass
class BatchSerialResult:
    """The transformed graph and ``{original tensor: RemoteHandle}`` of what it stored."""

    graph: GraphWithNamedArgs
    stored_buffers: dict[Tensor, RemoteHandle]
    _remap_dict: dict[Tensor, Tensor]

    def remap_tensors(self, ts: NamedTensors) -> NamedTensors:
        """``ts`` (tensors of the original graph) as the corresponding inputs of the new one."""
        return ts.remap(self._remap_dict)


def batch_serial_buffer(t: Tensor, steps: int = 1, rows: int = 1,
                        shard_group: ReplicaGrouping | None = None) -> RemoteBuffer:  # fmt: skip
    """A remote buffer for ``t`` with ``steps * rows`` entries (a ``rows`` x ``steps`` matrix),
    sharded over ``shard_group`` when one of more than one replica is given."""
    for name, v in (("steps", steps), ("rows", rows)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"batch_serial_buffer: {name} must be a positive int; got {v!r}.")
    shard_over = shard_group.group_size if shard_group is not None else 1
    return create_remote_buffer(
        t, entries=steps * rows, replica_group=shard_group, shard_over=shard_over
    )


# ---- argument checking ----------------------------------------------------------------------


def _as_handle(t: Any, h: Any, what: str, streams_ok: bool) -> HostToDeviceStream | RemoteHandle:
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: keys must be popxl Tensors; got {given(t)}.")
    if isinstance(h, RemoteHandle):
        return h
    if streams_ok and isinstance(h, HostToDeviceStream):
        return h
    if isinstance(h, RemoteBuffer):
        return RemoteHandle(h, 0)
    if (
        isinstance(h, tuple)
        and len(h) in (2, 3)
        and isinstance(h[0], RemoteBuffer)
        and (h[1] is None or (isinstance(h[1], int) and not isinstance(h[1], bool)))
        and (len(h) == 2 or h[2] is None or isinstance(h[2], ReplicaGrouping))
    ):
        return RemoteHandle(*h)
    allowed = "a HostToDeviceStream, " if streams_ok else ""
    raise TypeError(
        f"{what}[{t.id!r}]: expected {allowed}a RemoteHandle or a (RemoteBuffer, row_offset) "
        f"or (RemoteBuffer, row_offset, ReplicaGrouping) tuple; got {h!r}."
    )


def _handles(d: Mapping | None, what: str, streams_ok: bool) -> dict:
    return {t: _as_handle(t, h, what, streams_ok) for t, h in (d or {}).items()}


def _check_streams(d: Mapping | None) -> dict[Tensor, DeviceToHostStream]:
    out = {}
    for t, s in (d or {}).items():
        if not isinstance(t, Tensor) or not isinstance(s, DeviceToHostStream):
            raise TypeError(
                "store_streams must map popxl Tensors to DeviceToHostStreams; got "
                f"{type(t).__name__} -> {type(s).__name__}."
            )
        out[t] = s
    return out


def _check_common(graph: Any, steps: Any, rows: Any, io_mode: Any) -> None:
    if not isinstance(graph, GraphWithNamedArgs):
        raise TypeError(f"batch_serialise expects a GraphWithNamedArgs; got {given(graph)}.")
    for name, v in (("steps", steps), ("rows", rows)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"batch_serialise: {name} must be a positive int; got {v!r}.")
    if io_mode not in ("compute", "io", "io_overlapped"):
        raise ValueError(
            f"Unknown io_mode {io_mode!r}. Supported: ('compute', 'io', 'io_overlapped')."
        )


def _rows_or_entries(rows: Any, entries: Any) -> Any:
    if entries is None:
        return rows
    if rows != 1:
        raise TypeError(
            f"batch_serialise: pass rows= or entries= (its popxl-addons 3.0 name), not both; "
            f"got rows={rows!r}, entries={entries!r}."
        )
    return entries


# ---- the transform --------------------------------------------------------------------------


def _entry(index: Tensor, h: RemoteHandle, steps: int, rows: int) -> Tensor:
    """The buffer entry of the current step; grows ``h.buffer`` to hold the rows addressed."""
    if h.row_offset is None:
        h.buffer.entries = max(h.buffer.entries, steps)
        return index % steps
    if callable(h.row_offset):  # ``index`` is r * steps + s (Note [batch serialisation])
        return h.row_offset(index / steps) * steps + index % steps
    h.buffer.entries = max(h.buffer.entries, steps * (h.row_offset + rows))
    return index + h.row_offset * steps if h.row_offset else index


def batch_serialise(graph: GraphWithNamedArgs, steps: int,
                    load_handles: Mapping[Tensor, Any], store_streams: Mapping[Tensor, DeviceToHostStream],
                    store_buffers: Mapping[Tensor, Any], seed_input: Tensor | None = None,
                    rows: int = 1, io_mode: IoMode = "io", *,
                    entries: int | None = None) -> BatchSerialResult:  # fmt: skip
    """Run ``graph`` ``steps`` times over micro batches (Note [batch serialisation]).

    ``load_handles``: ``{graph input: HostToDeviceStream | RemoteHandle | (RemoteBuffer,
    row_offset)}``; ``store_streams``: ``{graph output or input: DeviceToHostStream}``;
    ``store_buffers``: ``{graph output or input: RemoteHandle | (RemoteBuffer, row_offset)}``.
    Returns the new graph (inputs: row index, [seed], then the inputs of ``graph`` without a
    load handle, with ``graph``'s named args remapped) and the buffers it stored to. The
    arguments are not modified. ``entries``: popxl-addons 3.0's name for ``rows``.
    """
    rows = _rows_or_entries(rows, entries)
    _check_common(graph, steps, rows, io_mode)
    loads = _handles(load_handles, "load_handles", streams_ok=True)
    streams = _check_streams(store_streams)
    buffers = _handles(store_buffers, "store_buffers", streams_ok=False)
    return _serialise(graph, steps, loads, streams, buffers, seed_input, rows, io_mode)


def _serialise(graph: GraphWithNamedArgs, steps: int, loads: dict, streams: dict, buffers: dict,
               seed_input: Tensor | None, rows: int, io_mode: str) -> BatchSerialResult:  # fmt: skip
    g = graph.graph
    for what, d in (
        ("load_handles", loads),
        ("store_streams", streams),
        ("store_buffers", buffers),
    ):
        for t in d:
            if t not in g:
                raise ValueError(
                    f"{what}: {t.id!r} is not a tensor of {g.id!r}; name inputs and outputs of "
                    "the graph being serialised."
                )
    if seed_input is not None and seed_input not in g.inputs:
        raise ValueError(f"seed_input {seed_input.id!r} is not an input of {g.id!r}.")
    stray = [t.id for t in loads if t not in g.inputs]
    if stray:
        raise ValueError(f"load_handles: {stray} are not inputs of {g.id!r}; only inputs load.")

    def remote_in(t: Tensor) -> bool:
        return t in loads and isinstance(loads[t], RemoteHandle)

    loaded_ts = [t for t in g.inputs if t in loads]
    # An input loaded from a remote buffer already lives there: it is not stored again.
    stored_ts = [t for t in (*g.inputs, *g.outputs)
                 if not remote_in(t) and (t in streams or t in buffers)]  # fmt: skip
    through_ts = [t for t in g.inputs if t is not seed_input and t not in loads]
    tiles = io_tiles if io_mode != "compute" else nullcontext
    ir = g.ir

    def like(t: Tensor, by_ref: bool | None = None) -> Tensor:
        ref = g.is_input_by_ref(t) if by_ref is None else by_ref
        return graph_input(t.shape, t.dtype, t.name, ref, t.meta_shape)

    def load(index: Tensor) -> list[Tensor]:
        """Load (and gather, where sharded) the inputs of the step ``index``."""
        loaded = []
        with tiles():
            for t in loaded_ts:
                h = loads[t]
                if isinstance(h, HostToDeviceStream):
                    loaded.append(host_load(h, t.name))
                    continue
                x = remote_load(h.buffer, _entry(index, h, steps, rows), t.name)
                if h.shard_group is not None and h.shard_group.group_size > 1:
                    x = gather_replica_sharded_tensor(x, replica_group=h.shard_group)
                loaded.append(x)
        return loaded

    def compute(loaded: list[Tensor], through: list[Tensor], seed: Tensor | None) -> list[Tensor]:
        args = dict(zip(loaded_ts, loaded, strict=True))
        args.update(zip(through_ts, through, strict=True))
        if seed_input is not None and seed is not None:
            args[seed_input] = seed
        info = graph.call_with_info(args=args)
        return [info.graph_to_parent(t) for t in stored_ts]

    def store(index: Tensor, values: list[Tensor]) -> None:
        """Store (slicing where sharded) the results of the step ``index``."""
        with tiles():
            for t, x in zip(stored_ts, values, strict=True):
                if t in streams:
                    host_store(streams[t], x)
                if t in buffers:
                    h = buffers[t]
                    if h.shard_group is not None and h.shard_group.group_size > 1:
                        x = collectives.replica_sharded_slice(x, group=h.shard_group)
                    remote_store(h.buffer, _entry(index, h, steps, rows), x)

    loop = ir.create_empty_graph(f"{g.name}_repeat_graph")
    with loop, in_sequence(True):
        row = graph_input((), _dtypes.int32, "batch_serial_loop_index")
        with tiles():
            index = row * steps
        seed = (
            graph_input((2,), _dtypes.uint32, "batch_serial_random_seed")
            if seed_input is not None
            else None
        )
        outer = [like(t) for t in through_ts]
        if io_mode == "io_overlapped" and steps >= 2:

            def new_through() -> list[Tensor]:
                return [like(t) for t in through_ts]

            _overlapped(
                ir, g.name, steps, index, seed, outer, new_through, like, load, compute, store
            )
        else:
            micro = ir.create_empty_graph(f"{g.name}_batch_serial_step")
            with micro, in_sequence(True):
                i = graph_input((), _dtypes.int32, "batch_serial_index")
                s = like(seed, False) if seed is not None else None
                through = [like(t) for t in through_ts]
                store(i, compute(load(i), through, s))
                with tiles():
                    graph_output(i + 1)
            inputs = dict(zip(through, outer, strict=True))
            if seed is not None and s is not None:
                inputs[s] = seed
            repeat(micro, steps, index, inputs_dict=inputs)

    remap = dict(zip(through_ts, outer, strict=True))
    stored = {}
    for t in buffers:
        stored[t] = loads[t] if remote_in(t) else buffers[t]
    return BatchSerialResult(GraphWithNamedArgs(loop, graph.args.remap(remap)), stored, remap)


def _overlapped(ir: Any, name: str, steps: int, index: Tensor, seed: Tensor | None,
                outer: list[Tensor], new_through: Callable[[], list[Tensor]],
                like: Callable[[Tensor, bool], Tensor], load: Callable[[Tensor], list[Tensor]],
                compute: Callable[[list[Tensor], list[Tensor], Tensor | None], list[Tensor]],
                store: Callable[[Tensor, list[Tensor]], None]) -> None:  # fmt: skip
    """The loop of io_mode "io_overlapped" (popxl-addons' schedule): step i's loads and step
    i-2's stores are issued next to step i-1's compute, so on an IPU the IO tiles move data
    while the compute tiles work. Loaded inputs and results wait one step as loop-carried
    values::

        load 0
        load 1, compute 0
        repeat i = 2 .. steps-1:  store i-2, load i, compute i-1
        store steps-2, compute steps-1
        store steps-1
    """
    with io_tiles():
        loaded = load(index)
        index = index + 1
        next_loaded = load(index)
    results = compute(loaded, outer, seed)
    with io_tiles():
        index = index + 1
    if steps > 2:
        micro = ir.create_empty_graph(f"{name}_batch_serial_step")
        with micro, in_sequence(True):
            i = graph_input((), _dtypes.int32, "batch_serial_index")
            waiting = [like(x, False) for x in next_loaded]
            done = [like(x, False) for x in results]
            s = like(seed, False) if seed is not None else None
            through = new_through()
            with io_tiles():
                store(i - 2, done)
                fresh = load(i)
            computed = compute(waiting, through, s)
            with io_tiles():
                graph_output(i + 1)
            for x in (*fresh, *computed):
                graph_output(x)
        inputs = dict(zip(through, outer, strict=True))
        if seed is not None and s is not None:
            inputs[s] = seed
        index, *carried = repeat(micro, steps - 2, index, *next_loaded, *results,
                                 inputs_dict=inputs)  # fmt: skip
        next_loaded, results = carried[: len(next_loaded)], carried[len(next_loaded) :]
    with io_tiles():
        store_index = index - 2
    store(store_index, results)
    results = compute(next_loaded, outer, seed)
    with io_tiles():
        store(store_index + 1, results)


def batch_serialise_fwd_and_grad(forward_graph: GraphWithNamedArgs, gradient_graph: GraphWithNamedArgs,
                                 named_inputs_for_grad_graph: NamedTensors, steps: int,
                                 load_handles: Mapping[Tensor, Any],
                                 store_streams: Mapping[Tensor, DeviceToHostStream],
                                 store_buffers: Mapping[Tensor, Any], seed_input: Tensor | None = None,
                                 rows: int = 1, io_mode: IoMode = "io", *, entries: int | None = None,
                                 ) -> tuple[BatchSerialResult, BatchSerialResult]:  # fmt: skip
    """Batch-serialise a forward graph and its gradient graph (Note [batch serialisation]).

    Every activation the gradient graph takes from the forward is stored per step by the forward
    loop and loaded by the gradient loop, unless it is one of ``named_inputs_for_grad_graph``
    (usually ``forward_graph.args``: the weights), which become named args of the gradient loop
    under the same keys. A ``store_buffers`` value may be a ``ReplicaGrouping``: that
    activation's buffer is then sharded over the group. The gradient seeds (``FwdGrad`` inputs)
    need load handles. Returns (forward result, gradient result); the arguments are not
    modified. ``entries``: popxl-addons 3.0's name for ``rows``.
    """
    rows = _rows_or_entries(rows, entries)
    _check_common(forward_graph, steps, rows, io_mode)
    _check_common(gradient_graph, steps, rows, io_mode)
    try:
        info = gradient_graph.grad_graph_info
    except AttributeError:
        raise ValueError(
            f"batch_serialise_fwd_and_grad: {gradient_graph.graph.id!r} is not a gradient graph "
            "(no grad_graph_info); pass the graph returned by addons.autodiff."
        ) from None
    if info.forward_graph is not forward_graph.graph:
        raise ValueError(
            f"{gradient_graph.graph.id!r} is the gradient of {info.forward_graph.id!r}, not of "
            f"{forward_graph.graph.id!r}."
        )
    loads = _handles(load_handles, "load_handles", streams_ok=True)
    streams = _check_streams(store_streams)
    shard_groups = {
        t: v for t, v in (store_buffers or {}).items() if isinstance(v, ReplicaGrouping)
    }
    buffers = _handles(
        {t: v for t, v in (store_buffers or {}).items() if t not in shard_groups},
        "store_buffers",
        streams_ok=False,
    )
    key_of = {t: k for k, t in named_inputs_for_grad_graph.to_dict().items()}
    grad_inputs = gradient_graph.graph.inputs
    expected = list(enumerate(info.expected_inputs))
    activations = [
        (i, ec) for i, ec in expected if ec.connection_type is ExpectedConnectionType.Fwd
    ]
    # Checked before any graph is created, so a failed call leaves the Ir as it was.
    for i, ec in expected:
        if ec.connection_type is ExpectedConnectionType.FwdGrad and grad_inputs[i] not in loads:
            raise ValueError(
                f"The gradient input {grad_inputs[i].id!r} (index {i}, the gradient of "
                f"{ec.fwd_tensor.id!r}) needs a load handle: add it to load_handles."
            )
    fwd_buffers = dict(buffers)
    for _, ec in activations:
        t = ec.fwd_tensor
        if t in fwd_buffers or t in key_of:
            continue
        if t in loads and isinstance(loads[t], RemoteHandle):
            fwd_buffers[t] = loads[t]
        else:
            sg = shard_groups.get(t)
            fwd_buffers[t] = RemoteHandle(batch_serial_buffer(t, steps, rows, sg), 0, sg)
    fwd_loads = {t: h for t, h in loads.items() if t in forward_graph.graph}
    fwd_streams = {t: s for t, s in streams.items() if t in forward_graph.graph}
    fwd_stored = {t: h for t, h in fwd_buffers.items() if t in forward_graph.graph}
    forward = _serialise(
        forward_graph, steps, fwd_loads, fwd_streams, fwd_stored, seed_input, rows, io_mode
    )

    grad_loads: dict = {}
    named: dict[str, Tensor] = {}
    for i, ec in activations:
        t = ec.fwd_tensor
        if t in key_of:
            named[key_of[t]] = grad_inputs[i]
        elif t in forward.stored_buffers:
            grad_loads[grad_inputs[i]] = forward.stored_buffers[t]
        else:  # unreachable: every activation got a buffer above
            raise AssertionError(f"activation {t.id!r} has no buffer")
    for i, ec in expected:
        if ec.connection_type is ExpectedConnectionType.FwdGrad:
            grad_loads[grad_inputs[i]] = loads[grad_inputs[i]]
    named.update(gradient_graph.args.to_dict())
    grad_named = GraphWithNamedArgs(gradient_graph.graph, NamedTensors.from_dict(named), info)
    bwd_streams = {t: s for t, s in streams.items() if t in gradient_graph.graph}
    bwd_stored = {t: h for t, h in buffers.items() if t in gradient_graph.graph}
    gradient = _serialise(
        grad_named, steps, grad_loads, bwd_streams, bwd_stored, None, rows, io_mode
    )
    # The loop takes no activations from a forward call site and returns nothing (the results
    # are stored), so it has no expected connections.
    gradient.graph.grad_graph_info = GradGraphInfo._create(
        gradient.graph.graph, forward_graph.graph, (), ()
    )
    return forward, gradient
