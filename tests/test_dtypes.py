"""popxl dtypes and host-data conversion against spec/popxl.md §3.1."""

import builtins
import copy
import pickle

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import dtypes
from torch_popxl.dtypes import dtype, dtype_of_numpy, to_numpy

# name: (is_int, is_floating_point, is_signed, is_complex, numpy dtype, torch dtype)
TABLE = {
    "bool": (False, False, False, False, np.dtype(np.bool_), torch.bool),
    "int8": (True, False, True, False, np.dtype(np.int8), torch.int8),
    "int16": (True, False, True, False, np.dtype(np.int16), torch.int16),
    "int32": (True, False, True, False, np.dtype(np.int32), torch.int32),
    "int64": (True, False, True, False, np.dtype(np.int64), torch.int64),
    "uint8": (True, False, False, False, np.dtype(np.uint8), torch.uint8),
    "uint16": (True, False, False, False, np.dtype(np.uint16), torch.uint16),
    "uint32": (True, False, False, False, np.dtype(np.uint32), torch.uint32),
    "uint64": (True, False, False, False, np.dtype(np.uint64), torch.uint64),
    "float8_143": (False, True, True, False, np.dtype([("float8_143", "u1")]), torch.float8_e4m3fn),
    "float8_152": (False, True, True, False, np.dtype([("float8_152", "u1")]), torch.float8_e5m2),
    # Not upstream (Note [bfloat16 is an extension]): host arrays hold the bit pattern.
    "bfloat16": (False, True, True, False, np.dtype([("bfloat16", "<u2")]), torch.bfloat16),
    "float16": (False, True, True, False, np.dtype(np.float16), torch.float16),
    "float32": (False, True, True, False, np.dtype(np.float32), torch.float32),
    "float64": (False, True, True, False, np.dtype(np.float64), torch.float64),
    "complex64": (False, False, True, True, np.dtype(np.complex64), torch.complex64),
    "complex128": (False, False, True, True, np.dtype(np.complex128), torch.complex128),
}
NAMES = list(TABLE)


# ----------------------------------------------------------------------------------------
# The dtype objects
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_dtype_has_the_documented_attributes(name):
    is_int, is_float, is_signed, is_complex, np_type, torch_type = TABLE[name]
    dt = getattr(dtypes, name)
    assert isinstance(dt, dtype)
    assert dt.name == name == str(dt)
    assert repr(dt) == f"torch_popxl.dtypes.{name}"
    assert (dt.is_int, dt.is_floating_point, dt.is_signed, dt.is_complex) == (
        is_int,
        is_float,
        is_signed,
        is_complex,
    )
    assert dt.as_numpy() == np_type
    assert dt.as_torch() == torch_type


@pytest.mark.parametrize("name", NAMES)
def test_lookups_return_the_singleton(name):
    dt = getattr(dtypes, name)
    assert dtype.from_name(name) is dt
    assert dtype.as_dtype(name) is dt
    assert dtype.as_dtype(dt) is dt
    assert dtype.as_dtype(dt.as_numpy()) is dt
    assert dtype.as_dtype(dt.as_torch()) is dt
    assert dtype_of_numpy(dt.as_numpy()) is dt
    assert pickle.loads(pickle.dumps(dt)) is dt
    assert copy.deepcopy(dt) is dt


def test_aliases():
    assert dtypes.half is dtypes.float16
    assert dtypes.float is dtypes.float32
    assert dtypes.double is dtypes.float64
    # As strings the aliases keep their popxl meaning ("float" is float32, unlike numpy).
    assert dtype.as_dtype("half") is dtypes.float16
    assert dtype.as_dtype("float") is dtypes.float32
    assert dtype.as_dtype("double") is dtypes.float64


def test_all_lists_every_dtype_and_alias():
    assert set(dtypes.__all__) == {"dtype", *NAMES, "half", "float", "double"}
    for name in dtypes.__all__:
        assert hasattr(dtypes, name)


def test_dtypes_cannot_be_constructed_or_mutated():
    with pytest.raises(TypeError, match="cannot be constructed"):
        dtype()
    with pytest.raises(AttributeError, match="immutable"):
        dtypes.float32._name = "float64"


