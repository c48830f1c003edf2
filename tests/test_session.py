"""``Session``: host stream shapes and input kinds, weights get/write, the attach/detach
contract and the errors of issue 2 ("Bad input"), against spec/popxl.md §6 and §11.11-14.

Every numerical claim compares host arrays with numpy on the same data (exact for copies and
integer data, rtol 1e-6 for float32 arithmetic) and runs with both executors where a program
runs. An Ir gets one Session, so each test builds its program with a builder function.
"""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops

EXECUTORS = ("reference", "fast")


@pytest.fixture(params=EXECUTORS)
def executor(request):
    return request.param


def streamed(shape=(2, 3), nht=1, replicas=1, dtype=popxl.float32, scale=2):
    """y = x * scale for every one of the nht entries (a repeat of nht iterations)."""
    ir = popxl.Ir(replicas)
    ir.num_host_transfers = nht
    with ir.main_graph:
        xs = popxl.h2d_stream(shape, dtype, "x")
        ys = popxl.d2h_stream(shape, dtype, "y")

        def step():
            ops.host_store(ys, ops.host_load(xs) * scale)

        ops.repeat(ir.create_graph(step), nht)
    return ir, xs, ys


# ----------------------------------------------------------------------------------------
# Host array shapes (spec §6.3, §11.14)
# ----------------------------------------------------------------------------------------

# (nht, replicas, stream shape) -> host array shape; dimensions equal to 1 are omitted.
FULL_SHAPES = {
    (4, 16, (2, 4)): (4, 16, 2, 4),
    (1, 16, (2, 4)): (16, 2, 4),
    (4, 1, (2, 4)): (4, 2, 4),
    (1, 1, (2, 4)): (2, 4),
    (7, 2, (5, 9, 9)): (7, 2, 5, 9, 9),  # session.rst
    (1, 1, ()): (),  # the scalar stream: a 0-d array
    (3, 1, ()): (3,),
    (1, 2, ()): (2,),
    (1, 1, (1,)): (1,),  # the stream's own size-1 dims are kept
}


@pytest.mark.parametrize("nht,replicas,shape", FULL_SHAPES)
def test_host_arrays_have_the_documented_shape_and_entry_i_r_is_replica_r_load_i(
    nht, replicas, shape, executor
):
    full = FULL_SHAPES[nht, replicas, shape]
    ir, xs, ys = streamed(shape, nht, replicas)
    session = popxl.Session(ir, "ipu_hw", executor=executor)
    assert session._full_input_shape(shape) == full
    x = np.arange(np.prod(full), dtype=np.float32).reshape(full)
    with session:
        y = session.run({xs: x})[ys]
    assert y.shape == full and y.dtype == np.float32
    np.testing.assert_array_equal(y, x * 2)


def test_full_input_shape_prefixes_any_shape():
    ir, _, _ = streamed((3,), nht=5, replicas=2)
    session = popxl.Session(ir, "ipu_model")
    assert session._full_input_shape((7, 1)) == (5, 2, 7, 1)
    assert session._full_input_shape(()) == (5, 2)


@pytest.mark.parametrize(
    "nht,replicas,given",
    [(4, 1, (4,)), (4, 1, (4, 1)), (1, 2, (2,)), (1, 2, (2, 1)), (3, 2, (3, 2)), (1, 1, ())],
)
def test_size_one_stream_accepts_arrays_with_the_unit_dim_dropped(nht, replicas, given, executor):
    ir, xs, ys = streamed((1,), nht, replicas)
    x = np.arange(1, np.prod(given) + 1, dtype=np.float32).reshape(given)
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        y = session.run({xs: x})[ys]
    full = session._full_input_shape((1,))
    assert y.shape == full
    np.testing.assert_array_equal(y, (x * 2).reshape(full))


