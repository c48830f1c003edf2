"""Executors: the fast one (generated code, explicit batching or ``vmap``) and the reference one.

Both run the same program against the same session state:

* ``state.vars``: ``{variable id: Tensor[R, *shape]}`` (on-chip variables, replica-stacked);
* ``state.persistent``: main-graph tensors made in the WeightsFromHost fragment (RTS shards);
* ``state.buffers``: ``{remote buffer id: Tensor[R, entries, *tensor_shape]}``;
* stream inputs ``Tensor[nht, R, *shape]``; outputs ``{stream index: Tensor[count, R, *shape]}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import opdefs
from ..ir.attrs import PrintOptions
from ..ir.graph import Graph, Op, OpKind, Slot
from ..ir.tensor import Constant, Tensor, Variable
from ..opdefs import backends
from ..opdefs.registry import Effect
from .lower import Program, lower_fragment, mutated_inputs

if TYPE_CHECKING:
    from ..ir.ir import Ir

__all__ = ["SessionState", "FastExecutor", "ReferenceExecutor", "fragment_signature"]


@dataclass
class SessionState:
    num_replicas: int
    device: torch.device
    vars: dict[str, torch.Tensor] = field(default_factory=dict)
    persistent: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)


def fragment_signature(ir: Ir) -> tuple[list[Variable], list[Tensor]]:
    """(on-chip variables, tensors defined in WeightsFromHost and used later)."""
    main = ir.main_graph
    on_chip = [v for v in ir._all_variables if v.info.remote is None]
    defined = [t for op in main._ops_in_context("weights_from_host") for t in op.outputs]
    return on_chip, defined


class _RunContext:
    """What generated code sees of one run: stream cursors, outputs, buffers."""

    def __init__(self, ins: list[torch.Tensor], buffers: dict[int, torch.Tensor], nht: int,
                 num_replicas: int = 1, anchor: torch.Tensor | None = None,
                 explicit_R: int | None = None):  # fmt: skip
        self.ins = ins
        self.nht = nht
        self.anchor = anchor
        self.explicit_R = explicit_R  # stacked [R, ...] values, no vmap
        self.num_replicas = num_replicas
        self.cursor = [0] * len(ins)
        self.outs: dict[int, list[torch.Tensor]] = {}
        self.prints: list[tuple[PrintOptions, torch.Tensor]] = []
        self.buffers = buffers

    def host_load(self, k: int) -> torch.Tensor:
        i = self.cursor[k]
        self.cursor[k] = i + 1
        value = self.ins[k][i % self.nht]
        _count_host_bytes(value, 1 if self.explicit_R else self.num_replicas)
        return value

    def host_store(self, k: int, value: torch.Tensor, snapshot: bool = True) -> None:
        _count_host_bytes(value, 1 if self.explicit_R else self.num_replicas)
        # A snapshot when later in-place ops may change the stored tensor (the compiler
        # passes snapshot=False when nothing can).
        self.outs.setdefault(k, []).append(value.clone() if snapshot else value)

    def print(self, attrs: PrintOptions, value: torch.Tensor) -> None:
        self.prints.append((attrs, value))

    def count_collective_call(self) -> None:
        backends.add_collective_traffic(0, 1)

    def sum_read(self, finish, value: torch.Tensor) -> torch.Tensor:
        """Finish a full-group reduction of a replica-sum accumulator whose ``value`` is
        already the sum over replicas, with the collective's ``sum_read`` rule (which counts
        the bytes the real collective moves)."""
        return finish(value, self.batch)

    def batch(self, value: torch.Tensor) -> torch.Tensor:
        """A per-replica copy of a replica-invariant value (Note [replica-invariant values])."""
        if self.explicit_R is not None:
            return value.unsqueeze(0).expand(self.explicit_R, *value.shape).clone()
        if self.anchor is None:
            return value
        if value.dtype == torch.bool:
            return torch.logical_or(value, self.anchor.to(torch.bool))
        return value + self.anchor.to(value.dtype)


def _count_host_bytes(value: torch.Tensor, num_replicas: int) -> None:
    # Under vmap `value` is one replica's entry; every replica moves its own copy.
    backends.add_host_bytes(num_replicas * value.numel() * value.element_size())


def _emit_prints(prints, num_replicas: int) -> None:
    for attrs, value in prints:
        if not attrs.print_self:
            continue
        for r in range(num_replicas):
            tag = f" (replica {r})" if num_replicas > 1 else ""
            with torch._tensor_str.printoptions(threshold=attrs.threshold, edgeitems=attrs.edge_items,
                                                linewidth=attrs.line_width, precision=attrs.digits):  # fmt: skip
                print(f"{attrs.title}{tag}: {value[r]}")


class FastExecutor:
    """Straight-line generated code, every replica at once under ``torch.func.vmap``."""

    def __init__(self, ir, device: torch.device):
        self.ir = ir
        self.device = device
        self.R = ir.instance_replication_factor
        # The program is compiled for the GLOBAL replica count (full-group collectives span
        # every instance); it runs under vmap over this process's R local replicas.
        self.global_R = ir.replication_factor
        self.on_chip, self.defined = fragment_signature(ir)
        uniform = (
            {v.id for v in self.on_chip if v.replica_grouping.num_groups == 1}
            if self.global_R > 1
            else set()
        )
        # Note [replica-sum accumulators]: only within one process (the sum spans all replicas).
        sums = ({v.id for v in self.on_chip if v.info.replica_sum} & uniform
                if self.global_R == self.R else set())  # fmt: skip
        forced: set[str] = set()
        while True:  # the fragments share variables: iterate until all agree
            self.program = Program(device, self.global_R)
            self.program.uniform_vars = set(uniform)
            self.program.sum_vars = set(sums)
            self.program.force_batched = set(forced)
            # Note [explicit batching] (runtime/explicit.py): only within one process.
            self.program.explicit_ok = self.global_R == self.R > 1
            self._compile()
            p = self.program
            if p.uniform_vars == uniform and p.force_batched == forced and p.sum_vars == sums:
                break
            uniform, forced, sums = set(p.uniform_vars), set(p.force_batched), set(p.sum_vars)
        self.uniform = frozenset(uniform)
        self.replica_sums = frozenset(sums)

    def _compile(self) -> None:
        main = self.ir.main_graph
        params = self.on_chip + self.defined
        flags = [True] * len(params)
        self.fns = {
            "weights_from_host": lower_fragment(
                self.program, main, self.on_chip, main._ops_in_context("weights_from_host"), self.defined,
                "wfh", flags[: len(self.on_chip)]),
            "normal": lower_fragment(self.program, main, params, main._ops_in_context("normal"), [], "main", flags),
            "weights_to_host": lower_fragment(
                self.program, main, params, main._ops_in_context("weights_to_host"), [], "wth", flags),
        }  # fmt: skip

    def allocate(self, state: SessionState, v) -> torch.Tensor:
        """Storage for an on-chip variable: replica-invariant ones are stored once."""
        shape, dtype = tuple(v.shape), v.dtype.as_torch()
        if v.id in self.uniform:
            return torch.zeros(shape, dtype=dtype, device=self.device).expand(self.R, *shape)
        return torch.zeros((self.R, *shape), dtype=dtype, device=self.device)

    def source(self) -> str:
        """The generated Python of every fragment (for inspection and debugging)."""
        return "\n\n".join(f"# {k}\n{v}" for k, v in self.program.sources.items())

    def run(self, state: SessionState, fragment: str, ins: list[torch.Tensor], nht: int):
        R = state.num_replicas
        fn = self.fns[fragment]
        tensors: list[Tensor] = list(self.on_chip)
        if fragment != "weights_from_host":
            tensors += self.defined
        values = [
            state.vars[t.id] if t.id in state.vars else state.persistent[t.id] for t in tensors
        ]
        buffers = state.buffers

        titles: list[dict] = []  # print attributes stay outside vmap (only tensors cross it)

        def step(var_vals, ins, buffers, anchor):
            rt = _RunContext(ins, buffers, nht, R, anchor)
            outs = fn(rt, *var_vals)
            titles[:] = [attrs for attrs, _ in rt.prints]
            return outs, rt.outs, [value for _, value in rt.prints]

        if getattr(fn, "explicit", False):
            # Note [explicit batching]: the fragment runs on the stacked tensors directly.
            var_vals = [
                v[0] if t.id in self.uniform else v for t, v in zip(tensors, values, strict=True)
            ]
            rt = _RunContext(ins, buffers, nht, R, None, explicit_R=R)
            outs = tuple(
                o if b else o.expand(R, *o.shape)
                for o, b in zip(fn(rt, *var_vals), fn.out_batched, strict=True)
            )
            stored, prints = rt.outs, []
        elif self.global_R == 1:
            outs, stored, prints = step(
                [v[0] for v in values],
                [x[:, 0] for x in ins],
                {k: b[0] for k, b in buffers.items()},
                None,
            )
            outs = tuple(o.unsqueeze(0) for o in outs)
            stored = {k: [t.unsqueeze(0) for t in ts] for k, ts in stored.items()}
            prints = [v.unsqueeze(0) for v in prints]
        else:
            # Note [replica-invariant values]: invariant variables enter vmap unbatched.
            var_vals = [
                v[0] if t.id in self.uniform else v for t, v in zip(tensors, values, strict=True)
            ]
            var_dims = [None if t.id in self.uniform else 0 for t in tensors]
            anchor = torch.zeros(R, device=state.device)
            outs, stored, prints = torch.func.vmap(
                step, in_dims=(var_dims, 1, 0, 0), randomness="different"
            )(var_vals, ins, buffers, anchor)
        if fragment == "weights_from_host":
            for t, value in zip(self.defined, outs, strict=True):
                state.persistent[t.id] = value
        _emit_prints(list(zip(titles, prints, strict=True)), R)
        return {k: torch.stack(ts) for k, ts in stored.items()}


# ---- the reference executor ---------------------------------------------------------------

_aten = torch.ops.aten


class ReferenceExecutor:
    """Plain interpretation, op by op, with a Python loop over replicas (the specification).

    Replicas run in lockstep: each op runs for every replica before the next op, and a
    collective sees every replica's input at once (``opdefs.reference``).
    """

    def __init__(self, ir, device: torch.device):
        self.ir = ir
        self.device = device
        self.on_chip, self.defined = fragment_signature(ir)

    def allocate(self, state: SessionState, v) -> torch.Tensor:
        return torch.zeros(
            (state.num_replicas, *v.shape), dtype=v.dtype.as_torch(), device=self.device
        )

    def run(self, state: SessionState, fragment: str, ins: list[torch.Tensor], nht: int):
        R = state.num_replicas
        main = self.ir.main_graph
        env: dict[str, list[torch.Tensor]] = {}
        for v in self.on_chip:
            env[v.id] = list(state.vars[v.id].unbind(0))  # views: updates reach the state
        if fragment != "weights_from_host":
            for t in self.defined:
                env[t.id] = list(state.persistent[t.id].unbind(0))
        rt = _RefRun(ins, state, nht, R)
        self._exec_ops(main._ops_in_context(fragment), env, rt)
        if fragment == "weights_from_host":
            for t in self.defined:
                state.persistent[t.id] = torch.stack(env[t.id])
        _emit_prints([(a, torch.stack(v)) for a, v in rt.prints], R)
        return {k: torch.stack([torch.stack(rows) for rows in ts]) for k, ts in rt.outs.items()}

    def _value(self, t: Tensor, env, R):
        if t.id not in env and isinstance(t, Constant):
            env[t.id] = [t._data.to(self.device)] * R
        return env[t.id]

    def _exec_ops(self, ops: list[Op], env, rt: _RefRun) -> None:
        R = rt.R
        for op in ops:
            ins = [self._value(t, env, R) for t in op.inputs]
            if op.kind == OpKind.TORCH:
                self._exec_torch(op, ins, env, R)
            elif op.kind == OpKind.HOST_LOAD:
                env[op.outputs[0].id] = rt.host_load(op.attrs.stream._index)
            elif op.kind == OpKind.HOST_STORE:
                _count_host_bytes(ins[0][0], R)
                rt.outs.setdefault(op.attrs.stream._index, []).append([x.clone() for x in ins[0]])
            elif op.kind == OpKind.REMOTE_LOAD:
                load = _reference_rule(op)
                env[op.outputs[0].id] = load(rt.buffer(op), ins[0], _buffer_id(op))
            elif op.kind == OpKind.REMOTE_LOAD_INPLACE:
                load = _reference_rule(op)
                for r, v in enumerate(load(rt.buffer(op), ins[1], _buffer_id(op))):
                    ins[0][r].copy_(v)
            elif op.kind == OpKind.REMOTE_STORE:
                _reference_rule(op)(rt.buffer(op), ins[1], ins[0], _buffer_id(op))
            elif op.kind == OpKind.PRINT:
                rt.prints.append((op.attrs, ins[0]))
                env[op.outputs[0].id] = ins[0]
            elif op.kind in (OpKind.CALL, OpKind.REPEAT):
                self._exec_call(op, ins, env, rt)
            else:
                raise NotImplementedError(
                    f"The reference executor has no rule for op kind {op.kind!r}."
                )

    def _exec_torch(self, op: Op, ins, env, R) -> None:
        target = op.attrs.target
        args, kwargs = op.attrs.args, op.attrs.kwargs
        opdef = opdefs.lookup(op)
        if opdef is not None and Effect.COLLECTIVE in opdef.effects:
            # The collective's per-replica semantics, run by the active backend over all replicas.
            semantics = opdef.rule("reference")
            env[op.outputs[0].id] = backends.collectives().reference(semantics, ins[0], *args[1:])
            return
        per_replica = []
        for r in range(R):
            a = _fill(args, ins, r, self.device)
            k = _fill(kwargs, ins, r, self.device)
            per_replica.append(target(*a, **k))
        for t, path in zip(op.outputs, op.attrs.out_paths, strict=True):
            values = []
            for res in per_replica:
                for i in path:
                    res = res[i]
                values.append(res)
            env[t.id] = values

    def _exec_call(self, op: Op, ins, env, rt: _RefRun) -> None:
        graph: Graph = op.attrs.graph
        clone = mutated_inputs(graph) - set(op.attrs.modified)
        carry = [[x.clone() for x in v] if i in clone else v for i, v in enumerate(ins)]
        count = op.attrs.repeat_count
        k = len(graph._outputs)
        for _ in range(count):
            sub_env = {t.id: v for t, v in zip(graph._inputs, carry, strict=True)}
            self._exec_ops(graph._ops, sub_env, rt)
            outs = [self._value(t, sub_env, rt.R) for t in graph._outputs]
            outs = [
                [x.clone() for x in o] if t in graph._inputs else o
                for t, o in zip(graph._outputs, outs, strict=True)
            ]
            if op.kind == OpKind.CALL:
                carry = outs
            else:
                carry[:k] = outs
        for i, t in enumerate(op.outputs):
            env[t.id] = carry[i]


def _reference_rule(op: Op):
    """The per-replica reference semantics from ``op``'s definition (``opdefs``)."""
    opdef = opdefs.lookup(op)
    assert opdef is not None, f"{op.kind} has no op definition"
    return opdef.rule("reference")


