"""``AdamOptimizerStep``: one Adam/AdamW update of one variable (spec addons §9).

State (all by-ref graph inputs): ``first_order`` (float16 by default, as upstream),
``second_order`` (float32) and, with bias correction, ``step`` (float32, incremented before
use). Sharded variables get sharded state of the same layout. Per call, with ``g`` the
gradient divided by ``loss_scaling`` and, with ``global_norm``, multiplied by
``global_norm_max / max(global_norm, global_norm_max)``:

    m = beta1 * m + (1 - beta1) * g            v = beta2 * v + (1 - beta2) * g**2
    t += 1;  m_hat = m / (1 - beta1**t);  v_hat = v / (1 - beta2**t)   (bias correction)
    w -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w)        (decoupled, AdamW)
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from ... import dtypes as _dtypes
from ... import ops
from ...ir.context import in_sequence
from ...ir.replica_grouping import ReplicaGrouping
from ...ir.tensor import Tensor, TensorByRef, constant
from ..module import Module

__all__ = ["AdamOptimizerStep"]


class AdamOptimizerStep(Module):
    """Adam step for ``var`` given ``grad``; build with ``create_graph(var.spec, grad.spec, lr=...)``."""

    @in_sequence()
    def build(self, var: TensorByRef, grad: Tensor, replica_grouping: ReplicaGrouping | None = None, *,
              lr: float | Tensor, beta1: float | Tensor = 0.9, beta2: float | Tensor = 0.999,
              eps: float | Tensor = 1e-5, weight_decay: float | Tensor = 1e-2,
              first_order_dtype: _dtypes.dtype = _dtypes.float16, bias_correction: bool = True,
              loss_scaling: float | Tensor = 1, global_norm: Tensor | None = None,
              global_norm_max: float | Tensor | None = None) -> None:  # fmt: skip
        if global_norm is not None and global_norm_max is None:
            raise ValueError(
                "AdamOptimizerStep: global_norm is given without global_norm_max; pass the norm "
                "to clip to as global_norm_max (upstream requires both)."
            )
        grad = self._scaled_grad(grad, loss_scaling, global_norm, global_norm_max)
        first_order = self._state("first_order", var, first_order_dtype, replica_grouping)
        second_order = self._state("second_order", var, _dtypes.float32, replica_grouping)
        ops.var_updates.accumulate_moving_average_(first_order, grad, f=beta1)
        ops.var_updates.accumulate_moving_average_square_(second_order, grad, f=beta2)
        step = None
        if bias_correction:
            step = self.add_variable_input(
                "step", partial(np.zeros, ()), _dtypes.float32, by_ref=True
            )
        updater = ops.var_updates.adam_updater(first_order, second_order, weight=var, weight_decay=weight_decay,
                                               time_step=step, beta1=beta1, beta2=beta2, epsilon=eps)  # fmt: skip
        ops.var_updates.scaled_add_(var, updater, b=_neg(lr))

    @staticmethod
    def _scaled_grad(grad: Tensor, loss_scaling, global_norm, global_norm_max) -> Tensor:
        scale: float | Tensor = 1.0
        if isinstance(loss_scaling, Tensor) or float(loss_scaling) != 1.0:
            scale = (
                1.0 / loss_scaling
                if not isinstance(loss_scaling, Tensor)
                else 1.0 / ops.cast(loss_scaling, _dtypes.float32)
            )
        if global_norm is not None:
            gmax = global_norm_max
            gmax_t = gmax if isinstance(gmax, Tensor) else constant(float(gmax), _dtypes.float32)
            scale = scale * (gmax_t / ops.maximum(ops.cast(global_norm, _dtypes.float32), gmax_t))
        if isinstance(scale, Tensor) or scale != 1.0:
            grad = ops.cast(grad, _dtypes.float32) * scale
        return grad

    def _state(self, name: str, var: Tensor, dtype, replica_grouping) -> Tensor:
        if var.meta_shape:
            return self.add_replica_sharded_variable_input(
                name,
                partial(np.zeros, var.meta_shape),
                dtype,
                by_ref=True,
                replica_grouping=replica_grouping,
                shard_over=math.prod(var.meta_shape) // math.prod(var.shape),
            )
        return self.add_variable_input(name, partial(np.zeros, var.shape), dtype, by_ref=True,
                                       replica_grouping=replica_grouping)  # fmt: skip


def _neg(lr: float | Tensor) -> float | Tensor:
    return -lr if not isinstance(lr, Tensor) else ops.neg(lr)
