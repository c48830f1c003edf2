"""The operator and method surface of popxl ``Tensor`` handles.

Note [tensor methods are installed from above]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``ir.Tensor`` is data: identity, spec, graph. Its operators (``a + b``, ``a @ b``, ``t[i]``),
PopXL methods (``transpose``, ``reshape``, ``copy_to_ipu``), ``__torch_function__`` and the
fallback to ``torch.Tensor`` methods record ops, which needs ``capture`` and ``ops``, layers
above the IR. They are defined here and installed onto ``ir.Tensor`` when ``torch_popxl`` is
imported (as JAX installs array methods onto its tracers), so the IR never imports upward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from . import capture, ops
from . import dtypes as _dtypes
from .ir.tensor import Tensor, _data_dependent, constant
from .ops._intsafe import int_safe, int_safe_inplace
from .ops.elementwise import _div
from .ops.indexing import _getitem

__all__ = ["install"]


def _this(self: _TensorMethods) -> Tensor:
    """``self`` as the ``Tensor`` it always is: ``install`` copies these methods onto Tensor."""
    return cast(Tensor, self)


class _TensorMethods:
    """Methods copied onto ``ir.Tensor`` by ``install`` (``self`` is always a ``Tensor``).

    For the type checker ``ir.Tensor`` derives from this class, so it knows the operators.
    """

    _id: str
    _dtype: _dtypes.dtype

    # ---- shape ops ------------------------------------------------------------------------

    @property
    def T(self) -> Tensor:
        return self.transpose()

    @property
    def T_(self) -> Tensor:
        return self.transpose_()

    def transpose(self, *permutation) -> Tensor:
        """PopXL ``transpose(permutation)``; torch-style ``transpose(dim0, dim1)`` also works.
        Either way a new tensor (Note [views of new tensors] in ir/views.py)."""
        if len(permutation) == 2 and all(isinstance(p, int) for p in permutation):
            rank = _this(self).rank
            perm = list(range(rank))
            a, b = (p % rank if rank else p for p in permutation)
            perm[a], perm[b] = perm[b], perm[a]
            permutation = (perm,)
        return ops.transpose(_this(self), permutation[0] if permutation else None)

    def transpose_(self, permutation=None) -> Tensor:
        return ops.transpose_(_this(self), permutation)

    def reshape(self, *shape) -> Tensor:
        """PopXL ``reshape(shape)``; torch-style ``reshape(d0, d1, ...)`` also works."""
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        return ops.reshape(_this(self), shape)

    def reshape_(self, shape) -> Tensor:
        return ops.reshape_(_this(self), shape)

    def flatten(self, *args) -> Tensor:
        """PopXL ``flatten()``; torch-style ``flatten(start_dim, end_dim)`` also works."""
        if args:
            return self._popxl_method("flatten", *args)
        return ops.flatten(_this(self))

    def flatten_(self) -> Tensor:
        """In-place flatten (aliases ``self`` where the layout allows; ``ops.reshape_``)."""
        return ops.flatten_(_this(self))

    def detach(self) -> Tensor:
        return ops.detach(_this(self))

    def diag(self) -> Tensor:
        if _this(self).rank != 2:
            raise ValueError(
                f"diag() needs a 2-D tensor; {self._id!r} has shape {_this(self).shape}."
            )
        return self._popxl_method("diagonal")

    def copy_to_ipu(self, destination: int, source: int | None = None) -> Tensor:
        return ops.ipu_copy(_this(self), destination, source)

    # ---- operators ------------------------------------------------------------------------

    def _coerce(self, other) -> Tensor:
        if isinstance(other, Tensor):
            return other
        if isinstance(other, np.ndarray | list | tuple) and np.asarray(other).size == 0:
            raise ValueError(f"Cannot combine tensor {self._id!r} with an empty value {other!r}.")
        return constant(other, self._dtype)

    def _binary(self, fn, other, reverse=False) -> Tensor:
        other = self._coerce(other)
        a, b = (other, self) if reverse else (self, other)
        return capture.call_torch(int_safe(fn), (a, b), {})

    def __add__(self, o) -> Tensor:
        return self._binary(torch.add, o)

    def __radd__(self, o) -> Tensor:
        return self._binary(torch.add, o, True)

    def __iadd__(self, o) -> Tensor:
        return capture.call_torch(int_safe_inplace(torch.Tensor.add_), (self, self._coerce(o)), {})

    def __sub__(self, o) -> Tensor:
        return self._binary(torch.sub, o)

    def __rsub__(self, o) -> Tensor:
        return self._binary(torch.sub, o, True)

    def __mul__(self, o) -> Tensor:
        return self._binary(torch.mul, o)

    def __rmul__(self, o) -> Tensor:
        return self._binary(torch.mul, o, True)

    def __truediv__(self, o) -> Tensor:
        return self._binary(_div, o)

    def __rtruediv__(self, o) -> Tensor:
        return self._binary(_div, o, True)

    def __mod__(self, o) -> Tensor:
        return self._binary(torch.fmod, o)

    def __rmod__(self, o) -> Tensor:
        return self._binary(torch.fmod, o, True)

    def __matmul__(self, o) -> Tensor:
        return self._binary(torch.matmul, o)

    def __rmatmul__(self, o) -> Tensor:
        return self._binary(torch.matmul, o, True)

    def __pow__(self, o) -> Tensor:
        return self._binary(torch.pow, o)

    def __rpow__(self, o) -> Tensor:
        return self._binary(torch.pow, o, True)

    def __and__(self, o) -> Tensor:
        return self._binary(torch.logical_and, o)

    def __rand__(self, o) -> Tensor:
        return self._binary(torch.logical_and, o, True)

    def __or__(self, o) -> Tensor:
        return self._binary(torch.logical_or, o)

    def __ror__(self, o) -> Tensor:
        return self._binary(torch.logical_or, o, True)

    # Comparisons record ops (torch.Tensor semantics) so `if t.sum() > 0:` reaches __bool__ and
    # fails with DataDependentError; `==` stays PopXL's identity test.
    def __gt__(self, o) -> Tensor:
        return self._binary(torch.gt, o)

    def __ge__(self, o) -> Tensor:
        return self._binary(torch.ge, o)

    def __lt__(self, o) -> Tensor:
        return self._binary(torch.lt, o)

    def __le__(self, o) -> Tensor:
        return self._binary(torch.le, o)

    def __invert__(self) -> Tensor:
        return capture.call_torch(torch.logical_not, (self,), {})

    def __neg__(self) -> Tensor:
        return capture.call_torch(torch.neg, (self,), {})

    def __getitem__(self, key) -> Tensor:
        return _getitem(_this(self), key)

    # ---- torch interop --------------------------------------------------------------------

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return capture.call_torch(func, args, kwargs or {})

    def _popxl_method(self, name, *args, **kwargs):
        """A PopXL method run as the torch method ``name``: its result is a new tensor where
        torch's is a view (Note [views of new tensors] in ir/views.py)."""
        return capture.call_torch(getattr(torch.Tensor, name), (self, *args), kwargs,
                                  new_tensors=True)  # fmt: skip

    # Hidden from the type checker, which would otherwise accept any attribute of a Tensor:
    # code that calls torch.Tensor methods on handles says so where it does.
    if not TYPE_CHECKING:

        def __getattr__(self, name: str):
            # Module code calls torch.Tensor methods on what it thinks is a torch tensor
            # (x.flatten(1), x.view(...), x.size(0)); route every such method through capture
            # instead of keeping a hand-written list.
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                raise AttributeError(name)
            if name in ("item", "tolist", "numpy"):
                raise _data_dependent(_this(self), f".{name}()")
            method = getattr(torch.Tensor, name, None)
            if method is None or not callable(method):
                raise AttributeError(f"popxl Tensor has no attribute {name!r}")

            def bound(*args, **kwargs):
                return capture.call_torch(method, (self, *args), kwargs)

            bound.__name__ = name
            return bound


def install() -> None:
    """Give ``ir.Tensor`` its operators and methods (idempotent)."""
    for name, value in vars(_TensorMethods).items():
        if name in (
            "__module__",
            "__qualname__",
            "__doc__",
            "__dict__",
            "__weakref__",
            "__annotations__",
            "__firstlineno__",
            "__static_attributes__",
        ):
            continue
        setattr(Tensor, name, value)
