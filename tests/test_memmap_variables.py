"""np.memmap-backed variables (spec/popxl.md §3.3, §6): the memmap stays the variable's host
storage, weights_to_host writes into the file and flushes it, read-only memmaps refuse to be
written, and data the memmap cannot hold as it is raises ValueError."""

import logging
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
        ("dtype_conflict", "has dtype float32 but dtype=float16"),
        ("fortran", "must already be in C-ordered layout"),
        ("downcast", "requires downcasting the float64 data to 32 bits"),
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


def test_non_constant_grouping_logs_and_copies(tmp_path, caplog):
    mm, _ = _memmap(tmp_path, np.zeros((2, 3), np.float32))
    ir = popxl.Ir(replication=4)
    with ir.main_graph, caplog.at_level(logging.WARNING):
        rg = ir.replica_grouping_from_assignments([0, 1, 1, 0])
        v = popxl.variable(mm, name="w", replica_grouping=rg)
        _train_step(ir, v)
    assert caplog.text.count("you have passed np.memmap data and a non-const replica") == 1
    assert v._memmap_arr is None  # the variable holds a copy
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


# ---- upstream test_mmap_variable.py (popart tests/integration/popxl), the four variable kinds ----


def _onchip(w_data, dtype=None, replica_grouping=None):
    return popxl.variable(w_data, name="w", dtype=dtype, replica_grouping=replica_grouping)


def _remote(w_data, dtype=None, replica_grouping=None):
    shape = (
        w_data.shape[1:] if replica_grouping and replica_grouping.num_groups > 1 else w_data.shape
    )
    rb = popxl.remote_buffer(shape, popxl.dtypes.dtype.as_dtype(w_data.dtype))
    return popxl.remote_variable(
        w_data, rb, 0, name="w", dtype=dtype, replica_grouping=replica_grouping
    )


def _remote_rts(w_data, dtype=None, replica_grouping=None):
    rb = popxl.replica_sharded_buffer(
        w_data.shape, popxl.dtypes.dtype.as_dtype(w_data.dtype), replica_grouping=replica_grouping
    )
    return popxl.remote_replica_sharded_variable(
        w_data, rb, 0, name="w", dtype=dtype, replica_grouping=replica_grouping
    )


def _rts(w_data, dtype=None, replica_grouping=None):
    return popxl.replica_sharded_variable(
        w_data, name="w", dtype=dtype, replica_grouping=replica_grouping
    )[0]


KINDS = [_onchip, _remote, _remote_rts, _rts]
PREFIX = "When passing a memory-mapped NumPy array, "


@pytest.mark.parametrize("make", KINDS)
def test_memmap_error_messages_begin_as_upstream(tmp_path, make):
    ir = popxl.Ir(replication=2)
    f32 = np.memmap(str(tmp_path / "a.npy"), dtype=np.float32, shape=(4,), mode="w+")
    fortran = np.memmap(
        str(tmp_path / "b.npy"), dtype=np.float32, shape=(4, 4), mode="w+", order="F"
    )
    f64 = np.memmap(str(tmp_path / "c.npy"), dtype=np.double, shape=(4,), mode="w+")
    with ir.main_graph:
        with pytest.raises(ValueError) as exc:
            make(f32, dtype=popxl.dtypes.half)
        assert exc.value.args[0].startswith(PREFIX + "the `dtype` parameter")
        with pytest.raises(ValueError) as exc:
            make(fortran)
        assert exc.value.args[0].startswith(PREFIX + "it must already be in C-ordered")
        for bad in (None, popxl.dtypes.double):  # upstream formats dtype=None as "None"
            with pytest.raises(ValueError) as exc:
                make(f64, dtype=bad)
            assert exc.value.args[0].startswith(
                PREFIX + f"the dtype {bad} is not supported, as it requires downcasting"
            )
    assert not ir._variables  # no failed call left a variable behind


@pytest.mark.parametrize("make", KINDS)
def test_memmap_non_const_grouping_is_logged_once_and_copied(tmp_path, make, caplog):
    ir = popxl.Ir(replication=8)
    rg = ir.replica_grouping_from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
    w = np.memmap(
        str(tmp_path / "w.npy"), dtype=np.float32, shape=(rg.num_groups, rg.group_size * 2),
        mode="w+",
    )  # fmt: skip
    with ir.main_graph, caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")  # a log record, not a Python warning
        v = make(w, replica_grouping=rg)
    assert caplog.text.count("you have passed np.memmap data and a non-const replica grouping") == 1
    assert v._memmap_arr is None


@pytest.mark.parametrize("make", KINDS)
def test_memmap_arr_is_the_memmap_the_session_returns(tmp_path, make):
    ir = popxl.Ir(replication=2)
    w = np.memmap(str(tmp_path / "w.npy"), dtype=np.float32, shape=(20, 20), mode="w+")
    w.fill(1.0)
    with ir.main_graph:
        v = make(w)
        plain = popxl.variable(np.ones(3, np.float32), name="plain")
    assert v._memmap_arr is w
    assert plain._memmap_arr is None
    with popxl.Session(ir, "ipu_hw") as session:
        session.run()
    assert session.get_tensor_data(v) is w
    np.testing.assert_array_equal(w, 1.0)