def test_from_name_rejects_unknown_and_aliases():
    with pytest.raises(ValueError, match="no popxl dtype named 'float128'"):
        dtype.from_name("float128")
    with pytest.raises(ValueError, match="'half'"):
        dtype.from_name("half")
    with pytest.raises(ValueError):
        dtype.from_name(np.float32)


# ----------------------------------------------------------------------------------------
# as_dtype
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "python_type, expected",
    [
        (builtins.float, dtypes.float32),
        (builtins.int, dtypes.int64),  # upstream: numpy's reading of int (its unit test)
        (builtins.bool, dtypes.bool),
        (builtins.complex, dtypes.complex128),
    ],
)
def test_as_dtype_python_types(python_type, expected):
    assert dtype.as_dtype(python_type) is expected


@pytest.mark.parametrize(
    "value, expected",
    [
        (np.float16, dtypes.float16),  # numpy scalar type
        (np.int64, dtypes.int64),  # no downcast in as_dtype
        (np.bool_, dtypes.bool),
        (np.dtype(">f4"), dtypes.float32),  # byte order does not matter
        (np.zeros(3, np.uint16), dtypes.uint16),  # array
        (np.float64(1.0), dtypes.float64),  # numpy scalar
        (torch.zeros(2, dtype=torch.int8), dtypes.int8),  # tensor
        (torch.zeros(2, dtype=torch.float8_e5m2), dtypes.float8_152),
        (np.zeros(2, dtypes.float8_143.as_numpy()), dtypes.float8_143),
    ],
)
def test_as_dtype_numpy_torch_and_arrays(value, expected):
    assert dtype.as_dtype(value) is expected


@pytest.mark.parametrize(
    "value",
    [None, "float128", "f4", torch.complex32, np.dtype("U3"), np.ndarray, object(), 3, [1.0]],
)
def test_as_dtype_rejects_everything_else(value):
    with pytest.raises(ValueError, match="no popxl dtype compatible"):
        dtype.as_dtype(value)


def test_dtype_of_numpy_rejects_unsupported():
    with pytest.raises(ValueError, match="no popxl counterpart"):
        dtype_of_numpy(np.dtype("U3"))


# ----------------------------------------------------------------------------------------
# to_numpy
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, expected",
    [
        (1, np.int32),
        (1.0, np.float32),
        (True, np.bool_),
        ([1, 2], np.int32),
        ([1.0, 2], np.float32),
        (np.zeros(3, np.float64), np.float32),
        (np.zeros(3, np.int64), np.int32),
        (np.zeros(3, np.uint64), np.uint32),
        (np.zeros(3, np.float16), np.float16),
        (np.zeros(3, np.int8), np.int8),
        (1 + 2j, np.complex128),  # complex is never downcast
    ],
)
def test_to_numpy_downcasts_64_bit_types(data, expected):
    assert to_numpy(data).dtype == expected


def test_utils_downcast_table_is_the_one_to_numpy_applies():
    # upstream's tests compute expected dtypes from popxl.utils.downcast_np_dtypes
    from torch_popxl.utils import downcast_np_dtypes

    assert downcast_np_dtypes == {
        np.dtype(np.int64): np.dtype(np.int32),
        np.dtype(np.uint64): np.dtype(np.uint32),
        np.dtype(np.float64): np.dtype(np.float32),
    }
    for wide, narrow in downcast_np_dtypes.items():
        assert to_numpy(np.arange(3).astype(wide)).dtype == narrow


def test_to_numpy_without_downcast_keeps_64_bit_types():
    assert to_numpy(1, downcast=False).dtype == np.int64
    assert to_numpy(np.zeros(2), downcast=False).dtype == np.float64


def test_to_numpy_with_dtype_casts_and_ignores_downcast():
    out = to_numpy([1.7, 2.2], dtypes.int64)
    assert out.dtype == np.int64 and out.tolist() == [1, 2]
    assert to_numpy(np.zeros(2), dtypes.float64).dtype == np.float64
    assert to_numpy(1, "float16").dtype == np.float16


