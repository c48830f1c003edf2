"""Ir.verify(): well-formed programs pass, and each broken invariant is reported by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.errors import IrVerificationError
from torch_popxl.ir.attrs import CallSite, TorchCall
from torch_popxl.ir.fake import fake_like
from torch_popxl.ir.graph import Op, OpKind
from torch_popxl.ir.tensor import Tensor


def _program():
    ir = popxl.Ir(2)
    with ir.main_graph:
        x = popxl.variable(np.ones((2, 3), np.float32), name="x")
        w = popxl.variable(np.ones((3, 4), np.float32), name="w")
        sub = ir.create_graph(lambda a, b: a @ b, x, w)
        (y,) = ops.call(sub, x, w)
        z = ops.collectives.replicated_all_reduce(y + 1.0)
        s = popxl.d2h_stream(z.shape, z.dtype, "out")
        ops.host_store(s, z)
    return ir, sub


def test_a_well_formed_program_verifies():
    ir, _ = _program()
    ir.verify()
    popxl.Session(ir)  # Session verifies too


def test_use_before_definition_is_reported():
    ir, _ = _program()
    main = ir.main_graph
    main._ops.reverse()
    with pytest.raises(IrVerificationError, match="before it is defined"):
        ir.verify()


def test_a_tensor_from_another_graph_is_reported():
    ir, sub = _program()
    main = ir.main_graph
    stranger = sub._inputs[0]
    op = next(op for op in main._ops if op.kind == "torch")
    main._ops[main._ops.index(op)] = dataclasses.replace(op, inputs=(stranger, *op.inputs[1:]))
    with pytest.raises(IrVerificationError, match="tensors cannot cross graphs"):
        ir.verify()


def test_a_recorded_shape_that_fake_propagation_disagrees_with_is_reported():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones((2, 3), np.float32))
        y = x + 1.0
        _ = y * 2.0
    main = ir.main_graph
    wrong = Tensor._create(main, "wrong", fake_like((5,), torch.float32))
    i = next(i for i, op in enumerate(main._ops) if y in op.outputs)
    main._ops[i] = main._ops[i].with_outputs([wrong])
    with pytest.raises(IrVerificationError, match=r"recorded as torch.float32\[5\]"):
        ir.verify()


def test_a_call_with_the_wrong_number_of_inputs_is_reported():
    ir, sub = _program()
    main = ir.main_graph
    i = next(i for i, op in enumerate(main._ops) if op.kind == "call")
    main._ops[i] = dataclasses.replace(main._ops[i], inputs=main._ops[i].inputs[:1])
    with pytest.raises(IrVerificationError, match="passes 1 inputs but"):
        ir.verify()


def test_a_graph_output_nothing_defines_is_reported():
    ir, sub = _program()
    sub._ops.clear()
    with pytest.raises(IrVerificationError, match="which no op defines|before it is defined"):
        ir.verify()


def test_session_refuses_a_broken_ir_before_compiling_it():
    ir, _ = _program()
    ir.main_graph._ops.reverse()
    with pytest.raises(IrVerificationError):
        popxl.Session(ir)


def test_ops_carry_typed_attribute_records():
    ir, sub = _program()
    kinds = {op.kind: op.attrs for op in ir.main_graph.ops}
    assert isinstance(kinds[OpKind.CALL], CallSite) and kinds[OpKind.CALL].graph is sub
    reduce = next(
        op.attrs
        for op in ir.main_graph.ops
        if op.kind == OpKind.TORCH and "all_reduce" in str(op.attrs.target)
    )
    assert isinstance(reduce, TorchCall)
    assert (reduce.argument("op"), reduce.argument("group_size"), reduce.argument("stride")) == (
        "add",
        2,
        1,
    )
    with pytest.raises(TypeError, match="CALL op 'Call' needs CallSite attributes; got dict"):
        Op("call", "Call", (), (), {"graph": sub})
    with pytest.raises(ValueError, match="'no_such_kind' is not a valid OpKind"):
        Op("no_such_kind", "X", (), (), {})


def test_identical_ops_share_a_fake_rerun_but_each_is_checked():
    # Two ops with one signature: the second's wrong record must still be caught, although
    # its fake re-run is taken from the first.
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones((2, 3), np.float32))
        a = x + 1.0
        b = x + 1.0
    b._fake = fake_like((3, 2), torch.float32)
    del a
    with pytest.raises(IrVerificationError, match=r"recorded as torch.float32\[3, 2\]"):
        ir.verify()


def test_a_graph_changed_after_it_verified_is_verified_again():
    ir, _ = _program()
    ir.verify()
    main = ir.main_graph
    with main:
        x = next(t for t in main._tensors.values() if t.name == "x")
        y = x * 2.0  # the graph's version moves on
    y._fake = fake_like((7,), torch.float32)
    with pytest.raises(IrVerificationError, match="recorded as"):
        ir.verify()
