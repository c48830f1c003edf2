"""``nn.Embedding(max_norm=...)`` in a compiled step.

Note [embedding rows renormalised]
    ``F.embedding(input, weight, max_norm=m)`` first renormalises, in place and without a
    gradient, every row of ``weight`` that ``input`` looks up whose ``norm_type``-norm is
    above ``m`` (``embedding_renorm_``: the row times ``m / (norm + 1e-7)``, the norm taken
    as a double), then looks the rows up; the gradient reaches the weight as a plain lookup's.
    Eager torch does it once per forward, on the global batch: after the step the weight
    holds the renormalised rows, moved by the optimizer. A compiled step runs the forward on
    ``R x GA`` micro-batches and keeps the weight as a variable its loop must not write. So
    (``EmbeddingRenorm``, a TorchFunctionMode while the forward is captured):

    * each micro-batch looks its rows up from the weight as the step began and renormalises
      the rows it got (``renormed``: eager's arithmetic, the same bits as the row's renorm),
      as the value of the lookup, with the lookup's own gradient (``renormed + (rows -
      rows.detach())``, which adds exactly 0);
    * it marks the rows it looked up (a vector over the embeddings, summed over micro-batches
      and replicas as a gradient is), and after the loop, before the optimizer reads the
      weight, the step renormalises every marked row once: the union of the global batch's
      rows, as eager's one renorm on the global batch.

    Eager's renorm is not idempotent in float32 (a renormalised row's norm may round above
    ``m``, and a second renorm moves it again), so a row must be renormalised once from the
    weight as the forward found it. That holds for one max-norm lookup of a weight per
    forward and no other read of it after that lookup; a second lookup or another read (a
    tied output projection) would need the rows of the whole global batch inside each
    micro-batch, and is refused, naming the read.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

__all__ = ["EmbeddingRenorm", "renormed"]

_EMBEDDING = inspect.signature(F.embedding)


def renormed(rows: torch.Tensor, max_norm: float, norm_type: float,
             marked: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``rows`` (the last dim a row) as ``embedding_renorm_`` leaves them: a row whose norm
    is above ``max_norm`` times ``max_norm / (norm + 1e-7)``, in double then the rows' dtype;
    only the ``marked`` ones (> 0, one per row) where given."""
    norm = torch.linalg.vector_norm(rows, norm_type, dim=-1, keepdim=True).double()
    # a true division (a number over a tensor is a reciprocal times it: another rounding)
    scale = torch.div(torch.full_like(norm, max_norm), norm + 1e-7).to(rows.dtype)
    over = norm > max_norm
    if marked is not None:
        over = over & (marked > 0).unsqueeze(-1)
    return torch.where(over, rows * scale, rows)


class EmbeddingRenorm(TorchFunctionMode):
    """Max-norm lookups as Note [embedding rows renormalised] has them; ``marked`` holds,
    per renormalised parameter, (its name, the rows looked up, max_norm, norm_type)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        super().__init__()
        self._names = {id(t): n for n, t in params.items()}
        self._keep = list(params.values())  # the ids above stay valid while these live
        self._renormed: dict[int, str] = {}  # id(weight) -> how it is named in errors
        self.marked: list[tuple[str, torch.Tensor, float, float]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            bound = _EMBEDDING.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.arguments["max_norm"] is not None:
                return self._lookup(func, **bound.arguments)
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and id(a) in self._renormed:
                raise self._refuse(getattr(func, "__name__", str(func)), self._renormed[id(a)])
        return func(*args, **kwargs)

    def _lookup(self, func, input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                sparse):  # fmt: skip
        name = self._names.get(id(weight))
        what = f"parameter {name!r}" if name is not None else "a computed weight"
        if id(weight) in self._renormed:
            raise self._refuse("a second F.embedding(max_norm=...)", what)
        rows = func(input, weight, padding_idx, None, norm_type, scale_grad_by_freq, sparse)
        with torch.no_grad():
            value = renormed(rows.detach(), float(max_norm), float(norm_type))
            if name is not None:
                flat = input.reshape(-1).long()
                seen = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
                self.marked.append(
                    (name, seen.index_fill(0, flat, 1.0), float(max_norm), float(norm_type))
                )
        self._renormed[id(weight)] = what
        self._keep.append(weight)
        return value + (rows - rows.detach())  # the lookup's gradient; adds exactly 0

    @staticmethod
    def _refuse(reader: str, what: str) -> ValueError:
        return ValueError(
            f"popxl.compile: {reader} reads the {what} after F.embedding(..., max_norm=...) "
            "renormalised its rows in this forward. The compiled step renormalises the rows "
            "the global batch looks up once, after its micro-batches ran (Note [embedding rows "
            "renormalised]); a later read in the forward would need every micro-batch to see "
            "the rows of the whole global batch renormalised. Read the weight before the "
            "lookup, or renormalise between steps (under torch.no_grad(): "
            "torch.embedding_renorm_(emb.weight, ids, max_norm, 2.0)) and use max_norm=None."
        )
