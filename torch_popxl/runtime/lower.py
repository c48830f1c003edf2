"""The fast executor: graphs lowered to straight-line Python, all replicas run at once.

Every graph becomes one generated Python function (``fn(rt, *inputs) -> outputs``) that
calls the recorded ops directly. The main program runs under ``torch.func.vmap`` over the
leading replica dimension of every runtime value, so R replicas cost one pass of Python; the
collective and remote-memory custom ops act across that dimension through their vmap rules.

Note [pass by value]
    A called graph must not change its caller's tensors unless the input is by-reference or
    marked modified. Ops run in place on the real values, so the call site clones exactly the
    inputs the callee may modify (``mutated_inputs``) and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..graph import Graph, Op, Slot
from ..tensor import Constant, Tensor
from . import kernels  # noqa: F401  (registers torch.ops.torch_popxl)

__all__ = ["compile_graph", "mutated_inputs", "Lowered"]

_SIMPLE = (int, bool, str, type(None))


def _alias_roots(graph: Graph) -> tuple[dict[str, int], set[int]]:
    """Map every tensor aliasing a graph input to that input's index; collect mutated inputs."""
    root: dict[str, int] = {t.id: i for i, t in enumerate(graph._inputs)}
    mutated: set[int] = set()

    def mark(t: Tensor) -> None:
        if t.id in root:
            mutated.add(root[t.id])

    for op in graph._ops:
        if op.kind == "torch":
            schema = getattr(op.attrs["target"], "_schema", None)
            if schema is None:
                continue
            args, kwargs = op.attrs["args"], op.attrs["kwargs"]
            alias_sets: dict[str, int] = {}
            for i, arg in enumerate(schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                slots = [v for v in _leaves(value) if isinstance(v, Slot)]
                info = arg.alias_info
                if info is None:
                    continue
                for s in slots:
                    t = op.inputs[s.index]
                    if info.is_write:
                        mark(t)
                    if t.id in root:
                        for a in info.before_set:
                            alias_sets[a] = root[t.id]
            for ret, out in zip(schema.returns, op.outputs):
                info = ret.alias_info
                if info is not None:
                    for a in info.before_set:
                        if a in alias_sets:
                            root.setdefault(out.id, alias_sets[a])
        elif op.kind == "remote_load_":
            mark(op.inputs[0])
        elif op.kind in ("call", "repeat"):
            callee_mut = mutated_inputs(op.attrs["graph"])
            for i in callee_mut & set(op.attrs["modified"]):
                mark(op.inputs[i])
    return root, mutated


def _leaves(x):
    if isinstance(x, list | tuple):
        for y in x:
            yield from _leaves(y)
    else:
        yield x


_mutated_cache: dict[tuple[int, int], frozenset[int]] = {}


def mutated_inputs(graph: Graph) -> frozenset[int]:
    """Indices of the graph's inputs that its ops may modify in place."""
    key = (id(graph), graph._version)
    if key not in _mutated_cache:
        _mutated_cache[key] = frozenset(_alias_roots(graph)[1])
    return _mutated_cache[key]


class _Emitter:
    """Generates the source of one graph function."""

    def __init__(self, lowered: Lowered, graph: Graph, params: list[Tensor], ops: list[Op], outputs):
        self.lowered = lowered
        self.graph = graph
        self.params = params
        self.ops = ops
        self.outputs = outputs
        self.names: dict[str, str] = {}
        self.lines: list[str] = []
        self.globals = lowered.globals

    def var(self, t: Tensor) -> str:
        if t.id in self.names:
            return self.names[t.id]
        if isinstance(t, Constant):
            return self.lowered.constant(t)
        raise AssertionError(f"tensor {t.id} used before it is defined in {self.graph.id}")

    def define(self, t: Tensor) -> str:
        name = f"v{len(self.names)}"
        self.names[t.id] = name
        return name

    def literal(self, x: Any, op: Op) -> str:
        if isinstance(x, Slot):
            return self.var(op.inputs[x.index])
        if isinstance(x, list):
            return "[" + ", ".join(self.literal(y, op) for y in x) + "]"
        if isinstance(x, tuple):
            return "(" + "".join(self.literal(y, op) + ", " for y in x) + ")"
        if isinstance(x, torch.device):
            return "DEVICE"
        if isinstance(x, float) and math.isfinite(x):
            return repr(x)
        if isinstance(x, _SIMPLE) and not isinstance(x, float):
            return repr(x)
        return self.lowered.literal(x)

    def emit(self) -> str:
        args = ", ".join(self.define(t) for t in self.params)
        self.lines.append(f"def fn(rt{', ' if args else ''}{args}):")
        for op in self.ops:
            getattr(self, f"op_{op.kind}")(op)
        outs = self.outputs
        rendered = []
        param_ids = {t.id for t in self.params}
        for t in outs:
            v = self.var(t)
            # Note [pass by value]: never hand the caller an alias of its own input.
            rendered.append(f"{v}.clone()" if t.id in param_ids else v)
        self.lines.append(f"    return ({''.join(r + ', ' for r in rendered)})")
        return "\n".join(self.lines)

    def op_torch(self, op: Op) -> None:
        target = op.attrs["target"]
        fn = self.lowered.literal(getattr(target, "_op", target) if _is_aten(target) else target)
        args = [self.literal(a, op) for a in op.attrs["args"]]
        args += [f"{k}={self.literal(v, op)}" for k, v in op.attrs["kwargs"].items()]
        call = f"{fn}({', '.join(args)})"
        paths = op.attrs["out_paths"]
        if not op.outputs:
            self.lines.append(f"    {call}")
            return
        if len(paths) == 1 and paths[0] == ():
            self.lines.append(f"    {self._target(op.outputs[0])} = {call}")
            return
        self.lines.append(f"    _r = {call}")
        for t, path in zip(op.outputs, paths):
            index = "".join(f"[{i}]" for i in path)
            self.lines.append(f"    {self._target(t)} = _r{index}")

    def _target(self, t: Tensor) -> str:
        # In-place ops return an existing tensor: keep its name (same runtime object).
        return self.names[t.id] if t.id in self.names else self.define(t)

    def op_host_load(self, op: Op) -> None:
        k = op.attrs["stream"]._index
        self.lines.append(f"    {self.define(op.outputs[0])} = rt.host_load({k})")

    def op_host_store(self, op: Op) -> None:
        k = op.attrs["stream"]._index
        self.lines.append(f"    rt.host_store({k}, {self.var(op.inputs[0])})")

    def op_remote_load(self, op: Op) -> None:
        bid = op.attrs["buffer"].remote_buffer_id
        off = self.var(op.inputs[0])
        self.lines.append(f"    {self.define(op.outputs[0])} = REMOTE_LOAD(rt.buffers[{bid}], {off}, {bid})")

    def op_remote_load_(self, op: Op) -> None:
        bid = op.attrs["buffer"].remote_buffer_id
        t, off = self.var(op.inputs[0]), self.var(op.inputs[1])
        self.lines.append(f"    {t}.copy_(REMOTE_LOAD(rt.buffers[{bid}], {off}, {bid}))")

    def op_remote_store(self, op: Op) -> None:
        bid = op.attrs["buffer"].remote_buffer_id
        t, off = self.var(op.inputs[0]), self.var(op.inputs[1])
        self.lines.append(f"    REMOTE_STORE(rt.buffers[{bid}], {off}, {t}, {bid})")

    def op_print(self, op: Op) -> None:
        title = self.lowered.literal(op.attrs)
        src = self.var(op.inputs[0])
        self.lines.append(f"    rt.print({title}, {src})")
        self.names[op.outputs[0].id] = src

    def _call_args(self, op: Op) -> list[str]:
        graph = op.attrs["graph"]
        clone = mutated_inputs(graph) - set(op.attrs["modified"])
        return [f"{self.var(t)}.clone()" if i in clone else self.var(t) for i, t in enumerate(op.inputs)]

    def op_call(self, op: Op) -> None:
        fn = self.lowered.graph_fn(op.attrs["graph"])
        call = f"{fn}(rt, {', '.join(self._call_args(op))})"
        if not op.outputs:
            self.lines.append(f"    {call}")
            return
        outs = "".join(self.define(t) + ", " for t in op.outputs)
        self.lines.append(f"    {outs}= {call}")

    def op_repeat(self, op: Op) -> None:
        graph = op.attrs["graph"]
        fn = self.lowered.graph_fn(graph)
        k = len(graph._outputs)
        args = self._call_args(op)
        self.lines.append(f"    _c = [{', '.join(args)}]")
        self.lines.append(f"    for _ in range({op.attrs['repeat_count']}):")
        if k:
            self.lines.append(f"        _c[:{k}] = {fn}(rt, *_c)")
        else:
            self.lines.append(f"        {fn}(rt, *_c)")
        for i, t in enumerate(op.outputs):
            self.lines.append(f"    {self.define(t)} = _c[{i}]")


def _is_aten(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"


class Lowered:
    """The generated functions of one Ir for one device (shared globals and constants)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.globals: dict[str, Any] = {
            "DEVICE": device,
            "REMOTE_LOAD": torch.ops.torch_popxl.remote_load,
            "REMOTE_STORE": torch.ops.torch_popxl.remote_store_,
        }
        self._literal_ids: dict[int, str] = {}
        self._keepalive: list[Any] = []
        self._constants: dict[int, str] = {}
        self._graph_fns: dict[int, str] = {}
        self.sources: dict[str, str] = {}

    def literal(self, x: Any) -> str:
        key = id(x)
        if key not in self._literal_ids:
            name = f"k{len(self._literal_ids)}"
            self._literal_ids[key] = name
            self._keepalive.append(x)
            self.globals[name] = x
        return self._literal_ids[key]

    def constant(self, t: Constant) -> str:
        key = id(t)
        if key not in self._constants:
            name = f"c{len(self._constants)}"
            self._constants[key] = name
            self.globals[name] = t._data.to(self.device)
        return self._constants[key]

    def graph_fn(self, graph: Graph) -> str:
        key = id(graph)
        if key not in self._graph_fns:
            name = f"g{len(self._graph_fns)}"
            self._graph_fns[key] = name
            self.globals[name] = self.compile(graph, list(graph._inputs), graph._ops, graph._outputs, name)
        return self._graph_fns[key]

    def compile(self, graph: Graph, params, ops, outputs, name: str) -> Callable:
        src = _Emitter(self, graph, params, list(ops), list(outputs)).emit()
        self.sources[name] = src
        scope: dict[str, Any] = {}
        exec(compile(src, f"<torch_popxl {graph.id} {name}>", "exec"), self.globals, scope)
        return scope["fn"]


def compile_graph(lowered: Lowered, graph: Graph, params: list[Tensor], ops: list[Op], name: str) -> Callable:
    """Compile ``ops`` of ``graph`` with ``params`` as arguments (no outputs)."""
    return lowered.compile(graph, params, ops, [], name)
