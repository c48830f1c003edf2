"""Op definitions: the ``torch_popxl`` custom ops (collectives, remote memory, fused kernels),
their fake, vmap and autograd rules, and their per-replica reference semantics.

Sits on the IR and below capture (docs/architecture.md). Importing it loads the C++ extension.
"""

from . import collectives, compute, kernels, reference, registry, transfers
from .registry import Effect, MissingRuleError, OpDef, Traffic, lookup

__all__ = [
    "Effect",
    "MissingRuleError",
    "OpDef",
    "Traffic",
    "collectives",
    "compute",
    "kernels",
    "lookup",
    "reference",
    "registry",
    "transfers",
]
