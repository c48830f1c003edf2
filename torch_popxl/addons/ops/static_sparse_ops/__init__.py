"""Static sparse ops of popxl-addons: dense x constant-sparse matmul for inference."""

from .dense_sparse_matmul import dense_const_sparse_matmul, random_sparse

__all__ = ["dense_const_sparse_matmul", "random_sparse"]