def test_to_numpy_detaches_tensors_that_require_grad():
    t = torch.tensor([1.0, 2.0], requires_grad=True)
    out = to_numpy(t)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [1.0, 2.0])


def test_to_numpy_downcasts_int64_tensors():
    assert to_numpy(torch.arange(3)).dtype == np.int32


def test_to_numpy_rejects_tensors_without_popxl_dtype():
    with pytest.raises(TypeError, match="float8_e4m3fnuz"):
        to_numpy(torch.zeros(2, dtype=torch.float8_e4m3fnuz))


def test_bfloat16_host_data_is_its_bit_pattern_and_round_trips():
    """Note [bfloat16 is an extension]: numpy has no bfloat16, so host arrays hold the bits;
    floats are rounded as torch rounds them (to nearest, ties to even)."""
    t = torch.tensor([1.0, -2.5, 3.0e38, 1.0 / 3.0], dtype=torch.bfloat16)
    bits = to_numpy(t)
    assert bits.dtype == dtypes.np_dtype_bfloat16
    assert bits["bfloat16"].tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()
    assert torch.equal(dtypes.numpy_to_torch(bits, dtypes.bfloat16), t)
    from_floats = to_numpy(np.array([1.0, -2.5, 3.0e38, 1.0 / 3.0]), dtypes.bfloat16)
    assert from_floats.tobytes() == bits.tobytes()
    assert to_numpy(bits, dtypes.float32).tolist() == t.float().tolist()
    assert dtype.as_dtype(bits) is dtypes.bfloat16
    assert dtypes.torch_to_numpy(t, dtypes.bfloat16).tobytes() == bits.tobytes()


def test_float8_variables_round_trip_through_a_session():
    """Structured (float8 / bfloat16) host copies upload as their bits."""
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.array([1.0, 2.0, -0.5], np.float32), popxl.float8_143)
        b = popxl.variable(np.array([1.0, 2.0, -0.5], np.float32), popxl.bfloat16)
    with popxl.Session(ir, "ipu_model") as session:
        data = session.get_tensors_data([v, b])
    assert dtypes.numpy_to_torch(data[v], dtypes.float8_143).float().tolist() == [1.0, 2.0, -0.5]
    assert dtypes.numpy_to_torch(data[b], dtypes.bfloat16).float().tolist() == [1.0, 2.0, -0.5]


def test_to_numpy_rejects_non_numeric_data():
    with pytest.raises(TypeError, match="numpy dtype <U"):
        to_numpy(["a", "b"])


@pytest.mark.parametrize(
    "data",
    [
        np.arange(4, dtype=np.float32),
        np.arange(4, dtype=np.float64),
        torch.arange(4, dtype=torch.float32),
        torch.arange(4, dtype=torch.float32, requires_grad=True),
    ],
)
def test_to_numpy_never_shares_memory_with_the_input(data):
    out = to_numpy(data)
    source = data.detach().numpy() if isinstance(data, torch.Tensor) else data
    assert not np.shares_memory(out, source)
    with torch.no_grad():
        data[0] = 100
    assert out[0] == 0


def test_to_numpy_returns_c_contiguous_arrays():
    out = to_numpy(np.ones((4, 6), np.float32)[:, ::2])
    assert out.flags["C_CONTIGUOUS"] and out.shape == (4, 3)


@pytest.mark.parametrize("arg_name", ["log2_scale", "nan_on_overflow"])
@pytest.mark.parametrize("dt", [None, dtypes.float32, dtypes.int8])
def test_float8_options_require_a_float8_dtype(arg_name, dt):
    with pytest.raises(RuntimeError, match=f"{arg_name}.*only supported for popxl.float8"):
        to_numpy([1.0], dt, **{arg_name: 1 if arg_name == "log2_scale" else True})


def _decode(array, dt):
    return torch.from_numpy(array.view(np.uint8)).view(dt.as_torch()).float()


