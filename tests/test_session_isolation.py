"""Issue 12 (items 6 and 7): a session's traffic figures are its own, ``Session.run`` never
writes into the caller's inputs, and data of the wrong kind for a stream is rejected before
anything runs.

Counter figures are checked against hand-computed ring-model bytes (csrc/traffic.cpp, Note
[traffic accounting]); input arrays against a copy taken before the run; outputs against
numpy on the same data.
"""

import threading

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.opdefs import backends

EXECUTORS = ("reference", "fast")
F32 = 4


@pytest.fixture(params=EXECUTORS)
def executor(request):
    return request.param


# ----------------------------------------------------------------------------------------
# Per-session traffic counters
# ----------------------------------------------------------------------------------------


def _as_counted_by(executor, expected):
    # The reference executor runs collectives and remote IO in plain Python, outside the
    # counting kernels (its report has no measured counters); it counts host bytes only.
    if executor == "reference":
        return {k: v if k == "host_bytes" else 0 for k, v in expected.items()}
    return expected


def _all_reduce_session(executor):
    """R=2: all-reduce of a 4-float variable, stored to the host."""
    ir = popxl.Ir(2)
    with ir.main_graph:
        x = popxl.variable(np.arange(4, dtype=np.float32))
        out = popxl.d2h_stream((4,), popxl.float32)
        ops.host_store(out, ops.collectives.replicated_all_reduce(x))
    expected = dict.fromkeys(backends.traffic_counters(), 0)
    # all-reduce: (R/G) * 2(G-1) * n = 1 * 2 * 1 * 16; host: R * 16
    expected.update(collective_bytes=2 * 1 * 4 * F32, num_collectives=1, host_bytes=2 * 4 * F32)
    return popxl.Session(ir, executor=executor), _as_counted_by(executor, expected)


def _gather_and_remote_session(executor):
    """R=4: all-gather of 3 floats, a remote store and load of 2 floats, host store."""
    ir = popxl.Ir(4)
    with ir.main_graph, popxl.in_sequence(True):
        x = popxl.variable(np.ones(3, np.float32))
        buf = popxl.remote_buffer((2,), popxl.float32, 1)
        gathered = ops.collectives.replicated_all_gather(x)
        ops.remote_store(buf, 0, x[:2])
        loaded = ops.remote_load(buf, 0)
        out = popxl.d2h_stream(gathered.shape, popxl.float32)
        ops.host_store(out, gathered)
        out2 = popxl.d2h_stream((2,), popxl.float32)
        ops.host_store(out2, loaded)
    expected = dict.fromkeys(backends.traffic_counters(), 0)
    expected.update(
        collective_bytes=4 * 3 * 3 * F32,  # all-gather: R * (G-1) * n
        num_collectives=1,
        remote_store_bytes=4 * 2 * F32,  # R * slot bytes
        num_remote_stores=1,
        remote_load_bytes=4 * 2 * F32,
        num_remote_loads=1,
        host_bytes=4 * (12 + 2) * F32,  # every replica stores its 12 + 2 floats
    )
    return popxl.Session(ir, executor=executor), _as_counted_by(executor, expected)


def test_each_session_alone_counts_the_hand_computed_bytes(executor):
    for build in (_all_reduce_session, _gather_and_remote_session):
        session, expected = build(executor)
        with session:
            session.run()
        assert session._last_run_counters == expected


def test_interleaved_sessions_keep_their_solo_figures_and_the_global_counters_add_up(executor):
    a, expected_a = _all_reduce_session(executor)
    b, expected_b = _gather_and_remote_session(executor)
    order = [a, b, a, b, b, a, b]
    with a, b:
        before = backends.traffic_counters()
        for s in order:
            s.run()
            assert s._last_run_counters == (expected_a if s is a else expected_b)
        after = backends.traffic_counters()
    # A session's run never resets the process-wide counters: they hold every run's traffic.
    runs_a, runs_b = order.count(a), order.count(b)
    assert {k: after[k] - before[k] for k in after} == {
        k: runs_a * expected_a[k] + runs_b * expected_b[k] for k in after
    }
    if executor == "fast":
        assert dict(a.memory_report().measured_counters) == expected_a
        assert dict(b.memory_report().measured_counters) == expected_b


