"""``dense_const_sparse_matmul``: ``lhs @ rhs`` with ``rhs`` a constant sparse matrix in CSR form.

On an IPU the CSR pattern is baked into a popsparse static plan; here the constant is expanded
to a dense matrix of ``lhs``'s dtype once, at build time, and multiplied as usual. The numbers
are those of the dense product of the matrix the CSR triplet describes. Upstream's op is meant
for inference and has no gradient op; here the gradient with respect to ``lhs`` is that of the
dense product.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .... import dtypes as _dtypes
from .... import ops
from ....errors import given
from ....ir.tensor import Tensor, constant

__all__ = ["dense_const_sparse_matmul", "random_sparse"]


def random_sparse(dense: np.ndarray, density: float = 0.5, seed: int | None = None) -> np.ndarray:
    """A copy of ``dense`` with each element kept with probability ``density`` (the others set to
    0); at least one element is kept. Unlike upstream (which zeroes ``dense`` in place with
    ``scipy.stats.bernoulli``) the input is left unchanged; ``seed`` makes the mask reproducible."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"random_sparse: density must be in [0, 1]; got {density}.")
    out = np.array(dense, copy=True)
    drop = np.random.default_rng(seed).random(out.shape) >= density
    if drop.all() and out.size:
        drop.reshape(-1)[0] = False
    out[drop] = 0
    return out


def _csr_to_dense(rhs: Any, output_cols: int) -> np.ndarray:
    try:
        data, indices, indptr = (np.asarray(rhs.data), np.asarray(rhs.indices),
                                 np.asarray(rhs.indptr))  # fmt: skip
    except AttributeError:
        raise TypeError(
            "dense_const_sparse_matmul: rhs must be a CSR matrix (e.g. scipy.sparse.csr_matrix) "
            f"with data, indices and indptr; got {given(rhs)}."
        ) from None
    rows = len(indptr) - 1
    if rows < 0 or len(data) != len(indices) or (len(indptr) and indptr[-1] != len(data)):
        raise ValueError(
            f"dense_const_sparse_matmul: inconsistent CSR arrays: {len(data)} values, "
            f"{len(indices)} column indices, indptr of length {len(indptr)} ending at "
            f"{indptr[-1] if len(indptr) else None}."
        )
    if len(indices) and (indices.min() < 0 or indices.max() >= output_cols):
        raise ValueError(
            f"dense_const_sparse_matmul: a column index is outside [0, output_cols={output_cols}); "
            f"got indices in [{indices.min()}, {indices.max()}]."
        )
    dense = np.zeros((rows, output_cols), np.float32)
    row_of = np.repeat(np.arange(rows), np.diff(indptr))
    # np.add.at: a CSR matrix may list one position twice; scipy sums duplicates too.
    np.add.at(dense, (row_of, indices), data.astype(np.float32))
    return dense


def dense_const_sparse_matmul(lhs: Tensor, rhs: Any, output_cols: int) -> Tensor:
    """``lhs [..., m, k] @ rhs [k, output_cols]`` for a constant CSR ``rhs`` (its values are
    cast to ``lhs``'s dtype, float16 or float32). A 3-D ``lhs`` must have a group axis of 1.

    Raises:
        TypeError: ``lhs`` is not float16/float32, or ``rhs`` has no CSR arrays.
        ValueError: the CSR arrays are inconsistent, or ``k`` does not match ``lhs``.
    """
    if not isinstance(lhs, Tensor):
        raise TypeError(f"dense_const_sparse_matmul expects a popxl Tensor; got {given(lhs)}.")
    if lhs.dtype not in (_dtypes.float16, _dtypes.float32):
        raise TypeError(
            f"dense_const_sparse_matmul: lhs must be float16 or float32; got {lhs.dtype.name}."
        )
    if len(lhs.shape) not in (2, 3) or (len(lhs.shape) == 3 and lhs.shape[0] != 1):
        raise ValueError(
            "dense_const_sparse_matmul: lhs must be [m, k] or [1, m, k] (groups other than 1 are "
            f"not supported); got {tuple(lhs.shape)}."
        )
    dense = _csr_to_dense(rhs, int(output_cols))
    if dense.shape[0] != lhs.shape[-1]:
        raise ValueError(
            f"dense_const_sparse_matmul: rhs has {dense.shape[0]} rows but lhs has "
            f"{lhs.shape[-1]} columns ({tuple(lhs.shape)})."
        )
    weight = constant(dense.astype(lhs.dtype.as_numpy()), lhs.dtype, "sparse_matmul_rhs")
    return ops.matmul(lhs, weight)
