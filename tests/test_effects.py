"""The one effects query (Note [one effects query] in ir/walk.py) and op definitions as the
identity of runtime ops (Note [op definitions] in ir/opdef.py), against what each op does by
its upstream semantics: which inputs it writes, which outputs alias inputs, what it talks to.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.ir.graph import Op, OpKind
from torch_popxl.ir.opdef import OpDef
from torch_popxl.ir.walk import effects
from torch_popxl.opdefs import host, print_tensor, remote


def _last_op(graph):
    return graph._ops[-1]


def test_runtime_ops_carry_their_definition_and_kinds_keep_only_control_and_torch():
    assert {k.name for k in OpKind} == {"TORCH", "CALL", "REPEAT"}
    ir = popxl.Ir()
    main = ir.main_graph
    with main:
        stream = popxl.h2d_stream((2,), popxl.float32, "x")
        x = ops.host_load(stream)
        load = _last_op(main)
        ops.print_tensor(x)
        printed = _last_op(main)
        buffer = popxl.remote_buffer((2,), popxl.float32, 1)
        ops.remote_store(buffer, 0, x)
        store = _last_op(main)
        y = ops.remote_load(buffer, 0)
        fresh = _last_op(main)
        ops.remote_load_(buffer, 0, y)
        inplace = _last_op(main)
    assert load.kind is host.host_load_opdef and load.kind == "host_load"
    assert printed.kind is print_tensor.print_opdef and printed.kind == "print"
    assert store.kind is remote.store_opdef and fresh.kind is remote.load_opdef
    assert inplace.kind is remote.load_inplace_opdef and inplace.kind == "remote_load_"
    assert all(isinstance(op.kind, OpDef) for op in (load, printed, store, fresh, inplace))

    # what each does: remote_load_(t, offset) writes t and returns it; a store writes the
    # buffer, a load reads it; host transfers and print talk to the host; nothing else writes
    e = effects(inplace)
    assert e.writes == {0} and dict(e.aliases) == {0: 0} and e.reads_buffer
    assert not e.writes_buffer and not e.host_io and not e.is_collective
    assert effects(fresh).reads_buffer and not effects(fresh).writes
    assert effects(store).writes_buffer and not effects(store).writes
    assert not effects(store).reads_buffer
    for op in (load, printed):
        assert effects(op).host_io and not effects(op).writes and not effects(op).aliases


def test_a_runtime_op_name_string_makes_its_definition_and_checks_its_attributes():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.zeros(2, np.float32))
    op = Op("print", "PrintTensor", (x,), (), _last_attrs())
    assert op.kind is print_tensor.print_opdef
    with pytest.raises(TypeError, match="print op 'P' needs PrintOptions attributes; got dict"):
        Op("print", "P", (x,), (), {})


def _last_attrs():
    ir = popxl.Ir()
    with ir.main_graph:
        ops.print_tensor(popxl.variable(np.zeros(1, np.float32)), title="t")
    return ir.main_graph._ops[-1].attrs


def test_captured_ops_answer_from_their_schema():
    ir = popxl.Ir()
    main = ir.main_graph
    with main:
        a = popxl.variable(np.ones((2, 3), np.float32))
        b = popxl.variable(np.ones((2, 3), np.float32))
        ops.var_updates.accumulate_(a, b)  # a += b: writes a, returns it
        acc = _last_op(main)
        _ = a + b
        plain = _last_op(main)
        _ = a.view(3, 2)  # torch's view: an alias
        view = _last_op(main)
        _ = a.reshape((3, 2))  # PopXL's reshape: a new tensor that torch runs as a view
        new = _last_op(main)
        _ = torch.split(a, [1, 2], dim=1)  # a list of views
        pieces = _last_op(main)
        ops.collectives.replicated_all_reduce(b)
        reduce = _last_op(main)
    e = effects(acc)
    assert acc.inputs[min(e.writes)] is a and len(e.writes) == 1
    assert e.aliases[0] == min(e.writes)
    assert not effects(plain).writes and not effects(plain).aliases
    assert not effects(view).writes and dict(effects(view).aliases) == {0: 0}
    assert not effects(new).aliases and dict(effects(new).views) == {0: 0}
    assert dict(effects(new).shared) == {0: 0}
    assert dict(effects(pieces).aliases) == {0: 0, 1: 0} and len(pieces.outputs) == 2
    assert effects(reduce).is_collective and not effects(reduce).writes


def test_batch_norm_running_statistics_are_writes_the_schema_does_not_declare():
    ir = popxl.Ir()
    main = ir.main_graph
    with main:
        x = popxl.variable(np.ones((4, 3), np.float32))
        stats = [popxl.variable(np.zeros(3, np.float32)) for _ in range(2)]
        torch.ops.aten.native_batch_norm(x, None, None, stats[0], stats[1], True, 0.1, 1e-5)
    op = next(o for o in main._ops if "native_batch_norm" in str(getattr(o.attrs, "target", "")))
    e = effects(op)
    written = {op.inputs[i].id for i in e.writes}
    assert written == {s.id for s in stats} and e.undeclared == e.writes


def test_a_call_writes_exactly_the_by_reference_inputs_its_callee_modifies():
    ir = popxl.Ir()
    main = ir.main_graph
    with main:
        x = popxl.variable(np.ones(2, np.float32))
        y = popxl.variable(np.ones(2, np.float32))

        def body(a: popxl.TensorByRef, b: popxl.Tensor):
            ops.var_updates.accumulator_scale_(a, 2.0)
            return a + b

        ops.call(ir.create_graph(body, x, y), x, y)
        call = _last_op(main)

        def reads(a: popxl.Tensor, b: popxl.Tensor):
            return a + b

        ops.call(ir.create_graph(reads, x, y), x, y)
        plain = _last_op(main)
    assert call.kind == OpKind.CALL and effects(call).writes == {0}
    assert not effects(plain).writes
