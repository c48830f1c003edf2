"""The simulator's dense matmul, ``gemm(a, b, bias=None)`` = ``a [..., K] @ b [K, N] (+ bias)``,
and the process-wide choice of the kernel behind it (Note [gemm kernel] in ``csrc/gemm.cpp``).

The fast executor's generated code runs every matmul with a replica-invariant right operand
through it (a layer's forward, its input gradient, a weight gradient folded over replicas and
micro-batches). Two kernels: ``"aten"`` (torch's own matmul: MKL on CPU) and ``"onednn"``
(oneDNN, which torch ships). Both are float32 GEMMs and differ only in rounding (the order in
which they add the K products); ``"onednn"`` runs 2-2.5x faster where MKL does not use the
processor's AVX-512 units (AMD Zen 4/5). The default comes from a fixed rule, never from
timing, so a program computes the same bits on every run and in every process of a launch:

* ``$TORCH_POPXL_GEMM`` (``aten`` or ``onednn``) when set;
* else ``"onednn"`` where torch has oneDNN, the CPU runs AVX-512 code and is not Intel's (on
  Intel's MKL takes AVX-512 itself and ATen's matmul is as fast); ``"aten"`` elsewhere.

``set_kernel``/``kernel``/``using`` change and read the choice; ``using("aten")`` gives torch's
matmul bits exactly (what ``tests/test_compile_optimizer_exact.py`` checks against eager torch).
Calls that are not CPU float32, that autograd records, or that are too small for oneDNN to
pay run ATen's kernel under either choice.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch
from torch import Tensor

from ..opdefs._common import ops

__all__ = [
    "ATEN_FORMS",
    "KERNELS",
    "addmm",
    "default_kernel",
    "gemm",
    "gemm_out_",
    "kernel",
    "set_kernel",
    "using",
]

KERNELS = ("aten", "onednn")  # index = the C++ kernel id
_GEMM = ops.gemm.default  # the overload itself: no resolution per call on the hot path
_GEMM_OUT = ops.gemm_out_.default
ENV = "TORCH_POPXL_GEMM"


def gemm(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b (+ bias)`` for ``a [..., K]``, ``b [K, N]``, ``bias [N]``, through the chosen
    kernel."""
    return _GEMM(a, b, bias)


def gemm_out_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``a [M, K] @ b [K, N]`` written into ``out [M, N]`` (the bits of ``gemm(a, b)``);
    returns ``out``. (The op itself returns nothing: torch.compile takes a mutating custom op
    only without an aliased output.)"""
    _GEMM_OUT(out, a, b)
    return out


def addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    """``torch.addmm``, through ``gemm`` when it is ``a @ b + bias`` with a vector bias."""
    if beta == 1 and alpha == 1 and bias.dim() == 1 and a.dim() == 2:
        return _GEMM(a, b, bias)
    return torch.addmm(bias, a, b, beta=beta, alpha=alpha)


# the aten matmuls whose calls the generated code routes through ``gemm``
ATEN_FORMS = {torch.ops.aten.mm.default: gemm, torch.ops.aten.addmm.default: addmm}


@torch.library.register_fake("torch_popxl::gemm")
def _(a, b, bias=None):
    return a.new_empty((*a.shape[:-1], b.shape[1]))


@torch.library.register_fake("torch_popxl::gemm_out_")
def _(out, a, b):
    return None


@torch.library.register_vmap("torch_popxl::gemm")
def _(info, in_dims, a, b, bias=None):
    """``gemm`` under ``vmap`` (a fragment on the per-replica path): per row ``a_r @ b_r +
    bias_r``. With only ``a`` batched the rows are more rows of one GEMM; otherwise a batched
    matmul over the rows."""
    a_dim, b_dim = in_dims[:2]
    bias_dim = in_dims[2] if len(in_dims) > 2 else None  # bias not passed: two dims only
    if a_dim is not None:
        a = a.movedim(a_dim, 0)
    if b_dim is None and bias_dim is None:
        return _GEMM(a, b, bias), 0 if a_dim is not None else None
    rows = info.batch_size
    if a_dim is None:
        a = a.expand(rows, *a.shape)
    b = b.movedim(b_dim, 0) if b_dim is not None else b.expand(rows, *b.shape)
    m = math.prod(a.shape[1:-1])  # not -1: ambiguous when K is 0
    out = torch.matmul(a.reshape(rows, m, a.shape[-1]), b).view(*a.shape[:-1], b.shape[-1])
    if bias is not None:
        bias = bias.movedim(bias_dim, 0) if bias_dim is not None else bias.expand(rows, *bias.shape)
        out = out + bias.view(rows, *([1] * (out.dim() - 2)), -1)
    return out, 0


def _cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...), or "" if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def default_kernel() -> str:
    """The kernel a process starts with (the rule in this module's docstring)."""
    env = os.environ.get(ENV, "").strip().lower()
    if env:
        if env not in KERNELS:
            raise ValueError(f"${ENV}={env!r}: expected one of {', '.join(KERNELS)}.")
        return env
    fast = (
        torch.backends.mkldnn.is_available()
        and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        and _cpu_vendor() not in ("GenuineIntel", "")
    )
    return "onednn" if fast else "aten"


def set_kernel(name: str) -> None:
    """Run the simulator's matmuls with ``name`` ("aten" or "onednn") from now on (the whole
    process; a step already running finishes with its kernel)."""
    if name not in KERNELS:
        raise ValueError(f"set_kernel: expected one of {', '.join(KERNELS)}, got {name!r}.")
    if name == "onednn" and not torch.backends.mkldnn.is_available():
        raise RuntimeError("set_kernel('onednn'): this torch build has no oneDNN (mkldnn).")
    ops.gemm_set_kernel(KERNELS.index(name))


def kernel() -> str:
    """The kernel the simulator's matmuls use now."""
    return KERNELS[ops.gemm_kernel()]


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    """Run the simulator's matmuls with ``name`` inside the block, then restore the choice."""
    before = kernel()
    set_kernel(name)
    try:
        yield
    finally:
        set_kernel(before)


set_kernel(default_kernel())
