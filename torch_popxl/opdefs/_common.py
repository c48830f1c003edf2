"""What every op stanza shares: the stacked ops' namespace, argument checks with the C++
kernels' wording, and the small layout helpers of the vmap rules.

Importing this module loads the C++ extension (``torch_popxl._C``), which defines the stacked
ops (``torch.ops.torch_popxl.*_stacked``) that the stanzas register fake and autograd rules on.

Two layers of ops live in the ``torch_popxl`` namespace:

* **Stacked ops** (C++, ``csrc/``, named ``<op>_stacked``): dim 0 of every tensor is the
  replica dim, of size R, so one call simulates all replicas at once.
* **Per-replica ops** (``torch.library.custom_op``, one per stanza, ``per_replica`` there):
  they describe ONE replica's view, which is what a captured PopXL program records. Running the per-replica program under
  ``torch.func.vmap`` over a leading replica dim turns each call into the stacked op: the vmap
  batch size *is* the replica count R (torch-techniques.md §3.1).

Outside vmap a per-replica op sees a single replica, so it only accepts ``group_size == 1``.
Limits that follow from how vmap dispatches custom ops:

* The replica dim is the vmap level that batches the op's inputs. Inside vmap an op whose
  inputs are all unbatched never reaches its vmap rule (torch runs the plain kernel), so it
  behaves as a single replica; batch such a value over replicas first.
* Under nested vmaps the innermost level that batches the inputs is taken as the replica dim.
* Gradients work with ``torch.autograd`` over a vmapped program. ``torch.func.grad`` combined
  with these ops (``vmap(grad(f))`` or ``grad(vmap(f))``) is rejected by torch ("must override
  the setup_context staticmethod"), a limitation of custom-op autograd under functorch.

Note [collective gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Gradients follow PopXL's autodiff rules (popxl.md §5), not the derivative of the stacked
function. PopXL treats each replica's incoming gradient as that replica's local contribution
and leaves any cross-replica sum to collectives the program calls explicitly (for example the
reduce-scatter of weight gradients in RTS training), and an op PopXL defines no gradient for
raises in backward. Each stanza's docstring states its op's rule (all_gather's gradient is
take_own, for example). The same rules are registered on the stacked ops, because ``torch.autograd`` over a vmapped
program records the stacked calls made by the vmap rules, not the per-replica ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import torch_popxl._C  # noqa: F401  (loading the library registers the stacked ops)
except ImportError as error:  # pragma: no cover - depends on the build state
    raise ImportError(
        "torch_popxl._C, the compiled runtime extension, could not be imported "
        f"({error}). Build it in place from the repository root with "
        "`pip install --no-build-isolation -e .` (MAX_JOBS=2 limits the compile jobs)."
    ) from error

from .reduce_ops import ARITHMETIC_OPS, NARROW_FLOATS, VALID_OPS, neutral, partial_form, reduce_op

__all__ = [
    "ARITHMETIC_OPS",
    "NARROW_FLOATS",
    "VALID_OPS",
    "check_grouping",
    "check_op",
    "check_stacked",
    "chunk",
    "no_explicit_rule",
    "no_gradient",
    "neutral",
    "ops",
    "partial_form",
    "require_single_replica",
    "save_grouping",
    "stacked",
]

ops = torch.ops.torch_popxl


def check_grouping(name: str, replicas, group_size: int, stride: int) -> None:
    """Raise ``ValueError`` unless ``(group_size, stride)`` tiles ``replicas`` (popxl.md §2.1).

    The same rule and wording as ``check_grouping`` in csrc/collective_common.h. Every
    shortcut that trusts a grouping (the full-group fast paths, the fused kernels) must run
    this first, so an invalid grouping is never silently treated as the whole replica set.
    """
    if group_size < 1 or stride < 1:
        raise ValueError(
            f"{name}: group_size and stride must be >= 1, got group_size={group_size}, "
            f"stride={stride}."
        )
    if group_size == 1:
        stride = 1
    if replicas < 1 or replicas % (group_size * stride) != 0:
        raise ValueError(
            f"{name}: the replica grouping (group_size={group_size}, stride={stride}) does not "
            f"tile R={replicas} replicas; R must be a positive multiple of "
            f"group_size*stride={group_size * stride}. Pick a group_size and stride whose "
            "product divides the replica count."
        )


def check_op(name: str, op: str, dtype: torch.dtype, allow_local: bool = False) -> None:
    """Raise unless ``op`` is a reduction (or ``'local'`` where allowed) valid for ``dtype``
    (Note [one reduction table] in reduce_ops.py)."""
    reduce_op(name, op, dtype, allow_local)


def check_stacked(name: str, x: Tensor) -> None:
    if x.dim() < 1:
        raise ValueError(
            f"{name}: expected a stacked tensor [R, ...] with the replica dim first, "
            "got a 0-d tensor."
        )


def chunk(numel, group_size: int):
    return (numel + group_size - 1) // group_size  # ceil(n / G), popxl.md §4.5


def require_single_replica(name: str, group_size: int) -> None:
    if group_size != 1:
        raise RuntimeError(
            f"{name}: called on a single replica (outside torch.func.vmap, or inside vmap with "
            f"no input batched over replicas) with group_size={group_size}. A collective over "
            f"{group_size} replicas needs every member's value: run the per-replica program "
            "under torch.func.vmap with the input batched over the replica dim (for a value "
            "that is the same on every replica use x.expand(R, *x.shape)), or use group_size=1."
        )


def stacked(x: Tensor, in_dim: int | None, batch_size: int) -> Tensor:
    """The physical tensor with the replica dim first; an unbatched input is the same value on
    every replica, so it is broadcast to all of them."""
    if in_dim is None:
        return x.expand(batch_size, *x.shape)
    return x.movedim(in_dim, 0)


def save_grouping(ctx, inputs, output):
    ctx.group_size, ctx.stride = inputs[-2], inputs[-1]


def no_gradient(name: str, op: str | None = None):
    detail = f" with op={op!r}" if op is not None else ""
    return RuntimeError(
        f"{name}{detail} has no gradient: PopXL defines no grad op for it (popxl.md §5). "
        "Detach its input, or compute the gradient before the collective."
    )


def no_explicit_rule(op, batched, num_replicas):
    """The ``explicit`` rule of an op that has no stacked form: always under ``vmap``."""
    return None
