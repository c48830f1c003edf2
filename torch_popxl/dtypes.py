"""PopXL tensor element types (``popxl.dtypes``) and host-data conversion.

Every ``dtype`` is a singleton, so ``is`` and ``==`` agree and dtypes can be dict keys.
This module defines names that shadow Python builtins (``bool``, ``float``), exactly as
PopXL does; code in this module therefore spells the builtins as ``builtins.bool`` etc.

Note [float8 encoding]
    PopXL's ``float8_143`` / ``float8_152`` are Graphcore formats: exponent bias 8 / 16,
    no infinities, a single NaN at 0x80 (the "fnuz" family). This simulator stores float8
    data with torch's OCP formats instead (``float8_e4m3fn``: bias 7, max 448;
    ``float8_e5m2``: bias 15, max 57344), because that is what ``as_torch`` maps to and what
    torch kernels support best. Consequences: the raw bytes differ from PopXL's, and the
    representable range of ``float8_143`` is wider here (448 instead of 240). Host arrays
    keep PopXL's layout: a structured numpy dtype with one ``uint8`` field.

Note [bfloat16 is an extension]
    Upstream PopXL has no bfloat16 (the IPU computes in float16/float32). This simulator adds
    ``bfloat16`` so that bf16 torch models and ``torch.autocast(dtype=torch.bfloat16)``
    regions compile (``popxl.compile``), and so that a program may stream bf16 data. numpy
    has no bfloat16 either, so host arrays use the float8 scheme: a structured numpy dtype
    with one ``uint16`` field holding the bit pattern (``np_dtype_bfloat16``). Torch bf16
    tensors are accepted wherever host data is, and float data converts with torch's
    rounding (to nearest, ties to even).
"""

from __future__ import annotations

import builtins
import math
import operator
from typing import Any

import numpy as np
import torch

__all__ = [
    "dtype",
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float8_143",
    "float8_152",
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "half",
    "float",
    "double",
]

# PopXL's host representation of float8 data (numpy has no float8 type).
np_dtype_float8_143 = np.dtype([("float8_143", "u1")])
np_dtype_float8_152 = np.dtype([("float8_152", "u1")])
# Host representation of bfloat16 data: its bit pattern (Note [bfloat16 is an extension]).
np_dtype_bfloat16 = np.dtype([("bfloat16", "<u2")])

# Lookup tables filled by `_register`; keyed by canonical objects only.
_BY_NAME: dict[str, dtype] = {}
_BY_NUMPY: dict[np.dtype, dtype] = {}
_BY_TORCH: dict[torch.dtype, dtype] = {}

# PopXL's aliases are module attributes; `as_dtype` also accepts them as strings so that
# `as_dtype("float")` means popxl.float (float32), not numpy's "float" (float64).
_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}

# Python scalar types, as upstream maps them: bool and float name popxl.bool and popxl.float32;
# int names none, so numpy reads it (int64, unlike `to_numpy(1)`, which downcasts the value to
# int32); complex likewise (complex128).
_BY_PYTHON_TYPE = {
    builtins.bool: "bool",
    builtins.int: "int64",
    builtins.float: "float32",
    builtins.complex: "complex128",
}

# ----------------------------------------------------------------------------------------
# The dtype class
# ----------------------------------------------------------------------------------------


