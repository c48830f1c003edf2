"""Code loading (PopXL guide, "Code loading"): ``ops.remote_code_load`` and the guide's
programs run unchanged, and the memory report shows where each graph's code lives."""

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.runtime.report import CODE_ALWAYS_LIVE, CODE_IN_STREAMING_MEMORY

# Upstream contract (popart python/popxl/ops/remote_code_load.py): destination, exception
# type, message beginning.
UPSTREAM_ERRORS = [
    ("compute_buffer", NotImplementedError, "destination == 'compute_buffer' for remote_code_load"),
    ("io_buffer", NotImplementedError, "destination == 'io_buffer' for remote_code_load op"),
    ("somewhere", ValueError, "Not a valid location"),
]


def _expensive_id_graph(ir):
    with ir.main_graph:
        x = popxl.variable(np.array([1.5, -2.0], np.float32), name="x")
    return x, ir.create_graph(lambda t: t.T.T, x.spec)


@pytest.mark.parametrize(("destination", "exc", "message"), UPSTREAM_ERRORS,
                         ids=[d for d, _, _ in UPSTREAM_ERRORS])  # fmt: skip
def test_remote_code_load_raises_upstreams_errors(destination, exc, message):
    ir = popxl.Ir()
    _, g = _expensive_id_graph(ir)
    with ir.main_graph, pytest.raises(exc, match=message):
        ops.remote_code_load(g, destination)
    assert ir._code_loads == []  # nothing recorded by a rejected load


def test_remote_code_load_cannot_load_the_graph_it_resides_in():
    ir = popxl.Ir()
    _, g = _expensive_id_graph(ir)
    with g, pytest.raises(ValueError, match=r"cannot load the code for the graph it resides in"):
        ops.remote_code_load(g, "executable")


def test_guide_code_loading_program_runs_and_reports_the_graph_as_loaded():
    # docs/popxl/files/code_loading.py (BEGIN_COMPLEX): load, call, load, call, load, call.
    ir = popxl.Ir()
    x, g = _expensive_id_graph(ir)
    with ir.main_graph, popxl.in_sequence():
        outs = []
        for _ in range(3):
            ops.remote_code_load(g, destination="executable")
            (y,) = ops.call(g, x)
            outs.append(y)
        s = popxl.d2h_stream(x.shape, x.dtype, "y")
        ops.host_store(s, ops.add(outs[0], outs[2]))
    with popxl.Session(ir, "ipu_model") as session:
        got = session.run()[s]
        report = session.memory_report()
    np.testing.assert_array_equal(got, [3.0, -4.0])  # code loading changes no value
    assert report.code_locations == ((g.id, CODE_IN_STREAMING_MEMORY, 3),)
    text = str(report)
    assert "Code location (ops.remote_code_load)" in text
    assert f"{CODE_IN_STREAMING_MEMORY}; loaded by 3 remote_code_load ops" in text
    assert report.to_dict()["code_locations"] == {
        g.id: {"location": CODE_IN_STREAMING_MEMORY, "loads": 3}
    }


def test_guide_nested_code_loading_program_runs_and_reports_every_graph():
    # docs/popxl/files/code_loading_nested.py: a graph that loads another graph's code, and
    # graphs built from a function taking the Graph to load as an argument.
    ir = popxl.Ir()
    x, g1 = _expensive_id_graph(ir)

    def load_g1():
        ops.remote_code_load(g1, destination="executable")

    g2 = ir.create_graph(load_g1)
    with ir.main_graph, popxl.in_sequence():
        ops.remote_code_load(g1, destination="executable")
        ops.call(g2)
        (y,) = ops.call(g1, x)

    def load_graph(g: popxl.Graph):
        ops.remote_code_load(g, destination="executable")

    g3 = ir.create_graph(load_graph, g1)
    g4 = ir.create_graph(load_graph, g2)
    with ir.main_graph, popxl.in_sequence():
        ops.remote_code_load(g3, destination="executable")
        ops.call(g3)
        ops.remote_code_load(g4, destination="executable")
        ops.call(g4)
        s = popxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(s, y)
    with popxl.Session(ir, "ipu_model") as session:
        np.testing.assert_array_equal(session.run()[s], [1.5, -2.0])
        report = session.memory_report()
    # g1: loaded in main, in g2 and in g3; g2: in g4; g3, g4: in main.
    assert dict((g, (w, n)) for g, w, n in report.code_locations) == {
        g1.id: (CODE_IN_STREAMING_MEMORY, 3),
        g2.id: (CODE_IN_STREAMING_MEMORY, 1),
        g3.id: (CODE_IN_STREAMING_MEMORY, 1),
        g4.id: (CODE_IN_STREAMING_MEMORY, 1),
    }


def test_called_graphs_that_are_never_loaded_are_always_live_and_plain_reports_unchanged():
    ir = popxl.Ir()
    x, g = _expensive_id_graph(ir)
    other = ir.create_graph(lambda t: t + 1.0, x.spec)
    with ir.main_graph, popxl.in_sequence():
        ops.call(other, x)
    with popxl.Session(ir, "ipu_model") as session:
        plain = session.memory_report()
    assert plain.code_locations == ()
    assert "Code location" not in str(plain)

    ir = popxl.Ir()
    x, g = _expensive_id_graph(ir)
    other = ir.create_graph(lambda t: t + 1.0, x.spec)
    with ir.main_graph, popxl.in_sequence():
        ops.remote_code_load(g, "executable")
        ops.call(g, x)
        ops.call(other, x)
    with popxl.Session(ir, "ipu_model") as session:
        report = session.memory_report()
    assert report.code_locations == (
        (g.id, CODE_IN_STREAMING_MEMORY, 1),
        (other.id, CODE_ALWAYS_LIVE, 0),
    )