def test_extra_entries_beyond_num_host_transfers_are_accepted_and_ignored(executor):
    # §6.3 rule 2: dim 0 >= nht passes; only the first nht entries are loaded.
    ir, xs, ys = streamed((2,), nht=3)
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    with popxl.Session(ir, executor=executor) as session:
        y = session.run({xs: x})[ys]
        np.testing.assert_array_equal(y, x[:3] * 2)
        out = np.full((4, 2), -1.0, np.float32)  # an output array may be longer too
        session.run_with_outputs({xs: x}, {ys: out})
    np.testing.assert_array_equal(out[:3], x[:3] * 2)
    np.testing.assert_array_equal(out[3], [-1.0, -1.0])


# ----------------------------------------------------------------------------------------
# Input kinds (issue 2 item 4)
# ----------------------------------------------------------------------------------------

X23 = np.array([[0.1, -1.5, 2.0], [3.25, 4.0, -0.3]])
INPUTS = {
    "numpy_float64_downcast": X23,
    "numpy_float32": X23.astype(np.float32),
    "numpy_float16": X23.astype(np.float16),
    "torch_float32_requires_grad": torch.tensor(X23, dtype=torch.float32, requires_grad=True),
    "torch_float64": torch.tensor(X23),
    "list": X23.tolist(),
    "fortran_order": np.asfortranarray(X23.astype(np.float32)),
}


@pytest.mark.parametrize("kind", INPUTS)
def test_inputs_of_any_float_kind_are_converted_to_the_stream_dtype(kind, executor):
    data = INPUTS[kind]
    as_f32 = np.asarray(data.detach() if isinstance(data, torch.Tensor) else data).astype(
        np.float32
    )
    ir, xs, ys = streamed((2, 3))
    with popxl.Session(ir, executor=executor) as session:
        y = session.run({xs: data})[ys]
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, as_f32 * 2)


@pytest.mark.parametrize(
    "value", [2.5, 3, np.float64(1.25), torch.tensor(-4.0, requires_grad=True)]
)
def test_python_and_0d_scalars_feed_a_scalar_stream(value, executor):
    ir, xs, ys = streamed(())
    with popxl.Session(ir, executor=executor) as session:
        y = session.run({xs: value})[ys]
    assert y.shape == () and y.dtype == np.float32
    assert float(y) == float(torch.as_tensor(value).detach()) * 2


def test_int64_input_is_downcast_into_an_int32_stream(executor):
    ir, xs, ys = streamed((3,), dtype=popxl.int32, scale=3)
    with popxl.Session(ir, executor=executor) as session:
        y = session.run({xs: np.array([1, -2, 7], np.int64)})[ys]
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, [3, -6, 21])


# ----------------------------------------------------------------------------------------
# Stream errors name the stream and both shapes
# ----------------------------------------------------------------------------------------


def test_wrong_input_shape_names_stream_and_both_shapes():
    ir, xs, _ = streamed((2, 3))
    with popxl.Session(ir) as session:
        with pytest.raises(
            ValueError, match=r"(?s)^Shape mismatch for input stream x:.*\(2, 3\).*\(3, 2\)"
        ):
            session.run({xs: np.zeros((3, 2), np.float32)})


@pytest.mark.parametrize(
    "nht,replicas,given,expected",
    # upstream's message beginnings (Session._verify_io_shape)
    [
        (
            4,
            1,
            (3, 2),
            r"^Dimension 0 \(3\) for the array provided for input stream x is not large",
        ),
        (
            1,
            2,
            (3, 2),
            r"^Dimension 0 \(3\) for the array provided for input stream x is the wrong",
        ),
        (
            2,
            2,
            (2, 3, 2),
            r"^Dimension 1 \(3\) for the array provided for input stream x is the wrong",
        ),
    ],
)
def test_too_few_entries_or_wrong_replica_count_raise_value_error(nht, replicas, given, expected):
    ir, xs, _ = streamed((2,), nht, replicas)
    with popxl.Session(ir, "ipu_hw") as session:
        with pytest.raises(ValueError, match=expected):
            session.run({xs: np.zeros(given, np.float32)})