class dtype:  # noqa: N801 -- PopXL's public name
    """The element type of a PopXL tensor. Instances are the module-level singletons."""

    __slots__ = (
        "_name",
        "_is_int",
        "_is_floating_point",
        "_is_signed",
        "_is_complex",
        "_np_type",
        "_torch_type",
    )
    # The slots' types; ``_register`` fills them (dtypes are never built by ``__init__``).
    _name: str
    _is_int: builtins.bool
    _is_floating_point: builtins.bool
    _is_signed: builtins.bool
    _is_complex: builtins.bool
    _np_type: np.dtype
    _torch_type: torch.dtype

    def __init__(self) -> None:
        raise TypeError(
            "popxl dtypes cannot be constructed; use a module-level instance such as "
            "popxl.float32, or dtype.as_dtype(x) / dtype.from_name(name) to look one up."
        )

    @classmethod
    def _register(
        cls,
        name: str,
        *,
        is_int: builtins.bool,
        is_floating_point: builtins.bool,
        is_signed: builtins.bool,
        is_complex: builtins.bool,
        np_type: np.dtype,
        torch_type: torch.dtype,
    ) -> dtype:
        self = object.__new__(cls)
        for slot, value in (
            ("_name", name),
            ("_is_int", is_int),
            ("_is_floating_point", is_floating_point),
            ("_is_signed", is_signed),
            ("_is_complex", is_complex),
            ("_np_type", np.dtype(np_type)),
            ("_torch_type", torch_type),
        ):
            object.__setattr__(self, slot, value)
        assert name not in _BY_NAME and self._np_type not in _BY_NUMPY
        assert torch_type not in _BY_TORCH
        _BY_NAME[name] = self
        _BY_NUMPY[self._np_type] = self
        _BY_TORCH[torch_type] = self
        return self

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"popxl dtypes are immutable (tried to set {key!r} on {self!r}).")

    # Singletons must survive pickling and copy.copy/deepcopy as the same object.
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (dtype.from_name, (self._name,))

    @property
    def name(self) -> str:
        """The canonical name, for example ``"float32"``."""
        return self._name

    @property
    def is_int(self) -> builtins.bool:
        """True for signed and unsigned integer types (not bool)."""
        return self._is_int

    @property
    def is_floating_point(self) -> builtins.bool:
        """True for float8, float16, float32 and float64."""
        return self._is_floating_point

    @property
    def is_signed(self) -> builtins.bool:
        """True for types that can hold negative values."""
        return self._is_signed

    @property
    def is_complex(self) -> builtins.bool:
        """True for complex64 and complex128."""
        return self._is_complex

    def as_numpy(self) -> np.dtype:
        """The numpy dtype of host arrays of this type (structured for float8)."""
        return self._np_type

    def as_torch(self) -> torch.dtype:
        """The torch dtype used for this type on device. See Note [float8 encoding]."""
        return self._torch_type

    def __repr__(self) -> str:
        return f"{__name__}.{self._name}"

    def __str__(self) -> str:
        return self._name

    @classmethod
    def from_name(cls, name: str) -> dtype:
        """Return the dtype whose canonical ``name`` is ``name`` (aliases are not names)."""
        if isinstance(name, str) and name in _BY_NAME:
            return _BY_NAME[name]
        raise ValueError(
            f"There is no popxl dtype named {name!r}. Expected one of: {', '.join(_BY_NAME)}."
        )

    @classmethod
    def as_dtype(cls, type_value: Any) -> dtype:
        """Convert ``type_value`` to a popxl dtype.

        Accepts a popxl dtype, a dtype name or alias (``"float32"``, ``"half"``), a Python type
        (``bool``, ``int`` -> int32, ``float`` -> float32), a numpy dtype or scalar type, a
        torch dtype, or anything with a ``dtype`` attribute (arrays, tensors).

        Raises:
            ValueError: if no popxl dtype corresponds to ``type_value``.
        """
        found = _lookup(type_value)
        if found is None and not isinstance(type_value, type):
            found = _lookup(getattr(type_value, "dtype", None))
        if found is None:
            raise ValueError(
                f"There is no popxl dtype compatible with {type_value!r} "
                f"(of type {type(type_value).__name__}). Expected a popxl dtype, a dtype name "
                f"such as 'float32', a Python type (bool, int, float), a numpy dtype, a torch "
                f"dtype, or an array/tensor of one of: {', '.join(_BY_NAME)}."
            )
        return found


def _lookup(value: Any) -> dtype | None:
    """The popxl dtype for a dtype-like value (not an array), or None."""
    if isinstance(value, dtype):
        return value
    if isinstance(value, str):
        return _BY_NAME.get(_ALIASES.get(value, value))
    if isinstance(value, torch.dtype):
        return _BY_TORCH.get(value)
    if isinstance(value, type):
        if value in _BY_PYTHON_TYPE:
            return _BY_NAME[_BY_PYTHON_TYPE[value]]
        if issubclass(value, np.generic):
            return _lookup(np.dtype(value))
        return None
    if isinstance(value, np.dtype):
        # A byte-swapped dtype ('>f4') still describes float32 data.
        return _BY_NUMPY.get(value if value.isnative else value.newbyteorder("="))
    return None


