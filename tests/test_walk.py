"""ir/walk.py: the one interpreter of the IR's control structure, and its uses.

A small evaluator over real tensors (one value per tensor) exercises the walker's calls, nested
calls, repeats with loop-carried values, pass-by-value and output paths against hand-computed
numbers; ``executed_ops`` and ``mutated_inputs`` are checked on hand-built programs; the fast
compiler's analysis plan is checked to be frozen.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.ir.graph import Slot
from torch_popxl.ir.walk import Interpreter, executed_ops, mutated_inputs
from torch_popxl.runtime.executor import FastExecutor


def _fill(x, ins):
    if isinstance(x, Slot):
        return ins[x.index]
    if isinstance(x, list | tuple):
        return type(x)(_fill(y, ins) for y in x)
    return x


class _Eval(Interpreter[torch.Tensor]):
    """Runs captured torch ops on real tensors; counts the copies the walker asks for."""

    def __init__(self):
        self.copies = 0
        self.ran: list[str] = []

    def op(self, op, ins, env):
        self.ran.append(str(op.attrs.target))
        result = op.attrs.target(*_fill(op.attrs.args, ins), **op.attrs.kwargs)
        outs = []
        for path in op.attrs.out_paths:
            value = result
            for i in path:
                value = value[i]
            outs.append(value)
        return outs

    def constant(self, t):
        return t._data.clone()

    def copy(self, value):
        self.copies += 1
        return value.clone()


def _run(graph, *args: torch.Tensor) -> tuple[_Eval, list[torch.Tensor]]:
    ev = _Eval()
    env = ev.run(graph._ops, ev.bind(graph, list(args)))
    return ev, [env[t.id] for t in graph._outputs]


def _spec(ir, n=3):
    with ir.main_graph:
        return popxl.variable(np.zeros(n, np.float32))


def test_call_binds_args_to_callee_inputs_and_callee_outputs_to_op_outputs():
    ir = popxl.Ir()
    spec = _spec(ir)
    inner = ir.create_graph(lambda a, b: (a * 2.0 + b, a - b), spec, spec)
    outer = ir.create_graph(lambda a, b: ops.call(inner, b, a)[1] * 10.0, spec, spec)
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, 7.0, 11.0])
    ev, (out,) = _run(outer, a, b)
    # inner(b, a)[1] = b - a, times 10.
    assert out.tolist() == [40.0, 50.0, 80.0]
    assert ev.copies == 0  # nothing is modified: no copies


def test_nested_calls_enter_every_level():
    ir = popxl.Ir()
    spec = _spec(ir)
    g1 = ir.create_graph(lambda a: a + 1.0, spec)
    g2 = ir.create_graph(lambda a: ops.call(g1, a)[0] * 3.0, spec)
    g3 = ir.create_graph(lambda a: ops.call(g2, ops.call(g1, a)[0])[0] - 2.0, spec)
    ev, (out,) = _run(g3, torch.tensor([0.0, 1.0, 2.0]))
    # ((a + 1) + 1) * 3 - 2
    assert out.tolist() == [4.0, 7.0, 10.0]
    assert ev.ran.count("aten.add.Tensor") == 2


def test_repeat_feeds_body_outputs_into_next_iteration_and_keeps_the_rest():
    ir = popxl.Ir()
    spec = _spec(ir)
    # Two inputs, one output: the output replaces input 0; input 1 stays the same.
    body = ir.create_graph(lambda acc, step: acc * 2.0 + step, spec, spec)
    main = ir.create_graph(lambda x, s: ops.repeat(body, 3, x, s)[0], spec, spec)
    _, (out,) = _run(main, torch.tensor([1.0, 0.0, -1.0]), torch.tensor([1.0, 2.0, 3.0]))
    # acc -> 2 acc + s, three times: 8 acc + 7 s.
    assert out.tolist() == [15.0, 14.0, 13.0]


def test_repeat_zero_times_returns_the_carried_inputs():
    ir = popxl.Ir()
    spec = _spec(ir)
    body = ir.create_graph(lambda acc: acc + 1.0, spec)
    main = ir.create_graph(lambda x: ops.repeat(body, 0, x)[0] * 1.0, spec)
    _, (out,) = _run(main, torch.tensor([4.0, 5.0, 6.0]))
    assert out.tolist() == [4.0, 5.0, 6.0]


def _add_one_in_place(a):
    a += 1.0
    return a * 1.0


def test_by_value_input_is_copied_so_the_caller_keeps_its_value():
    ir = popxl.Ir()
    spec = _spec(ir)
    inner = ir.create_graph(_add_one_in_place, spec)
    assert mutated_inputs(inner) == {0}
    main = ir.create_graph(lambda x: ops.call(inner, x)[0] + x, spec)
    x = torch.tensor([1.0, 2.0, 3.0])
    ev, (out,) = _run(main, x)
    assert x.tolist() == [1.0, 2.0, 3.0]  # the caller's value is untouched
    assert out.tolist() == [3.0, 5.0, 7.0]  # (x + 1) + x
    assert ev.copies == 1


def test_input_marked_modified_is_passed_by_reference():
    ir = popxl.Ir()
    spec = _spec(ir)
    inner = ir.create_graph(_add_one_in_place, spec)

    def caller(x):
        info = ops.call_with_info(inner, x)
        info.set_parent_input_modified(x)
        return info.outputs[0] + x

    main = ir.create_graph(caller, spec)
    assert mutated_inputs(main) == {0}  # the modification reaches main's own input
    x = torch.tensor([1.0, 2.0, 3.0])
    ev, (out,) = _run(main, x)
    assert x.tolist() == [2.0, 3.0, 4.0]
    assert out.tolist() == [4.0, 6.0, 8.0]  # (x + 1) + (x + 1)
    assert ev.copies == 0


def test_callee_output_that_is_its_own_input_is_copied_for_the_caller():
    ir = popxl.Ir()
    spec = _spec(ir)
    identity = ir.create_graph(lambda a: a, spec)

    def caller(x):
        (y,) = ops.call(identity, x)
        y += 5.0  # must not reach x
        return y + x

    main = ir.create_graph(caller, spec)
    x = torch.tensor([1.0, 2.0, 3.0])
    ev, (out,) = _run(main, x)
    assert x.tolist() == [1.0, 2.0, 3.0]
    assert out.tolist() == [7.0, 9.0, 11.0]
    assert ev.copies == 1


def test_mutated_inputs_follow_views_and_calls_but_not_copies():
    ir = popxl.Ir()
    spec = _spec(ir)

    def writes_through_a_view(a, b, c):
        v = a.reshape_((3,))  # the in-place reshape: an alias of a
        v += 1.0  # writes a through its view
        d = c * 1.0
        d += 1.0  # a new value: c is untouched
        n = b.reshape((3,))  # the non-in-place reshape: a new tensor (upstream's ReshapeOp)
        n += 1.0  # b is untouched
        return b + d + n

    g = ir.create_graph(writes_through_a_view, spec, spec, spec)
    assert mutated_inputs(g) == {0}
    # Through a call: only where the call site lets the callee write.
    by_value = ir.create_graph(lambda a, b, c: ops.call(g, c, b, a)[0], spec, spec, spec)
    assert mutated_inputs(by_value) == frozenset()

    def modified(a, b, c):
        info = ops.call_with_info(g, c, b, a)
        info.set_parent_input_modified(c)
        return info.outputs[0]

    assert mutated_inputs(ir.create_graph(modified, spec, spec, spec)) == {2}


def test_ops_inside_a_call_inside_a_repeat_run_repeat_count_times_per_run():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(4, np.float32))
        inner = ir.create_graph(lambda a: a * 2.0, x)
        outer = ir.create_graph(lambda a: ops.call(inner, a)[0] + 1.0, x)
        (y,) = ops.repeat(outer, 3, x)
        _ = y - 1.0
    counts = Counter()
    for op, n in executed_ops(ir.main_graph.ops):
        counts[str(op.attrs.target)] += n
    assert counts["aten.mul.Tensor"] == 3  # the inner call, once per iteration
    assert counts["aten.add.Tensor"] == 3
    assert counts["aten.sub.Tensor"] == 1
    assert not any(op.kind in ("call", "repeat") for op, _ in executed_ops(ir.main_graph.ops))


def test_fast_compiler_analysis_plan_is_frozen():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        w = popxl.variable(np.ones(4, np.float32))
        x_stream = popxl.h2d_stream((4,), popxl.float32, "x")
        y = ops.host_load(x_stream) * w
        ops.host_store(popxl.d2h_stream((4,), popxl.float32, "y"), y)
    ex = FastExecutor(ir, torch.device("cpu"))
    plan = ex.fns["normal"].plan
    assert w.id in plan.assumptions.uniform_vars  # the weight is never written: invariant
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.written = frozenset()  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.batched["v0"] = True  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.assumptions.uniform_vars = frozenset()  # type: ignore[misc]


def test_analysis_narrows_the_invariant_set_to_variables_written_only_with_invariant_values():
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        per_replica = popxl.variable(np.zeros(4, np.float32), name="per_replica")
        reduced = popxl.variable(np.zeros(4, np.float32), name="reduced")
        untouched = popxl.variable(np.ones(4, np.float32), name="untouched")
        stream = popxl.h2d_stream((4,), popxl.float32, "x")
        x = ops.host_load(stream)
        per_replica += x  # differs between replicas
        reduced += ops.collectives.replicated_all_reduce(x * untouched)  # the same everywhere
    ex = FastExecutor(ir, torch.device("cpu"))
    assert ex.uniform == {reduced.id, untouched.id}
    # Every fragment's plan settled on the same assumptions (the executor's fixed point).
    assert {fn.plan.assumptions for fn in ex.fns.values()} == {ex.fns["normal"].plan.assumptions}
    data = np.arange(16, dtype=np.float32).reshape(4, 4)
    with popxl.Session(ir, "ipu_hw") as session:
        session.run({stream: data})
        got = session.get_tensors_data([per_replica, reduced])
    assert np.allclose(got[per_replica], data[0])  # replica 0's own row
    assert np.allclose(got[reduced], data.sum(0))  # the all-reduced sum