def test_unknown_stream_key_raises_value_error_naming_it():
    ir, xs, _ = streamed((2,))
    _, other_x, _ = streamed((2,))  # same name, another Ir
    with popxl.Session(ir) as session:
        with pytest.raises(
            ValueError, match=r"(?s)^Unexpected/Missing input\.\n  Unexpected: .*oops"
        ):
            session.run({xs: np.zeros(2), "oops": np.zeros(2)})
        with pytest.raises(
            ValueError, match=r"(?s)^Unexpected/Missing input.*x \(a stream of another Ir\)"
        ):
            session.run({xs: np.zeros(2), other_x: np.zeros(2)})


def test_stream_without_host_load_is_neither_expected_nor_required(executor):
    ir = popxl.Ir()
    with ir.main_graph:
        unused = popxl.h2d_stream((2,), popxl.float32, "unused")
        xs = popxl.h2d_stream((2,), popxl.float32, "x")
        ys = popxl.d2h_stream((2,), popxl.float32, "y")
        ops.host_store(ys, ops.host_load(xs) + 1.0)
    with popxl.Session(ir, executor=executor) as session:
        assert session.expected_inputs() == {xs} == ir.get_all_h2d_streams()
        np.testing.assert_array_equal(session.run({xs: [1.0, 2.0]})[ys], [2.0, 3.0])
        with pytest.raises(
            ValueError, match=r"(?s)^Unexpected/Missing input.*Unexpected: \{'unused'\}"
        ):
            session.run({xs: [1.0, 2.0], unused: [0.0, 0.0]})


def test_missing_input_stream_raises_value_error_naming_it():
    ir, _, _ = streamed((2,))
    with popxl.Session(ir) as session:
        with pytest.raises(ValueError, match=r"(?s)^Unexpected/Missing input.*Missing: \{'x'\}"):
            session.run({})
        with pytest.raises(ValueError, match=r"(?s)^Unexpected/Missing input.*Missing: \{'x'\}"):
            session.run()


def test_non_numeric_input_raises_type_error_naming_the_stream():
    ir, xs, _ = streamed((2,))
    with popxl.Session(ir) as session:
        with pytest.raises(TypeError, match=r"'x'.*<U1.*float32"):
            session.run({xs: np.array(["a", "b"])})


def test_run_with_outputs_fills_the_callers_arrays_and_checks_them(executor):
    ir, xs, ys = streamed((2,), nht=2)
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    with popxl.Session(ir, executor=executor) as session:
        out = np.zeros((2, 2), np.float32)
        assert session.run_with_outputs({xs: x}, {ys: out}) is None
        np.testing.assert_array_equal(out, x * 2)
        with pytest.raises(
            ValueError, match=r"(?s)^Shape mismatch for output stream y:.*\(2, 2\).*\(2, 3\)"
        ):
            session.run_with_outputs({xs: x}, {ys: np.zeros((2, 3), np.float32)})
        with pytest.raises(ValueError, match=r"(?s)^Unexpected/Missing output.*Missing: \{'y'\}"):
            session.run_with_outputs({xs: x}, {})


def test_create_host_outputs_has_one_array_per_stored_stream():
    ir, _, ys = streamed((2, 3), nht=4)
    outputs = popxl.Session(ir).create_host_outputs()
    assert list(outputs) == [ys]
    assert outputs[ys].shape == (4, 2, 3) and outputs[ys].dtype == np.float32


# ----------------------------------------------------------------------------------------
# Repeat with num_host_transfers (spec §11.13) and the stream cursor model (§6.1)
# ----------------------------------------------------------------------------------------