# ----------------------------------------------------------------------------------------
# The instances
# ----------------------------------------------------------------------------------------


def _int(name: str, signed: builtins.bool) -> dtype:
    return dtype._register(
        name,
        is_int=True,
        is_floating_point=False,
        is_signed=signed,
        is_complex=False,
        np_type=np.dtype(name),
        torch_type=getattr(torch, name),
    )


def _float(name: str, np_type: np.dtype, torch_type: torch.dtype) -> dtype:
    return dtype._register(
        name,
        is_int=False,
        is_floating_point=True,
        is_signed=True,
        is_complex=False,
        np_type=np_type,
        torch_type=torch_type,
    )


def _complex(name: str) -> dtype:
    return dtype._register(
        name,
        is_int=False,
        is_floating_point=False,
        is_signed=True,
        is_complex=True,
        np_type=np.dtype(name),
        torch_type=getattr(torch, name),
    )


bool = dtype._register(  # noqa: A001 -- PopXL's public name
    "bool",
    is_int=False,
    is_floating_point=False,
    is_signed=False,
    is_complex=False,
    np_type=np.dtype(np.bool_),
    torch_type=torch.bool,
)
int8 = _int("int8", True)
int16 = _int("int16", True)
int32 = _int("int32", True)
int64 = _int("int64", True)
uint8 = _int("uint8", False)
uint16 = _int("uint16", False)
uint32 = _int("uint32", False)
uint64 = _int("uint64", False)
float8_143 = _float("float8_143", np_dtype_float8_143, torch.float8_e4m3fn)
float8_152 = _float("float8_152", np_dtype_float8_152, torch.float8_e5m2)
bfloat16 = _float("bfloat16", np_dtype_bfloat16, torch.bfloat16)
float16 = _float("float16", np.dtype(np.float16), torch.float16)
float32 = _float("float32", np.dtype(np.float32), torch.float32)
float64 = _float("float64", np.dtype(np.float64), torch.float64)
complex64 = _complex("complex64")
complex128 = _complex("complex128")

half = float16
float = float32  # noqa: A001 -- PopXL's public name
double = float64

_FLOAT8 = (float8_143, float8_152)

# `to_numpy` takes an argument named `dtype`, which hides the class inside it.
_as_dtype = dtype.as_dtype


def dtype_of_numpy(np_dtype: Any) -> dtype:
    """The popxl dtype of host arrays with numpy dtype ``np_dtype`` (float8 structured included).

    Raises:
        ValueError: if ``np_dtype`` has no popxl counterpart (strings, objects, ...).
    """
    found = _lookup(np.dtype(np_dtype)) if np_dtype is not None else None
    if found is None:
        raise ValueError(
            f"numpy dtype {np_dtype!r} has no popxl counterpart. Host data must be bool, "
            f"(u)int8-64, float16/32/64, complex64/128, or a popxl float8 or bfloat16 "
            f"structured dtype."
        )
    return found


# ----------------------------------------------------------------------------------------
# Host-data conversion
# ----------------------------------------------------------------------------------------

# What `to_numpy` does to inferred 64-bit types when `downcast=True`.
_DOWNCAST = {
    np.dtype(np.int64): np.dtype(np.int32),
    np.dtype(np.uint64): np.dtype(np.uint32),
    np.dtype(np.float64): np.dtype(np.float32),
}

# Torch dtypes whose host arrays are structured views of their bits.
_TORCH_BITS_TO_NUMPY = {
    torch.float8_e4m3fn: np_dtype_float8_143,
    torch.float8_e5m2: np_dtype_float8_152,
    torch.bfloat16: np_dtype_bfloat16,
}
TORCH_BIT_DTYPES = frozenset(_TORCH_BITS_TO_NUMPY)
_BITS = {1: torch.uint8, 2: torch.int16}  # torch dtype of the raw bits, by itemsize

