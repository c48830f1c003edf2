"""Graph-building errors raise upstream PopXL's types and message beginnings (python/popxl/
python_files/ops/call.py ``_prep_and_validate_inputs`` and ops/repeat.py), checked in
upstream's order; a failed call records nothing in the parent graph."""

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.errors import PopXLError

# case: (exception type, upstream message beginning)
UPSTREAM_MESSAGES = {
    "negative_repeat": (ValueError, "Repeat count must be >= 0. Repeat count: -1. Graph: "),
    "repeat_more_outputs": (ValueError, "To repeat the subgraph ("),
    "too_many": (ValueError, "Too many inputs have been provided to the called graph. The number of positional inputs exceeds the number of inputs of the graph. 3 > 2."),
    "positional_other_graph": (ValueError, 'Parent input tensor "'),
    "dict_key_not_input": (ValueError, 'The graph input tensor "'),
    "dict_parent_other_graph": (ValueError, 'The parent input tensor "'),
    "twice": (ValueError, "Graph input tensor is specified twice for the called graph, in `inputs_dict` and positionally in `inputs`: "),
    "uncoercible_positional": (TypeError, 'Input at position "1" could not be coerced into a tensor for the called graph: Type '),
    "uncoercible_dict": (TypeError, 'Input "'),
    "missing": (ValueError, "Not enough inputs have been provided for the called graph ("),
}  # fmt: skip


def two_input_graph(ir):
    def fn(x: popxl.Tensor, y: popxl.Tensor):
        return x + y

    spec = popxl.TensorSpec((2,), popxl.float32)
    return ir.create_graph(fn, spec, spec)


def _raises(case, fn):
    exc, beginning = UPSTREAM_MESSAGES[case]
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value).startswith(beginning), str(info.value)


@pytest.mark.parametrize("case", sorted(UPSTREAM_MESSAGES))
def test_call_and_repeat_errors_have_upstreams_message_beginnings(case):
    ir = popxl.Ir()
    g = two_input_graph(ir)
    other = ir.create_graph(lambda: popxl.constant(np.ones(2, np.float32)) * 2)
    x_in, y_in = g.inputs
    with ir.main_graph:
        a = popxl.variable(np.ones(2, np.float32), name="a")
        b = popxl.variable(np.ones(2, np.float32), name="b")
        n_ops = len(ir.main_graph._ops)
        foreign = other.outputs[0]
        attempts = {
            "negative_repeat": lambda: ops.repeat(g, -1, a, b),
            "repeat_more_outputs": lambda: ops.repeat(
                ir.create_graph(lambda: (popxl.constant(1.0) + 0, popxl.constant(2.0) + 0)), 2
            ),
            "too_many": lambda: ops.call(g, a, b, a),
            "positional_other_graph": lambda: ops.call(g, foreign, b),
            "dict_key_not_input": lambda: ops.call(g, a, inputs_dict={a: b}),
            "dict_parent_other_graph": lambda: ops.call(g, a, inputs_dict={y_in: foreign}),
            "twice": lambda: ops.call(g, a, inputs_dict={x_in: b}),
            "uncoercible_positional": lambda: ops.call(g, a, "not a number"),
            "uncoercible_dict": lambda: ops.call(g, a, inputs_dict={y_in: object()}),
            "missing": lambda: ops.call(g, a),
        }
        _raises(case, attempts[case])
        assert len(ir.main_graph._ops) == n_ops  # nothing recorded by the failed call


def test_host_scalars_are_coerced_to_the_graph_inputs_dtype():
    ir = popxl.Ir()

    def scale(x: popxl.Tensor, s: popxl.Tensor):
        return x * s

    g = ir.create_graph(
        scale, popxl.TensorSpec((2,), popxl.float32), popxl.TensorSpec((), popxl.float32)
    )
    with ir.main_graph:
        a = popxl.variable(np.array([1.0, 2.0], np.float32), name="a")
        (out,) = ops.call(g, a, 3)  # an int becomes a float32 constant
        s = popxl.d2h_stream(out.shape, out.dtype)
        ops.host_store(s, out)
    with popxl.Session(ir) as session:
        np.testing.assert_array_equal(session.run()[s], [3.0, 6.0])


def test_mismatched_call_input_shape_is_a_popxl_error():
    ir = popxl.Ir()
    g = two_input_graph(ir)
    with ir.main_graph:
        a = popxl.variable(np.ones(2, np.float32), name="a")
        c = popxl.variable(np.ones(3, np.float32), name="c")
        with pytest.raises(PopXLError, match="does not match callee input tensor"):
            ops.call(g, a, c)


def test_repeat_count_of_the_wrong_type_is_a_type_error():
    ir = popxl.Ir()
    g = two_input_graph(ir)
    with ir.main_graph:
        a = popxl.variable(np.ones(2, np.float32), name="a")
        with pytest.raises(TypeError, match=r"repeat_count must be an int .*; got float 2\.0"):
            ops.repeat(g, 2.0, a, a)
