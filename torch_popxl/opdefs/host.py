"""Host streams: ``host_load`` and ``host_store`` (popxl.md §3). Each replica moves its own
row of the stream entry; the runtime counts the bytes (``backends.add_host_bytes``).
"""

from __future__ import annotations

from ..dtypes import nbytes
from ..ir.attrs import HostTransfer
from ..ir.context import gcg
from ..ir.graph import Op
from ..ir.streams import DeviceToHostStream, HostToDeviceStream
from ..ir.tensor import Tensor, _fake_like
from .lowering import LowerAnalysis, LowerEmission
from .registry import Effect, OpDef, Traffic, register

__all__ = ["analyse_store", "host_load", "host_load_opdef", "host_store", "host_store_opdef"]


def _load_traffic(op: Op, num_replicas: int) -> Traffic:
    out = op.outputs[0]
    return Traffic("host_to_device", num_replicas * nbytes(out.shape, out.dtype))


def _store_traffic(op: Op, num_replicas: int) -> Traffic:
    x = op.inputs[0]
    return Traffic("device_to_host", num_replicas * nbytes(x.shape, x.dtype))


def host_load(h2d_stream, name: str | None = None) -> Tensor:
    """Load the next entry of ``h2d_stream`` (one row per replica). The result is named
    ``<name>_hostload``, ``name`` defaulting to the stream's id, as upstream names it."""
    if not isinstance(h2d_stream, HostToDeviceStream):
        raise TypeError(f"host_load expects a HostToDeviceStream; got {type(h2d_stream).__name__}.")
    graph = gcg()
    if h2d_stream._ir is not graph.ir:
        raise ValueError(f"Stream {h2d_stream.tensor_id!r} belongs to another Ir.")
    out = Tensor._create(
        graph,
        (name or h2d_stream.tensor_id) + "_hostload",
        _fake_like(h2d_stream.shape, h2d_stream.dtype),
    )
    h2d_stream._used = True
    graph._append_op(Op(host_load_opdef, "HostLoad", (), (out,), HostTransfer(h2d_stream)))
    return out


def host_store(d2h_stream, t: Tensor) -> None:
    """Store ``t`` into the next entry of ``d2h_stream`` (one row per replica)."""
    if not isinstance(d2h_stream, DeviceToHostStream):
        raise TypeError(
            f"host_store expects a DeviceToHostStream; got {type(d2h_stream).__name__}."
        )
    graph = gcg()
    if not isinstance(t, Tensor):
        raise TypeError(f"ops.host_store expects a popxl Tensor; got {type(t).__name__}.")
    if t._graph is not graph:
        raise ValueError(f"host_store: tensor {t.id!r} is not in the current graph {graph.id!r}.")
    if t.dtype != d2h_stream.dtype:
        raise ValueError(
            f"host_store: tensor {t.id!r} has dtype {t.dtype.name} but stream "
            f"{d2h_stream.tensor_id!r} has dtype {d2h_stream.dtype.name}."
        )
    if tuple(t.shape) != tuple(d2h_stream.shape):
        raise ValueError(
            f"host_store: tensor {t.id!r} has shape {t.shape} but stream "
            f"{d2h_stream.tensor_id!r} has shape {d2h_stream.shape}."
        )
    d2h_stream._used = True
    graph._append_op(Op(host_store_opdef, "HostStore", (t,), (), HostTransfer(d2h_stream)))


# Host transfers have no per-replica reference rule: both executors read and write the
# streams themselves (asking for one raises MissingRuleError).
# The reference executor runs them through its stream services (the ``run`` rule): both
# executors read and write the streams themselves, so there is no per-replica reference rule.
def _run_load(rt, op: Op, ins):
    return [rt.host_load(op.attrs.stream._index)]


def _run_store(rt, op: Op, ins):
    rt.host_store(op.attrs.stream._index, ins[0])
    return []


# The fast compiler (Note [lowering rules] in opdefs/lowering.py). Host transfers work on
# stacked values and in folded loops as they are (``lower_stacked``): a folded loop loads and
# stores every iteration's entry at once.
def _analyse_load(op: Op, f, a: LowerAnalysis):
    a.set(f.outs[0], a.rows)
    return None


def _emit_load(op: Op, f, e: LowerEmission) -> None:
    k = op.attrs.stream._index
    if e.fold > 1:
        e.line(f"{f.outs[0]} = rt.host_load_folded({k}, {e.fold})")
        return
    e.line(f"{f.outs[0]} = rt.host_load({k})")


def analyse_store(op: Op, f, a: LowerAnalysis):
    """A value handed to the host whole (a host store, a print)."""
    return a.whole_values(f.ins)


def _emit_store(op: Op, f, e: LowerEmission) -> None:
    # A stored value needs a snapshot only if something may update it in place later.
    name = f.ins[0]
    snapshot = e.written(name)
    if e.explicit and not e.b(name):  # one row per replica on the host side
        name, snapshot = f"{name}.expand({e.rows}, *{name}.shape)", True
    k = op.attrs.stream._index
    if e.fold > 1:  # one store per folded iteration
        e.line(f"rt.host_store_folded({k}, {name}, {snapshot}, {e.fold})")
        return
    e.line(f"rt.host_store({k}, {name}, {snapshot})")


def _stacked(op: Op) -> bool:
    return True


host_load_opdef = register(
    OpDef(
        "host_load",
        Effect.HOST_IO,
        {
            "traffic": _load_traffic,
            "wrapper": host_load,
            "run": _run_load,
            "lower_analyse": _analyse_load,
            "lower_emit": _emit_load,
            "lower_stacked": _stacked,
        },
        "HostLoad",
        attrs=HostTransfer,
    )  # fmt: skip
)
host_store_opdef = register(
    OpDef(
        "host_store",
        Effect.HOST_IO,
        {
            "traffic": _store_traffic,
            "wrapper": host_store,
            "run": _run_store,
            "lower_analyse": analyse_store,
            "lower_emit": _emit_store,
            "lower_stacked": _stacked,
        },
        "HostStore",
        attrs=HostTransfer,
    )  # fmt: skip
)
