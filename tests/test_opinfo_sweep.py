"""PyTorch's OpInfo database at R=2 with different data per replica, against eager torch per
replica (tests/opinfo_sweep.py runs it; ``python tests/opinfo_sweep.py`` prints every case).

Claims: no op gives a wrong value; an op raises only for a reason listed below; the cases off
the fast path (ops torch has no batching rule for, which run once per replica, and fragments
that could not be traced and run under vmap at every step: ``session.explain()``) do not grow.
"""

from __future__ import annotations

import pytest
from opinfo_sweep import summary, sweep

pytest.importorskip("expecttest")  # torch.testing._internal imports it

# Why each of these ops cannot run as a PopXL program captured ahead of time:
_DATA_DEPENDENT_SHAPE = "its output shape depends on its input values (a static graph has none)"
_DATA_DEPENDENT_CHECK = "torch's implementation reads a tensor value in Python while capturing"
_NO_TORCH_BATCHING = "torch has no batching rule and no fallback for it under vmap"
ALLOWED_ERRORS = {
    "argwhere": _DATA_DEPENDENT_SHAPE,
    "nonzero": _DATA_DEPENDENT_SHAPE,
    "masked_select": _DATA_DEPENDENT_SHAPE,
    "unique": _DATA_DEPENDENT_SHAPE,
    "unique_consecutive": _DATA_DEPENDENT_SHAPE,
    "linalg.lstsq": _DATA_DEPENDENT_SHAPE,
    "linalg.lstsq.grad_oriented": _DATA_DEPENDENT_SHAPE,
    "nn.functional.ctc_loss": _DATA_DEPENDENT_SHAPE,
    "corrcoef": _DATA_DEPENDENT_CHECK,
    "cov": _DATA_DEPENDENT_CHECK,
    "narrow": _DATA_DEPENDENT_CHECK + " (a tensor start)",
    "tensor_split": _DATA_DEPENDENT_CHECK + " (tensor indices)",
    "nn.functional.gaussian_nll_loss": _DATA_DEPENDENT_CHECK + " (its variance check)",
    "_chunk_cat": _NO_TORCH_BATCHING,
    "histogramdd": _NO_TORCH_BATCHING,
    "nn.functional.rrelu": _NO_TORCH_BATCHING,
    "as_strided_scatter": _NO_TORCH_BATCHING,
    "index_put": _NO_TORCH_BATCHING + " (accumulate over a boolean mask index)",
    # Known gaps of this project, to fix (each names what fails):
    "quantile": "in-place ceil_ on a view flagged by the in-place ambiguity check",
    "nanquantile": "in-place ceil_ on a view flagged by the in-place ambiguity check",
    "nn.functional.feature_alpha_dropout.with_train": "in-place mul_ flagged as ambiguous",
    "linalg.pinv.singular": "a zero-size stacked reshape",
    "masked_fill": "a per-replica 0-d fill value under vmap",
    "resize_": "resize_ recorded as a clone that changes shape",
    "slice": "slice without start/end",
}
# Cases off the fast path today (of ~1,175 tested); the number may only shrink.
SLOW_CEILING = 68


@pytest.fixture(scope="module")
def results():
    return sweep()


def test_no_op_gives_a_wrong_value(results):
    wrong = [f"{o.op}[{o.sample}]: {o.detail}" for o in results if o.kind == "wrong"]
    assert not wrong, "\n".join(wrong)


def test_ops_raise_only_for_a_listed_reason(results):
    unexpected = [f"{o.op}[{o.sample}]: {o.detail}" for o in results
                  if o.kind == "error" and o.op not in ALLOWED_ERRORS]  # fmt: skip
    assert not unexpected, "\n".join(unexpected)


def test_the_sweep_covers_the_database_and_the_slow_path_does_not_grow(results):
    counts = summary(results)
    assert len({o.op for o in results}) > 500
    assert counts.get("pass", 0) > 1050
    assert counts.get("slow", 0) <= SLOW_CEILING, counts