def _linear_repeat():
    ir = popxl.Ir()
    ir.num_host_transfers = 8
    with ir.main_graph:
        W = popxl.variable(np.ones((2, 2), np.float32), name="W")
        b = popxl.variable(np.ones((2,), np.float32), name="b")
        xs = popxl.h2d_stream((2, 2), popxl.float32, "x")
        ys = popxl.d2h_stream((2, 2), popxl.float32, "y")

        def body(W, b):
            ops.host_store(ys, ops.host_load(xs) @ W + b)

        ops.repeat(ir.create_graph(body, W, b), 8, W, b)
    return ir, xs, ys


def test_repeat_over_num_host_transfers_matches_numpy(executor):
    x = np.random.default_rng(0).standard_normal((8, 2, 2)).astype(np.float32)
    ir, xs, ys = _linear_repeat()
    with popxl.Session(ir, executor=executor) as session:
        y = session.run({xs: x})[ys]
        again = session.run({xs: x})[ys]  # every run starts new stream cursors
    assert y.shape == (8, 2, 2)
    np.testing.assert_allclose(y, x @ np.ones((2, 2), np.float32) + 1, rtol=1e-6)
    np.testing.assert_array_equal(again, y)


def test_each_host_load_consumes_the_next_entry_of_its_own_stream(executor):
    # §6.1: nht=20, 10 iterations; A loaded once per iteration, B twice.
    ir = popxl.Ir()
    ir.num_host_transfers = 20
    with ir.main_graph:
        a_s, b_s = (
            popxl.h2d_stream((), popxl.float32, "A"),
            popxl.h2d_stream((), popxl.float32, "B"),
        )
        outs = [popxl.d2h_stream((), popxl.float32, n) for n in ("a", "b_first", "b_second")]

        def body():
            for s, t in zip(
                outs, (ops.host_load(a_s), ops.host_load(b_s), ops.host_load(b_s)), strict=True
            ):
                ops.host_store(s, t)

        ops.repeat(ir.create_graph(body), 10)
    a, b = np.arange(20, dtype=np.float32), np.arange(100, 120, dtype=np.float32)
    with popxl.Session(ir, executor=executor) as session:
        result = session.run({a_s: a, b_s: b})
    np.testing.assert_array_equal(result[outs[0]][:10], a[:10])
    np.testing.assert_array_equal(result[outs[1]][:10], b[0::2])
    np.testing.assert_array_equal(result[outs[2]][:10], b[1::2])