def _buffer_id(op: Op) -> int:
    return op.attrs.buffer.remote_buffer_id


def _fill(x, ins, r, device):
    if isinstance(x, Slot):
        return ins[x.index][r]
    if isinstance(x, list):
        return [_fill(y, ins, r, device) for y in x]
    if isinstance(x, tuple):
        return tuple(_fill(y, ins, r, device) for y in x)
    if isinstance(x, dict):
        return {k: _fill(v, ins, r, device) for k, v in x.items()}
    if isinstance(x, torch.device):
        return device
    return x


class _RefRun:
    def __init__(self, ins, state: SessionState, nht: int, R: int):
        self.ins = ins
        self.state = state
        self.nht = nht
        self.R = R
        self.cursor = [0] * len(ins)
        self.outs: dict[int, list[list[torch.Tensor]]] = {}
        self.prints: list = []

    def host_load(self, k: int) -> list[torch.Tensor]:
        i = self.cursor[k] % self.nht
        self.cursor[k] += 1
        _count_host_bytes(self.ins[k][i, 0], self.R)
        return [self.ins[k][i, r] for r in range(self.R)]

    def buffer(self, op: Op) -> list[torch.Tensor]:
        return list(self.state.buffers[op.attrs.buffer.remote_buffer_id].unbind(0))
