"""Note [operands a stacked rule needs with rows]: every stacked rule with more than one tensor
operand, given each operand in turn stored once (a replica-invariant variable) while the others
are per replica, runs stacked (no vmap) and equals the op run per replica in eager torch.

Claims: ``test_stacked_rules_match_eager_with_each_operand_stored_once`` (values, per replica,
float32 at rtol/atol 1e-5: the stacked calls may sum in another order);
``test_every_rule_that_reads_rows_has_a_case`` (a rule declared later gets a case or fails).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import torch_popxl as popxl
from torch_popxl import capture, ops
from torch_popxl import dtypes as _dt
from torch_popxl.runtime import explicit

aten = torch.ops.aten
R = 2


@dataclass(frozen=True)
class Case:
    """``fn`` over tensor operands; ``make(r)`` gives replica ``r``'s operands. Operands in
    ``shared`` are always stored once (the rule takes them only so)."""

    name: str
    target: Any  # the op whose stacked rule the case exercises
    fn: Any
    make: Any
    shared: frozenset[int] = field(default_factory=frozenset)
    also: tuple = ()  # other ops in ``fn`` that must run stacked too


def _gen(r: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + r)


def _randn(g, *shape):
    return torch.randn(shape, generator=g)


def _ints(g, high, *shape):
    return torch.randint(0, high, shape, generator=g)


def _bn_backward(g, x, w):
    _, mean, invstd = aten.native_batch_norm(x, w, None, None, None, True, 0.1, 1e-5)
    return aten.native_batch_norm_backward(g, x, w, None, None, mean, invstd, True, 1e-5,
                                           [True, True, True])  # fmt: skip


def _ln_backward(g, x, w, b):
    _, mean, rstd = aten.native_layer_norm(x, [5], w, b, 1e-5)
    return aten.native_layer_norm_backward(g, x, [5], mean, rstd, w, b, [True, True, True])


def _ln_backward_bias_only(g, x, b):
    _, mean, rstd = aten.native_layer_norm(x, [5], None, b, 1e-5)
    return aten.native_layer_norm_backward(g, x, [5], mean, rstd, None, b, [True, False, True])


def _nll_backward(reduction):
    def fn(g, x, t):
        _, total = aten.nll_loss_forward(x, t, None, reduction, -100)
        return aten.nll_loss_backward(g, x, t, None, reduction, -100, total)

    return fn


def _attention_backward(g, q, k, v):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0,
                                                                     False)  # fmt: skip


def _max_pool_backward(g, x):
    _, idx = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    return aten.max_pool2d_with_indices_backward(g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)


_CONV = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)  # stride, padding, dilation, ..., groups

CASES = [
    Case("gather", aten.gather.default, lambda x, i: aten.gather(x, 1, i),
         lambda r: (_randn(_gen(r), 4, 5), _ints(_gen(r), 5, 4, 2))),
    Case("scatter_add", aten.scatter_add.default, lambda x, i, s: aten.scatter_add(x, 1, i, s),
         lambda r: (_randn(_gen(r), 4, 5), _ints(_gen(r), 5, 4, 2), _randn(_gen(r + 9), 4, 2))),
    Case("softmax_backward", aten._softmax_backward_data.default,
         lambda g, y: aten._softmax_backward_data(g, y, 1, torch.float32),
         lambda r: (_randn(_gen(r), 4, 5), _randn(_gen(r + 9), 4, 5).softmax(1))),
    Case("log_softmax_backward", aten._log_softmax_backward_data.default,
         lambda g, y: aten._log_softmax_backward_data(g, y, 1, torch.float32),
         lambda r: (_randn(_gen(r), 4, 5), _randn(_gen(r + 9), 4, 5).log_softmax(1))),
    Case("max_pool_backward", aten.max_pool2d_with_indices_backward.default, _max_pool_backward,
         lambda r: (_randn(_gen(r), 2, 3, 2, 2), _randn(_gen(r + 9), 2, 3, 4, 4)),
         also=(aten.max_pool2d_with_indices.default,)),
    Case("adaptive_avg_pool_backward", aten._adaptive_avg_pool2d_backward.default,
         lambda g, x: aten._adaptive_avg_pool2d_backward(g, x),
         lambda r: (_randn(_gen(r), 2, 3, 2, 2), _randn(_gen(r + 9), 2, 3, 4, 4))),
    Case("avg_pool_backward", aten.avg_pool2d_backward.default,
         lambda g, x: aten.avg_pool2d_backward(g, x, [2, 2], [2, 2], [0, 0], False, True, None),
         lambda r: (_randn(_gen(r), 3, 2, 2), _randn(_gen(r + 9), 3, 4, 4))),
    Case("index_select", aten.index_select.default, lambda x, i: aten.index_select(x, 1, i),
         lambda r: (_randn(_gen(r), 4, 5), _ints(_gen(r), 5, 3)), shared=frozenset({1})),
    Case("index_copy", aten.index_copy.default, lambda x, i, s: aten.index_copy(x, 1, i, s),
         lambda r: (_randn(_gen(r), 4, 5), torch.tensor([3, 0]), _randn(_gen(r + 9), 4, 2)),
         shared=frozenset({1})),
    Case("index_add", aten.index_add.default, lambda x, i, s: aten.index_add(x, 0, i, s),
         lambda r: (_randn(_gen(r), 4, 5), torch.tensor([1, 1, 2]), _randn(_gen(r + 9), 3, 5)),
         shared=frozenset({1})),
    Case("nll_loss_forward", aten.nll_loss_forward.default,
         lambda x, t: aten.nll_loss_forward(x, t, None, 1, -100),
         lambda r: (_randn(_gen(r), 4, 5).log_softmax(1), _ints(_gen(r), 5, 4))),
    *[Case(f"nll_loss_backward_{red}", aten.nll_loss_backward.default, _nll_backward(red),
           lambda r: (_randn(_gen(r)), _randn(_gen(r + 9), 4, 5).log_softmax(1),
                      _ints(_gen(r), 5, 4)),
           also=(aten.nll_loss_forward.default,)) for red in (1, 2)],
    Case("convolution", aten.convolution.default,
         lambda x, w, b: aten.convolution(x, w, b, *_CONV),
         lambda r: (_randn(_gen(r), 2, 3, 5, 5), _randn(_gen(7), 4, 3, 3, 3), _randn(_gen(8), 4)),
         shared=frozenset({1, 2})),
    Case("convolution_backward", aten.convolution_backward.default,
         lambda g, x, w: aten.convolution_backward(g, x, w, [4], *_CONV, [True, True, True]),
         lambda r: (_randn(_gen(r), 2, 4, 5, 5), _randn(_gen(r + 9), 2, 3, 5, 5),
                    _randn(_gen(7), 4, 3, 3, 3)), shared=frozenset({2})),
    Case("batch_norm", aten.native_batch_norm.default,
         lambda x, w, b: aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5),
         lambda r: (_randn(_gen(r), 4, 3, 2, 2), _randn(_gen(r + 9), 3), _randn(_gen(r + 5), 3)),
         ),
    Case("batch_norm_backward", aten.native_batch_norm_backward.default, _bn_backward,
         lambda r: (_randn(_gen(r), 4, 3, 2, 2), _randn(_gen(r + 9), 4, 3, 2, 2),
                    _randn(_gen(r + 5), 3)), also=(aten.native_batch_norm.default,)),
    Case("batch_norm_backward_rows", aten.native_batch_norm_backward.default, _bn_backward,
         lambda r: (_randn(_gen(r), 2, 16, 32, 32), _randn(_gen(r + 9), 2, 16, 32, 32),
                    _randn(_gen(r + 5), 16)), also=(aten.native_batch_norm.default,)),
    Case("layer_norm", aten.native_layer_norm.default,
         lambda x, w, b: aten.native_layer_norm(x, [5], w, b, 1e-5),
         lambda r: (_randn(_gen(r), 3, 5), _randn(_gen(r + 9), 5), _randn(_gen(r + 5), 5))),
    Case("layer_norm_backward", aten.native_layer_norm_backward.default, _ln_backward,
         lambda r: (_randn(_gen(r), 3, 5), _randn(_gen(r + 9), 3, 5), _randn(_gen(r + 5), 5),
                    _randn(_gen(r + 6), 5)), also=(aten.native_layer_norm.default,)),
    Case("layer_norm_backward_bias_only", aten.native_layer_norm_backward.default,
         _ln_backward_bias_only,
         lambda r: (_randn(_gen(r), 3, 5), _randn(_gen(r + 9), 3, 5), _randn(_gen(r + 5), 5)),
         also=(aten.native_layer_norm.default,)),
    *[Case(f"embedding_dense_backward_{pad}", aten.embedding_dense_backward.default,
           lambda g, i, pad=pad: aten.embedding_dense_backward(g, i, 7, pad, False),
           lambda r: (_randn(_gen(r), 2, 3, 4), _ints(_gen(r), 7, 2, 3))) for pad in (-1, 2)],
    Case("cat", aten.cat.default, lambda a, b: aten.cat([a, b], 1),
         lambda r: (_randn(_gen(r), 2, 3), _randn(_gen(r + 9), 2, 4))),
    Case("stack", aten.stack.default, lambda a, b: aten.stack([a, b], -1),
         lambda r: (_randn(_gen(r), 2, 3), _randn(_gen(r + 9), 2, 3))),
    Case("attention", aten._scaled_dot_product_flash_attention_for_cpu.default,
         lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v),
         lambda r: tuple(_randn(_gen(r + 9 * i), 1, 2, 3, 4) for i in range(3))),
    Case("attention_backward", aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
         _attention_backward, lambda r: tuple(_randn(_gen(r + 9 * i), 1, 2, 3, 4) for i in range(4)),
         also=(aten._scaled_dot_product_flash_attention_for_cpu.default,)),
    # rules that take an operand stored once as it is
    Case("mm", aten.mm.default, lambda a, b: aten.mm(a, b),
         lambda r: (_randn(_gen(r), 3, 4), _randn(_gen(r + 9), 4, 2))),
    Case("addmm", aten.addmm.default, lambda c, a, b: aten.addmm(c, a, b),
         lambda r: (_randn(_gen(r + 5), 2), _randn(_gen(r), 3, 4), _randn(_gen(r + 9), 4, 2))),
    Case("bmm", aten.bmm.default, lambda a, b: aten.bmm(a, b),
         lambda r: (_randn(_gen(r), 2, 3, 4), _randn(_gen(r + 9), 2, 4, 2))),
    Case("embedding", aten.embedding.default, lambda w, i: aten.embedding(w, i),
         lambda r: (_randn(_gen(7), 6, 3), _ints(_gen(r), 6, 2, 4)), shared=frozenset({0})),
    Case("where", aten.where.self, lambda c, a, b: aten.where(c, a, b),
         lambda r: (_randn(_gen(r + 5), 3, 4) > 0, _randn(_gen(r), 3, 4), _randn(_gen(r + 9), 4))),
]  # fmt: skip


def _configs(case: Case, n: int) -> list[frozenset[int]]:
    """The operand sets stored once: only the shared ones, then each other one in turn
    (while some operand stays per replica)."""
    free = [k for k in range(n) if k not in case.shared]
    configs = [frozenset(case.shared)]
    if len(free) > 1:
        configs += [case.shared | {k} for k in free]
    return configs


def _run(case: Case, once: frozenset[int]):
    values = [case.make(r) for r in range(R)]
    ir = popxl.Ir(replication=R)
    streams = {}
    with ir.main_graph:
        handles = []
        for k, v in enumerate(values[0]):
            if k in once:
                handles.append(popxl.variable(v.numpy(), _dt.dtype.as_dtype(v.dtype), f"v{k}"))
            else:
                streams[k] = popxl.h2d_stream(tuple(v.shape), _dt.dtype.as_dtype(v.dtype), f"in{k}")
                handles.append(ops.host_load(streams[k]))
        outs = []
        for y in pytree.tree_flatten(capture.call_torch(case.fn, tuple(handles), {}))[0]:
            if y is not None:
                outs.append(popxl.d2h_stream(y.shape, y.dtype))
                ops.host_store(outs[-1], y)
    feed = {streams[k]: np.stack([values[r][k].numpy() for r in range(R)]) for k in streams}
    session = popxl.Session(ir, "ipu_model")
    fn = session._executor.fns["normal"]
    with session:
        got = session.run(feed)
    for r in range(R):
        args = [values[0][k] if k in once else values[r][k] for k in range(len(values[0]))]
        want = [y for y in pytree.tree_flatten(case.fn(*args))[0] if y is not None]
        assert len(want) == len(outs)
        for i, (w, st) in enumerate(zip(want, outs, strict=True)):
            g = got[st].reshape(R, *w.shape)[r]
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{case.name}, output {i}, replica {r}")  # fmt: skip
    return fn


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_stacked_rules_match_eager_with_each_operand_stored_once(case):
    n = len(case.make(0))
    for once in _configs(case, n):
        fn = _run(case, once)
        assert fn.explicit, (
            f"{case.name} with operands {sorted(once)} stored once: {fn.vmap_reason}"
        )
        vmapped = {str(t) for t in (case.target, *case.also)} & set(fn.vmapped_ops)
        assert not vmapped, f"{case.name} with operands {sorted(once)} stored once: {vmapped}"


def _reads_several_tensors(target) -> bool:
    types = [str(a.type) for a in target._schema.arguments]
    return sum(t.startswith("Tensor") for t in types) > 1 or "Tensor[]" in types


def test_every_rule_that_reads_rows_has_a_case():
    declared = {
        t for t in explicit._ROWS if _reads_several_tensors(t) and not explicit.is_random(t)
    }
    covered = {c.target for c in CASES}
    assert not declared - covered, sorted(map(str, declared - covered))