@pytest.mark.parametrize("dt", [dtypes.float8_143, dtypes.float8_152])
def test_to_numpy_float8_round_trips_representable_values(dt):
    values = [0.0, 1.0, -2.5, 0.125, 12.0]
    out = to_numpy(values, dt)
    assert out.dtype == dt.as_numpy() and out.shape == (5,)
    assert _decode(out, dt).tolist() == values


def test_to_numpy_float8_keeps_scalar_shape():
    out = to_numpy(3.0, dtypes.float8_143)
    assert out.shape == () and out.dtype == dtypes.float8_143.as_numpy()


def test_to_numpy_float8_log2_scale_multiplies_by_a_power_of_two():
    out = to_numpy([1.0, 3.0], dtypes.float8_152, log2_scale=-2)
    assert _decode(out, dtypes.float8_152).tolist() == [0.25, 0.75]


@pytest.mark.parametrize(
    "dt, representable, overflow",
    [
        # OCP maxima: 448 and 57344; ties at 464 round down, at 61440 up (see dtypes.py)
        (dtypes.float8_143, [448.0, 464.0, -460.0], [465.0, 1e6, -np.inf]),
        (dtypes.float8_152, [57344.0, 61000.0], [61440.0, -1e9, np.inf]),
    ],
)
def test_to_numpy_float8_overflow(dt, representable, overflow):
    fp8_max = torch.finfo(dt.as_torch()).max
    data = representable + overflow
    as_nan = _decode(to_numpy(data, dt), dt)
    assert torch.isfinite(as_nan[: len(representable)]).all()
    assert torch.isnan(as_nan[len(representable) :]).all()
    saturated = _decode(to_numpy(data, dt, nan_on_overflow=False), dt)
    assert saturated[len(representable) :].abs().eq(fp8_max).all()


def test_to_numpy_float8_passes_encoded_data_through():
    encoded = to_numpy([1.0, 2.0], dtypes.float8_143)
    again = to_numpy(encoded, dtypes.float8_143, log2_scale=3)
    np.testing.assert_array_equal(again, encoded)
    assert not np.shares_memory(again, encoded)
    assert to_numpy(encoded).dtype == dtypes.float8_143.as_numpy()


def test_to_numpy_accepts_torch_float8_tensors():
    t = torch.tensor([1.0, -2.0]).to(torch.float8_e4m3fn)
    out = to_numpy(t)
    assert out.dtype == dtypes.float8_143.as_numpy()
    assert _decode(out, dtypes.float8_143).tolist() == [1.0, -2.0]


def test_to_numpy_float8_rejects_non_float_data():
    with pytest.raises(RuntimeError, match="needs float16, float32 or float64"):
        to_numpy(np.arange(3), dtypes.float8_143)
    with pytest.raises(RuntimeError, match="needs float16, float32 or float64"):
        to_numpy(to_numpy([1.0], dtypes.float8_152), dtypes.float8_143)


def test_to_numpy_float8_log2_scale_range():
    with pytest.raises(RuntimeError, match=r"\[-32, 32\)"):
        to_numpy([1.0], dtypes.float8_143, log2_scale=32)


def test_testing_dtype_lists_match_torchs_properties():
    # upstream's popxl.testing lists; each dtype's flags agree with torch's (unsigned ints by
    # their signed torch counterparts' kind) and with numpy's dtype of the same name
    from torch_popxl.testing import get_all_dtypes, get_all_int_dtypes

    ints = get_all_int_dtypes()
    assert [d.name for d in get_all_int_dtypes(include_signed=False)] == [
        "uint8", "uint16", "uint32", "uint64"
    ]  # fmt: skip
    assert len(get_all_dtypes()) == 13 and dtypes.bool not in get_all_dtypes()
    for d in get_all_dtypes():
        unsigned = d.name.startswith("u")
        t = getattr(torch, d.name[1:] if unsigned else d.name)
        assert (d.is_complex, d.is_floating_point) == (t.is_complex, t.is_floating_point)
        assert d.is_int == (d in ints)
        assert d.is_signed == (t.is_signed and not unsigned)
        assert dtypes.dtype.as_dtype(np.zeros(1, getattr(np, d.name))) == d
