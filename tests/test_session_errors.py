"""Session errors carry upstream PopXL's types and message beginnings (python/popxl/
python_files/session.py), since programs catch them and test suites match them; the
validation methods programs call directly (``_validate_run_inputs`` / ``_outputs``) exist."""

import re

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.ops as ops

# (case, exception type, upstream message beginning)
UPSTREAM_MESSAGES = {
    "missing_input": (ValueError, "Unexpected/Missing input.\n  Unexpected: {}\n  Missing: {'x'}"),
    "unexpected_output": (ValueError, "Unexpected/Missing output.\n  Unexpected: {'z'}"),
    "too_few_transfers": (ValueError, "Dimension 0 (1) for the array provided for input stream x is not large enough."),
    "wrong_replicas": (ValueError, "Dimension 1 (3) for the array provided for input stream x is the wrong size."),
    "shape_mismatch": (ValueError, "Shape mismatch for output stream y:\nStream shape = (2,), therefore expected full global batch shape (2, 2, 2)."),
    "read_non_variable": (TypeError, "is not of type Constant or Variable. get_tensor_data is not supported for this type."),
    "write_constant": (TypeError, "Tensor c is not of type Variable. write_variable_data is not supported for this type."),
    "write_dtype": (TypeError, "The dtype of the input array int32 must match the equivalent type of the tensor w : float32"),
    "write_shape": (ValueError, "The shape of the input array (3,) must match the shape of the tensor w : (2,)"),
}  # fmt: skip


def program():
    ir = popxl.Ir(replication=2)
    ir.num_host_transfers = 2
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((2,), popxl.float32, "x")
        ys = popxl.d2h_stream((2,), popxl.float32, "y")
        zs = popxl.d2h_stream((2,), popxl.float32, "z")
        w = popxl.variable(np.ones(2, np.float32), name="w")
        c = popxl.constant(np.ones(2, np.float32), name="c")
        x = ops.host_load(xs)
        y = x + w
        ops.host_store(ys, y)
    return ir, xs, ys, zs, w, c, y


def _raises(case, fn):
    exc, beginning = UPSTREAM_MESSAGES[case]
    with pytest.raises(exc) as info:
        fn()
    if case == "read_non_variable":
        assert beginning in str(info.value)
    else:
        assert str(info.value).startswith(beginning), str(info.value)


def test_validate_run_inputs_and_outputs_raise_upstreams_messages():
    ir, xs, ys, zs, w, c, y = program()
    session = popxl.Session(ir)
    good_in = {xs: np.zeros((2, 2, 2), np.float32)}
    session._validate_run_inputs(good_in)  # no error
    session._validate_run_outputs(session.create_host_outputs())
    _raises("missing_input", lambda: session._validate_run_inputs({}))
    _raises(
        "too_few_transfers",
        lambda: session._validate_run_inputs({xs: np.zeros((1, 2, 2), np.float32)}),
    )
    _raises(
        "wrong_replicas",
        lambda: session._validate_run_inputs({xs: np.zeros((2, 3, 2), np.float32)}),
    )
    outs = session.create_host_outputs()
    _raises(
        "unexpected_output",
        lambda: session._validate_run_outputs({**outs, zs: np.zeros((2, 2, 2))}),
    )
    _raises(
        "shape_mismatch",
        lambda: session._validate_run_outputs({ys: np.zeros((2, 2, 3), np.float32)}),
    )


def test_run_raises_the_same_messages_and_leaves_the_session_usable():
    ir, xs, ys, zs, w, c, y = program()
    with popxl.Session(ir) as session:
        _raises("missing_input", lambda: session.run({}))
        _raises("too_few_transfers", lambda: session.run({xs: np.zeros((1, 2, 2), np.float32)}))
        out = session.run({xs: np.full((2, 2, 2), 2.0, np.float32)})
    # The program loads and stores once, so only the first of the 2 transfers is written.
    np.testing.assert_array_equal(out[ys][0], np.full((2, 2), 3.0))


@pytest.mark.parametrize("bad", ["w", 3, None, ["w"]], ids=["str", "int", "None", "list"])
def test_get_tensor_data_rejects_non_tensors_with_type_error(bad):
    ir, *_ = program()
    session = popxl.Session(ir)
    with pytest.raises(TypeError, match=re.escape(UPSTREAM_MESSAGES["read_non_variable"][1])):
        session.get_tensor_data(bad)


def test_reading_an_intermediate_tensor_and_writing_a_constant_raise_type_error():
    ir, xs, ys, zs, w, c, y = program()
    session = popxl.Session(ir)
    _raises("read_non_variable", lambda: session.get_tensor_data(y))
    _raises("write_constant", lambda: session.write_variable_data(c, np.zeros(2, np.float32)))
    _raises("write_dtype", lambda: session.write_variable_data(w, np.zeros(2, np.int32)))
    _raises("write_shape", lambda: session.write_variable_data(w, np.zeros(3, np.float32)))
    # State survives the errors: w still holds its initial value and the constant its own.
    np.testing.assert_array_equal(session.get_tensor_data(w), np.ones(2))
    np.testing.assert_array_equal(session.get_tensor_data(c), np.ones(2))


def test_a_failed_multi_write_changes_nothing():
    ir, xs, ys, zs, w, c, y = program()
    session = popxl.Session(ir)
    with pytest.raises(TypeError):
        session.write_variables_data({w: np.full(2, 5.0, np.float32), c: np.zeros(2, np.float32)})
    np.testing.assert_array_equal(session.get_tensor_data(w), np.ones(2))