# Largest finite magnitude of each float8 format, and the smallest magnitude that rounds
# (to nearest, ties to even) past it; see Note [float8 encoding] for why these are OCP values.
# e4m3fn: max 448 = 1.110b*2^8 has an even mantissa, so the tie 464 rounds down to it.
# e5m2: max 57344 = 1.11b*2^15 has an odd mantissa, so the tie 61440 rounds up and overflows.
_FLOAT8_MAX = {float8_143: 448.0, float8_152: 57344.0}
_FLOAT8_OVERFLOWS = {float8_143: lambda a: a > 464.0, float8_152: lambda a: a >= 61440.0}

# Range PopART accepts for the float8 power-of-two scale.
_LOG2_SCALE_RANGE = range(-32, 32)


def to_numpy(
    data: Any,
    dtype: Any = None,  # noqa: A002 -- PopXL's argument name (shadows the class here)
    downcast: builtins.bool = True,
    log2_scale: int | None = None,
    nan_on_overflow: builtins.bool | None = None,
) -> np.ndarray:
    """Convert host data to a new C-contiguous numpy array, as PopXL does for
    ``variable``, ``constant`` and session inputs.

    Args:
        data: a numpy array, a torch tensor (detached, even if it requires grad), a Python
            scalar, or nested lists numpy can read.
        dtype: the popxl dtype (or anything ``dtype.as_dtype`` accepts) to cast to. If None,
            the type numpy infers is kept, except that with ``downcast=True`` int64, uint64
            and float64 become int32, uint32 and float32 (so ``1`` gives int32 and ``1.0``
            float32).
        downcast: see ``dtype``; ignored when ``dtype`` is given.
        log2_scale: float8 only: data is multiplied by ``2**log2_scale`` before the cast.
        nan_on_overflow: float8 only: values too large for the format become NaN (default)
            rather than saturating at the largest finite value.

    Returns:
        An array that never shares memory with ``data``.

    Raises:
        RuntimeError: if ``log2_scale`` or ``nan_on_overflow`` is given for a non-float8
            dtype, or the data cannot be converted to float8.
        TypeError: if the data has no popxl dtype (strings, objects, bfloat16 tensors, ...).
    """
    target = _as_dtype(dtype) if dtype is not None else None
    array = _as_host_array(data)

    if target in _FLOAT8:
        return _to_float8(array, target, log2_scale, nan_on_overflow)
    if array.dtype == np_dtype_bfloat16 and target not in (None, bfloat16):
        array = numpy_to_torch(array, bfloat16).float().numpy()  # decode the bits first

    for arg_name, value in (("log2_scale", log2_scale), ("nan_on_overflow", nan_on_overflow)):
        if value is not None:
            raise RuntimeError(
                f"{arg_name}={value!r} was given with dtype={target}, but {arg_name} is only "
                f"supported for popxl.float8_143 and popxl.float8_152. Leave it as None, or "
                f"pass a float8 dtype."
            )

    if target is bfloat16 and array.dtype != np_dtype_bfloat16:
        if array.dtype.kind not in "biuf":
            raise TypeError(f"Cannot convert data of numpy dtype {array.dtype} to bfloat16.")
        bf16 = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).bfloat16()
        return bf16.view(torch.int16).numpy().view(np_dtype_bfloat16)
    if target is not None:
        np_type = target.as_numpy()
    elif downcast:
        np_type = _DOWNCAST.get(array.dtype, array.dtype)
    else:
        np_type = array.dtype
    # One explicit copy: the caller may mutate `data` later and PopXL takes a snapshot.
    result = np.array(array, dtype=np_type, order="C", copy=True)
    if _lookup(result.dtype) is None:
        raise TypeError(
            f"Cannot use data of numpy dtype {result.dtype} (from {type(data).__name__}) as "
            f"popxl tensor data. Expected numbers or bools, or arrays/tensors of them."
        )
    return result