def test_fast_executor_matches_reference_on_a_replicated_training_loop():
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal((3, 2)).astype(np.float32)
    x = rng.standard_normal((4, 2, 5, 3)).astype(np.float32)  # (nht, replicas, batch, in)

    def build():
        ir = popxl.Ir(2)
        ir.num_host_transfers = 4
        with ir.main_graph:
            w = popxl.variable(w0, name="w")
            xs = popxl.h2d_stream((5, 3), popxl.float32, "x")
            ls = popxl.d2h_stream((), popxl.float32, "loss")

            def step(w: popxl.TensorByRef):
                with popxl.in_sequence():
                    xb = ops.host_load(xs)
                    y = ops.relu(xb @ w)
                    ops.host_store(ls, ops.reduce_mean(y * y))
                    grad = xb.T @ (y * (2.0 / y.nelms))
                    ops.scaled_add_(w, grad, 1.0, -0.1)

            ops.repeat(ir.create_graph(step, w), 4, w)
        return ir, xs, ls, w

    results = {}
    for ex in EXECUTORS:
        ir, xs, ls, w = build()
        with popxl.Session(ir, "ipu_hw", executor=ex) as session:
            loss = session.run({xs: x})[ls]
            results[ex] = (loss, session.get_tensor_data(w))
    np.testing.assert_allclose(results["fast"][0], results["reference"][0], rtol=1e-6)
    np.testing.assert_allclose(results["fast"][1], results["reference"][1], rtol=1e-6)
    # Eager numpy: replicas share the initial weight and update independently; the host copy
    # is replica 0's (one_per_group).
    losses = np.zeros((4, 2), np.float32)
    for r in range(2):
        w = w0.copy()
        for i in range(4):
            y = np.maximum(x[i, r] @ w, 0)
            losses[i, r] = np.mean(y * y)
            w = w - 0.1 * x[i, r].T @ (y * (2.0 / y.size))
        if r == 0:
            w_replica0 = w
    np.testing.assert_allclose(results["fast"][0], losses, rtol=1e-5)
    np.testing.assert_allclose(results["fast"][1], w_replica0, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------
# Weights: get and write (spec §6.4, §11.11)
# ----------------------------------------------------------------------------------------


def _get_write_program():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(3, name="a")
        b = popxl.constant(1, name="b")
        o = popxl.d2h_stream((), popxl.int32, "o")
        ops.host_store(o, a + b)
        inter = a * 2
    return ir, a, b, o, inter


def test_get_and_write_tensor_data_follow_the_docs_example(executor):
    ir, a, b, o, _ = _get_write_program()
    session = popxl.Session(ir, executor=executor)
    with session:
        assert session.run()[o] == 4
    got = session.get_tensors_data([a, b])
    for t, want in ((a, 3), (b, 1)):
        assert isinstance(got[t], np.ndarray) and got[t].dtype == np.int32 and got[t].shape == ()
        assert got[t] == want
    session.write_variable_data(a, np.array(5, np.int32))
    assert session.get_tensor_data(a) == 5
    with session:
        assert session.run()[o] == 6


def test_written_values_reach_the_device_on_every_run(executor):
    # test_write_variables_data_cache: a Python int is accepted for a float32 variable.
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(1.0, name="v")
        o = popxl.d2h_stream((), popxl.float32, "o")
        ops.host_store(o, v * 1.0)
    with popxl.Session(ir, executor=executor) as session:
        outputs = [session.run()[o].item()]
        for value in (2, 3.0):
            session.write_variable_data(v, value)
            outputs.append(session.run()[o].item())
        session.write_variables_data({v: np.array(4.0, np.float32)})
        outputs.append(session.run()[o].item())
    assert outputs == [1.0, 2.0, 3.0, 4.0]
    got = session.get_tensor_data(v)
    assert isinstance(got, np.ndarray) and got.shape == () and got == 4.0


def test_get_tensor_data_after_a_run_returns_a_0d_array_not_a_numpy_scalar(executor):
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(1.0, name="v")
        ops.accumulate_(v, popxl.constant(1.5))
    with popxl.Session(ir, executor=executor) as session:
        session.run()
        got = session.get_tensor_data(v)
    assert type(got) is np.ndarray and got.shape == () and got == 2.5


def test_write_with_the_wrong_shape_names_the_variable_and_both_shapes():
    ir = popxl.Ir()
    with ir.main_graph:
        w = popxl.variable(np.zeros((2, 3), np.float32), name="weight")
    session = popxl.Session(ir)
    with pytest.raises(
        ValueError,
        match=r"^The shape of the input array \(3, 2\) must match the shape of the tensor weight : \(2, 3\)",
    ):
        session.write_variable_data(w, np.zeros((3, 2), np.float32))
    with pytest.raises(
        ValueError,
        match=r"^The shape of the input array \(\) must match the shape of the tensor weight : \(2, 3\)",
    ):
        session.write_variable_data(w, 1.0)


@pytest.mark.parametrize(
    "data,given",
    [
        (np.zeros((2, 3)), "float64"),
        (np.zeros((2, 3), np.int32), "int32"),
        ([[0.0] * 3] * 2, "float64"),
    ],
)
def test_write_arrays_are_not_cast_and_a_wrong_dtype_names_both(data, given):
    ir = popxl.Ir()
    with ir.main_graph:
        w = popxl.variable(np.zeros((2, 3), np.float32), name="weight")
    session = popxl.Session(ir)
    with pytest.raises(
        TypeError,
        match=rf"^The dtype of the input array {given} must match the equivalent type of the tensor weight : float32",
    ):
        session.write_variables_data({w: data})
    np.testing.assert_array_equal(session.get_tensor_data(w), np.zeros((2, 3), np.float32))


def test_write_to_a_non_variable_or_another_irs_variable_raises():
    ir, _, b, _, inter = _get_write_program()
    other = popxl.Ir()
    with other.main_graph:
        foreign = popxl.variable(1.0, name="foreign")
    session = popxl.Session(ir)
    with pytest.raises(
        TypeError, match=r"^Tensor b is not of type Variable\. write_variable_data is not supported"
    ):
        session.write_variable_data(b, 2)
    with pytest.raises(TypeError, match="is not of type Variable"):
        session.write_variable_data(inter, 2)
    with pytest.raises(ValueError, match="'foreign'"):
        session.write_variable_data(foreign, 2.0)


def test_get_tensors_data_rejects_tensors_that_are_not_variables_or_constants():
    _, xs, ys = streamed((2,))
    ir2, a, _, _, inter = _get_write_program()
    session = popxl.Session(ir2)
    for bad in (inter, xs, ys, "a"):
        with pytest.raises(
            TypeError,
            match=r"is not of type Constant or Variable\. get_tensor_data is not supported",
        ):
            session.get_tensors_data([a, bad])
    assert session.get_tensor_data(a) == 3


def test_write_while_detached_is_uploaded_at_the_next_enter(executor):
    ir, a, _, o, _ = _get_write_program()
    session = popxl.Session(ir, executor=executor)
    session.write_variable_data(a, np.array(10, np.int32))
    with session:
        assert session.run()[o] == 11


def test_write_while_attached_after_a_run_reuploads_stale_host_copies(executor):
    # §6.4 hazard: weights_from_host re-uploads every variable from its host copy.
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        w = popxl.variable(0.0, name="w")
        v = popxl.variable(0.0, name="v")
        o = popxl.d2h_stream((), popxl.float32, "o")
        ops.accumulate_(w, popxl.constant(1.0))
        ops.host_store(o, w + v)
    with popxl.Session(ir, executor=executor) as session:
        assert session.run()[o] == 1.0  # w = 1 on device, host copy still 0
        session.write_variable_data(v, 10.0)  # re-uploads w = 0
        assert session.run()[o] == 11.0
        assert session.get_tensor_data(w) == 1.0  # (the sync happens first)
        session.write_variable_data(v, 20.0)
        assert session.run()[o] == 22.0


# ----------------------------------------------------------------------------------------
# Attach / detach contract (spec §6.2, §11.12)
# ----------------------------------------------------------------------------------------


def _accumulating_weight():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        w = popxl.variable(np.array([2.0], np.float32), name="w")
        xs = popxl.h2d_stream((1,), popxl.float32, "x")
        ys = popxl.d2h_stream((1,), popxl.float32, "y")
        ops.host_store(ys, w * ops.host_load(xs))
        ops.accumulate_(w, popxl.constant(np.array([1.0], np.float32)), 1.0)
    return ir, w, xs, ys


@pytest.mark.parametrize("on_exit,after", [(True, 3.0), (False, 2.0)])
def test_weights_to_host_on_exit_controls_the_host_copy_after_exit(on_exit, after, executor):
    ir, w, xs, ys = _accumulating_weight()
    session = popxl.Session(ir, weights_to_host_on_exit=on_exit, executor=executor)
    with session:
        np.testing.assert_array_equal(session.run({xs: np.array([4.0])})[ys], [8.0])
    np.testing.assert_array_equal(session.get_tensor_data(w), [after])


def test_context_manager_attaches_once_and_nested_exits_do_nothing(executor):
    ir, w, xs, ys = _accumulating_weight()
    session = popxl.Session(ir, executor=executor)
    assert session.is_attached is False
    with session:
        assert session.is_attached is True
        with session:
            session.run({xs: np.array([1.0])})
        assert session.is_attached is True  # the inner exit neither detached...
        np.testing.assert_array_equal(session.get_tensor_data(w), [3.0])  # ...nor blocked the sync
        session.run({xs: np.array([1.0])})
    assert session.is_attached is False
    np.testing.assert_array_equal(session.get_tensor_data(w), [4.0])


def test_an_exception_detaches_without_copying_weights_to_host(executor):
    ir, w, xs, _ = _accumulating_weight()
    session = popxl.Session(ir, executor=executor)
    with pytest.raises(KeyError, match="boom"):
        with session:
            session.run({xs: np.array([1.0])})
            raise KeyError("boom")
    assert session.is_attached is False
    np.testing.assert_array_equal(session.get_tensor_data(w), [2.0])


def test_get_tensor_data_inside_the_context_syncs_after_a_run(executor):
    ir, w, xs, _ = _accumulating_weight()
    with popxl.Session(ir, executor=executor) as session:
        np.testing.assert_array_equal(session.get_tensor_data(w), [2.0])
        session.run({xs: np.array([1.0])})
        np.testing.assert_array_equal(session.get_tensor_data(w), [3.0])
        session.run({xs: np.array([1.0])})
        session.weights_to_host()
        np.testing.assert_array_equal(session.get_tensor_data(w), [4.0])


@pytest.mark.parametrize(
    "call", ["run", "run_with_outputs", "weights_from_host", "weights_to_host"]
)
def test_runtime_functions_while_detached_raise_value_error(call):
    ir, _, xs, ys = _accumulating_weight()
    session = popxl.Session(ir)
    args = {
        "run": ({xs: np.ones(1)},),
        "run_with_outputs": ({xs: np.ones(1)}, {ys: np.zeros(1, np.float32)}),
    }.get(call, ())
    with pytest.raises(ValueError, match=rf"Must be attached.*{call}"):
        getattr(session, call)(*args)


# ----------------------------------------------------------------------------------------
# The Session owns its Ir; device descriptions
# ----------------------------------------------------------------------------------------


def _add_op(ir):
    with ir.main_graph:
        ops.add(ir.main_graph.variables[0], 1.0)


def _add_op_to_subgraph(ir):
    with ir.graphs[1]:
        popxl.constant(1.0)


def _add_variable(ir):
    with ir.main_graph:
        popxl.variable(1.0)


def _add_stream(ir):
    with ir.main_graph:
        popxl.h2d_stream((1,), popxl.float32)


MODIFICATIONS = {
    "add_op": _add_op,
    "add_op_to_subgraph": _add_op_to_subgraph,
    "variable": _add_variable,
    "h2d_stream": _add_stream,
    "create_graph": lambda ir: ir.create_graph(lambda: None),
    "num_host_transfers": lambda ir: setattr(ir, "num_host_transfers", 2),
    "replication_factor": lambda ir: setattr(ir, "replication_factor", 2),
}


@pytest.mark.parametrize("case", MODIFICATIONS)
def test_modifying_an_ir_after_creating_its_session_raises_runtime_error(case):
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(1.0, name="v")
        ir.create_graph(lambda x: x + 1, v)
        ops.accumulate_(v, popxl.constant(1.0))
    popxl.Session(ir)
    with pytest.raises(RuntimeError, match="Session"):
        MODIFICATIONS[case](ir)


@pytest.mark.parametrize("device_desc", ["ipu_hw", "ipu_model", "cpu"])
def test_every_documented_device_desc_runs_the_simulator(device_desc, executor):
    ir, xs, ys = streamed((2,))
    with popxl.Session(ir, device_desc, executor=executor) as session:
        np.testing.assert_array_equal(session.run({xs: [1.5, -1.0]})[ys], [3.0, -2.0])


@pytest.mark.parametrize("device_desc", ["gpu", "IPU_HW", "", "ipu"])
def test_other_device_descs_are_rejected(device_desc):
    ir, _, _ = streamed((2,))
    with pytest.raises(ValueError, match=f"Incorrect device type provided '{device_desc}'"):
        popxl.Session(ir, device_desc)
