"""np.memmap-backed variables (spec/popxl.md §3.3, §6): the memmap stays the variable's host
storage, weights_to_host writes into the file and flushes it, read-only memmaps refuse to be
written, and data the memmap cannot hold as it is raises ValueError."""

import warnings

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.ops as ops


def _memmap(tmp_path, data, mode="w+", name="w.bin", order="C"):
    path = tmp_path / name
    mm = np.memmap(path, dtype=data.dtype, mode="w+", shape=data.shape, order=order)
    mm[...] = data
    mm.flush()
    if mode != "w+":
        mm = np.memmap(path, dtype=data.dtype, mode=mode, shape=data.shape, order=order)
    return mm, path


def _train_step(ir, v):
    with ir.main_graph:
        ops.var_updates.accumulate_(v, popxl.constant(np.ones(v.shape, np.float32)))


@pytest.mark.parametrize("factory", ["variable", "remote_variable"])
def test_weights_to_host_writes_into_the_memmap_file_and_flushes(tmp_path, factory):
    init = np.arange(6, dtype=np.float32).reshape(2, 3)
    mm, path = _memmap(tmp_path, init)
    ir = popxl.Ir()
    with ir.main_graph:
        if factory == "variable":
            v = popxl.variable(mm, name="w")
            _train_step(ir, v)
        else:
            buf = popxl.remote_buffer((2, 3), popxl.float32, 1)
            v = popxl.remote_variable(mm, buf, 0, name="w")
            x = ops.remote_load(buf, 0)
            ops.remote_store(buf, 0, x + 1)
    with popxl.Session(ir) as session:
        session.run()
        session.run()
    # The caller's memmap object and the file on disk both hold the trained value.
    np.testing.assert_array_equal(mm, init + 2)
    on_disk = np.fromfile(path, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(on_disk, init + 2)
    assert session.get_tensor_data(v) is mm or np.array_equal(session.get_tensor_data(v), init + 2)


def test_write_variable_data_writes_through_to_the_memmap(tmp_path):
    mm, _ = _memmap(tmp_path, np.zeros(3, np.float32))
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(mm, name="w")
        _train_step(ir, v)
    session = popxl.Session(ir)
    session.write_variable_data(v, np.full(3, 7.0, np.float32))
    np.testing.assert_array_equal(mm, [7, 7, 7])


def test_read_only_memmap_turns_weights_to_host_off_and_refuses_writes(tmp_path):
    init = np.ones(3, np.float32)
    mm, path = _memmap(tmp_path, init, mode="r")
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(mm, name="w")
        _train_step(ir, v)
    session = popxl.Session(ir)
    assert session.weights_to_host_on_exit is False
    with session:
        session.run()
        with pytest.raises(RuntimeError, match="read-only np.memmap"):
            session.weights_to_host()
    with pytest.raises(ValueError, match="read-only np.memmap"):
        session.write_variable_data(v, np.zeros(3, np.float32))
    np.testing.assert_array_equal(np.fromfile(path, dtype=np.float32), init)  # file untouched


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        # upstream's message beginnings, then what was given
        (
            "dtype_conflict",
            r"^When passing a memory-mapped NumPy array, the `dtype` parameter.*float32 but dtype=float16",
        ),
        ("fortran", r"^When passing a memory-mapped NumPy array, it must already be in C-ordered"),
        (
            "downcast",
            r"^When passing a memory-mapped NumPy array, the dtype None is not supported, as it requires downcasting.*float64",
        ),
    ],
)
def test_memmaps_that_would_need_converting_raise_value_error(tmp_path, kind, match):
    if kind == "fortran":
        mm, _ = _memmap(tmp_path, np.zeros((2, 3), np.float32), order="F")
        kwargs = {}
    elif kind == "downcast":
        mm, _ = _memmap(tmp_path, np.zeros(3, np.float64))
        kwargs = {}
    else:
        mm, _ = _memmap(tmp_path, np.zeros(3, np.float32))
        kwargs = {"dtype": popxl.float16}
    ir = popxl.Ir()
    with ir.main_graph, pytest.raises(ValueError, match=match):
        popxl.variable(mm, **kwargs)
    assert not ir._variables  # nothing was added


def test_float64_memmap_is_kept_when_downcast_is_off(tmp_path):
    mm, _ = _memmap(tmp_path, np.arange(3, dtype=np.float64))
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(mm, downcast=False)
    assert v.dtype == popxl.float64


def test_non_constant_grouping_warns_and_copies(tmp_path):
    mm, _ = _memmap(tmp_path, np.zeros((2, 3), np.float32))
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        with pytest.warns(UserWarning, match="non-constant replica grouping"):
            rg = ir.replica_grouping_from_assignments([0, 1, 1, 0])
            v = popxl.variable(mm, name="w", replica_grouping=rg)
        _train_step(ir, v)
    with popxl.Session(ir) as session:
        session.run()
    np.testing.assert_array_equal(mm, 0)  # a copy was trained, not the memmap
    np.testing.assert_array_equal(session.get_tensor_data(v), 1)


def test_grouped_constant_grouping_keeps_the_memmap_of_all_groups(tmp_path):
    mm, _ = _memmap(tmp_path, np.array([[0, 0, 0], [10, 10, 10]], np.float32))
    ir = popxl.Ir(replication=4)
    with ir.main_graph, warnings.catch_warnings():
        warnings.simplefilter("error")
        v = popxl.variable(mm, name="w", replica_grouping=ir.replica_grouping(group_size=2))
        _train_step(ir, v)
    with popxl.Session(ir) as session:
        session.run()
    np.testing.assert_array_equal(mm, [[1, 1, 1], [11, 11, 11]])
