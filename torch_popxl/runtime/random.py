"""Dropout masks for the generated code: ``aten.bernoulli_.float`` on a CPU tensor runs the
counter-based kernel ``torch_popxl::bernoulli_p_`` (Note [counter-based bernoulli] in
``csrc/random.cpp``): one seed from torch's default CPU generator per call, so
``torch.manual_seed`` still makes a run repeatable, and ~10x faster than ATen's per-element
draws. Its values are not ATen's; the distribution is (tests/test_random_replicas.py)."""

from __future__ import annotations

import torch
from torch._C._functorch import is_batchedtensor

from ..opdefs._common import ops

__all__ = ["RANDOM_FORMS", "bernoulli_"]

_KERNEL = ops.bernoulli_p_.default


@torch.library.register_fake("torch_popxl::bernoulli_p_")
def _(self, p):
    return self


def bernoulli_(self: torch.Tensor, p: float = 0.5, *, generator=None) -> torch.Tensor:
    """``self.bernoulli_(p)``: through the counter-based kernel for a CPU tensor drawn from the
    default generator, through ATen otherwise (a given generator, another device, a value
    batched by ``vmap``)."""
    if generator is not None or self.device.type != "cpu" or is_batchedtensor(self):
        return torch.ops.aten.bernoulli_.float(self, p, generator=generator)
    return _KERNEL(self, p)


# the aten random ops whose calls the generated code routes through these forms
RANDOM_FORMS = {torch.ops.aten.bernoulli_.float: bernoulli_}