def _as_host_array(data: Any) -> np.ndarray:
    """View ``data`` as a numpy array without copying where possible."""
    if isinstance(data, torch.Tensor):
        tensor = data.detach().cpu().resolve_conj().resolve_neg()
        if tensor.dtype in _TORCH_BITS_TO_NUMPY:
            np_dt = _TORCH_BITS_TO_NUMPY[tensor.dtype]
            return tensor.view(_BITS[tensor.itemsize]).numpy().view(np_dt)
        if tensor.dtype not in _BY_TORCH:
            raise TypeError(
                f"torch tensors of dtype {tensor.dtype} have no popxl counterpart. Convert "
                f"first, for example with tensor.float()."
            )
        return tensor.numpy()
    return np.asarray(data)


def _to_float8(
    array: np.ndarray,
    target: dtype,
    log2_scale: int | None,
    nan_on_overflow: builtins.bool | None,
) -> np.ndarray:
    """Scale by ``2**log2_scale`` and round to ``target``; see Note [float8 encoding]."""
    if array.dtype == target.as_numpy():
        # Already encoded: PopXL passes such data through unscaled.
        return np.array(array, order="C", copy=True)
    if array.dtype.kind != "f":
        raise RuntimeError(
            f"Cannot convert data of numpy dtype {array.dtype} to {target}: float8 conversion "
            f"needs float16, float32 or float64 data. Cast the data to float32 first."
        )
    log2_scale = 0 if log2_scale is None else operator.index(log2_scale)
    if log2_scale not in _LOG2_SCALE_RANGE:
        raise RuntimeError(
            f"log2_scale={log2_scale} is out of range: it must be an int in [-32, 32)."
        )
    nan_on_overflow = True if nan_on_overflow is None else nan_on_overflow

    scaled = torch.from_numpy(np.array(array, dtype=np.float64, copy=True)) * 2.0**log2_scale
    # `scaled` is a fresh contiguous tensor, so this shares memory with nothing the caller has.
    f8 = round_to_float8(scaled, target, nan_on_overflow)
    return f8.view(torch.uint8).numpy().view(target.as_numpy())


def round_to_float8(scaled: torch.Tensor, target: dtype, nan_on_overflow: builtins.bool = True):
    """Already-scaled float data rounded to float8 ``target`` as PopXL rounds it, on the host
    and in the device's ``pow2scale_then_cast``: a value too large for the format becomes NaN,
    or with ``nan_on_overflow=False`` the largest finite value of its sign (torch's own
    conversion would saturate or give inf)."""
    fp8_max = _FLOAT8_MAX[target]
    if nan_on_overflow:
        scaled = torch.where(_FLOAT8_OVERFLOWS[target](scaled.abs()), torch.nan, scaled)
    else:
        scaled = scaled.clamp(-fp8_max, fp8_max)
    return scaled.to(target.as_torch())


def torch_to_numpy(t: torch.Tensor, dt: dtype, copy: builtins.bool = True) -> np.ndarray:
    """``t`` as a host array of popxl dtype ``dt`` (float8 and bfloat16 kept bitwise)."""
    t = t.detach().cpu()
    np_dt = dt.as_numpy()
    if np_dt.fields is not None:  # float8 / bfloat16: a structured view of the bits
        t = t.to(dt.as_torch())
        return t.view(_BITS[t.itemsize]).numpy().view(np_dt).copy()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.to(torch.int64).numpy().astype(np_dt)
    return t.numpy().astype(np_dt, copy=copy)


def numpy_to_torch(arr: np.ndarray, dt: dtype) -> torch.Tensor:
    """A host array as a new torch tensor of popxl dtype ``dt`` (the inverse of
    ``torch_to_numpy``: structured float8 / bfloat16 arrays are read as their bits)."""
    tdt = dt.as_torch()
    if arr.dtype.fields is not None:
        bits = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        return torch.from_numpy(bits.copy()).view(tdt).reshape(arr.shape)
    return torch.from_numpy(np.array(arr, copy=True, order="C")).to(tdt)


def itemsize(dt: dtype) -> int:
    """Bytes per element of popxl dtype ``dt`` (1 for a dtype torch cannot hold)."""
    tdt = dt.as_torch()
    return tdt.itemsize if tdt is not None else 1


def nbytes(shape, dt: dtype) -> int:
    """Bytes of a tensor of ``shape`` and popxl dtype ``dt``: the one byte count of the IR."""
    return math.prod(shape) * itemsize(dt)