def test_sessions_running_in_two_threads_each_report_their_solo_figures(executor):
    a, expected_a = _all_reduce_session(executor)
    b, expected_b = _gather_and_remote_session(executor)
    seen: dict[str, list[dict]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def loop(name, session):
        try:
            for _ in range(15):
                session.run()
                seen[name].append(dict(session._last_run_counters))
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)

    with a, b:
        threads = [
            threading.Thread(target=loop, args=("a", a)),
            threading.Thread(target=loop, args=("b", b)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert seen["a"] == [expected_a] * 15
    assert seen["b"] == [expected_b] * 15


def test_traffic_scope_measures_only_the_enclosed_code_and_never_resets():
    backends.add_host_bytes(5)
    total = backends.traffic_counters()["host_bytes"]
    with backends.traffic_scope() as outer:
        backends.add_host_bytes(7)
        with backends.traffic_scope() as inner:
            backends.add_host_bytes(11)
    assert inner["host_bytes"] == 11
    assert outer["host_bytes"] == 18
    assert backends.traffic_counters()["host_bytes"] == total + 18


# ----------------------------------------------------------------------------------------
# Session.run never writes into the caller's inputs
# ----------------------------------------------------------------------------------------


def _in_place_program(replicas):
    """x = host_load; x += 1; all_reduce_(x) in place; store x."""
    ir = popxl.Ir(replicas)
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        x = ops.host_load(xs)
        x += 1.0
        ops.collectives.replicated_all_reduce_(x)
        ys = popxl.d2h_stream((3,), popxl.float32, "y")
        ops.host_store(ys, x)
    return ir, xs, ys


@pytest.mark.parametrize("replicas", [1, 4])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_run_never_modifies_the_callers_input_array(replicas, kind, executor):
    ir, xs, ys = _in_place_program(replicas)
    shape = (replicas, 3) if replicas > 1 else (3,)
    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    given = torch.from_numpy(data.copy()) if kind == "torch" else data.copy()
    expected = (data + 1).reshape(replicas, 3).sum(0)
    with popxl.Session(ir, executor=executor) as session:
        for _ in range(2):  # a second run would see the first run's writes
            y = session.run({xs: given})[ys]
            np.testing.assert_array_equal(y.reshape(replicas, 3), np.stack([expected] * replicas))
    np.testing.assert_array_equal(np.asarray(given), data)


def _write_through_a_view(replicas):
    """x = host_load; reshape_(x) += 3 (a view of the loaded value); store x."""
    ir = popxl.Ir(replicas)
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        x = ops.host_load(xs)
        v = ops.reshape_(x, (3, 1))
        v += 3.0
        ys = popxl.d2h_stream((3,), popxl.float32, "y")
        ops.host_store(ys, x)
    return ir, xs, ys, lambda d: d + 3


def _write_inside_a_called_graph(replicas):
    """The loaded value passed to a subgraph that adds to its input, marked modified."""
    ir = popxl.Ir(replicas)
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        x = ops.host_load(xs)

        def bump(t):
            t += 2.0
            return t

        g = ir.create_graph(bump, x)
        info = ops.call_with_info(g, x)
        info.set_parent_input_modified(x)
        ys = popxl.d2h_stream((3,), popxl.float32, "y")
        ops.host_store(ys, x)
    return ir, xs, ys, lambda d: d + 2


@pytest.mark.parametrize("build", [_write_through_a_view, _write_inside_a_called_graph])
@pytest.mark.parametrize("replicas", [1, 4])
def test_inputs_written_through_views_or_calls_are_copied(build, replicas, executor):
    ir, xs, ys, expect = build(replicas)
    shape = (replicas, 3) if replicas > 1 else (3,)
    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
    given = data.copy()
    with popxl.Session(ir, executor=executor) as session:
        for _ in range(2):
            np.testing.assert_array_equal(session.run({xs: given})[ys], expect(data))
    np.testing.assert_array_equal(given, data)


def test_only_streams_the_program_writes_are_copied():
    # The fast executor shares memory with inputs nothing writes (no copy per run) and copies
    # the ones it writes; the analysis tells which.
    ir = popxl.Ir(2)
    with ir.main_graph:
        a_s = popxl.h2d_stream((3,), popxl.float32, "a")
        b_s = popxl.h2d_stream((3,), popxl.float32, "b")
        a, b = ops.host_load(a_s), ops.host_load(b_s)
        b += a
        ys = popxl.d2h_stream((3,), popxl.float32, "y")
        ops.host_store(ys, b * 1.0)
    with popxl.Session(ir) as session:
        assert session._executor.written_streams == frozenset({b_s._index})
        a_data, b_data = np.ones((2, 3), np.float32), np.full((2, 3), 2.0, np.float32)
        y = session.run({a_s: a_data, b_s: b_data})[ys]
    np.testing.assert_array_equal(y, np.full((2, 3), 3.0))
    np.testing.assert_array_equal(b_data, np.full((2, 3), 2.0))


# ----------------------------------------------------------------------------------------
# Data of another kind than the stream's dtype
# ----------------------------------------------------------------------------------------


def _int_stream_program(replicas=1):
    ir = popxl.Ir(replicas)
    with ir.main_graph:
        counter = popxl.variable(np.zeros((), np.int32), name="counter")
        ops.var_updates.accumulate_(counter, popxl.constant(1, popxl.int32))
        xs = popxl.h2d_stream((2,), popxl.int32, "labels")
        ys = popxl.d2h_stream((2,), popxl.int32, "out")
        ops.host_store(ys, ops.host_load(xs) + counter)
    return ir, xs, ys, counter


FLOATS_FOR_INT = {
    "numpy_float32": np.array([1.7, 2.2], np.float32),
    "numpy_float64": np.array([1.7, 2.2]),
    "torch_float32": torch.tensor([1.7, 2.2]),
    "python_floats": [1.7, 2.2],
}


@pytest.mark.parametrize("kind", FLOATS_FOR_INT)
def test_float_data_for_an_int_stream_raises_before_anything_runs(kind, executor):
    ir, xs, ys, counter = _int_stream_program()
    with popxl.Session(ir, executor=executor) as session:
        with pytest.raises(TypeError, match=r"^Type discrepancy for input stream 'labels'.*"
                           r"float(32|64).*int32"):  # fmt: skip
            session.run({xs: FLOATS_FOR_INT[kind]})
        # nothing ran: the variable was not updated, and the session still works
        assert session.get_tensor_data(counter) == 0
        out = session.run({xs: np.array([1, 2], np.int32)})[ys]
        np.testing.assert_array_equal(out, [2, 3])


@pytest.mark.parametrize(
    "dtype,data",
    [
        (popxl.int32, np.array([1 + 2j, 3], np.complex64)),
        (popxl.float32, np.array([1 + 2j, 3], np.complex64)),
        (popxl.bool, np.array([0, 2], np.int32)),
        (popxl.uint8, np.array([0.5, 2.0], np.float16)),
    ],
)
def test_other_kind_lowering_inputs_are_rejected_naming_both_dtypes(dtype, data):
    ir = popxl.Ir(1)
    with ir.main_graph:
        xs = popxl.h2d_stream((2,), dtype, "s")
        ops.host_store(popxl.d2h_stream((2,), dtype), ops.host_load(xs))
    with popxl.Session(ir) as session:
        with pytest.raises(TypeError, match=f"'s'.*{data.dtype}.*{dtype.as_numpy()}"):
            session.run({xs: data})


def test_int_data_for_a_float_stream_and_float16_widening_are_accepted(executor):
    ir = popxl.Ir(1)
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        ys = popxl.d2h_stream((3,), popxl.float32)
        ops.host_store(ys, ops.host_load(xs) * 0.5)
    with popxl.Session(ir, executor=executor) as session:
        for data in (np.array([1, 2, 3], np.int32), np.array([1, 2, 3], np.float16), [1, 2, 3]):
            np.testing.assert_array_equal(session.run({xs: data})[ys], [0.5, 1.0, 1.5])
