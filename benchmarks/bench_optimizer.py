"""Adam over the MNIST MLP's parameters: per-parameter chains, torch._foreach_*, fused kernel.

What multi-tensor optimizer updates could gain on the CPU it runs on: one
Adam step over the parameters of the 784-512-512-512-10 MLP (8 tensors, 0.93 M values),

* ``chain``: one in-place op after another per parameter, as the generated step runs it
  after Note [update in place] (torch's single-tensor Adam does the same);
* ``foreach``: the same arithmetic as ``torch._foreach_*`` calls over all parameters (torch's
  ``foreach=True`` path);
* ``fused``: ``torch._fused_adam_`` over all parameters (torch's ``fused=True`` path; one pass
  over each tensor).

Timed interleaved; prints ms per step, median (min-max), and each against ``chain``. On CPU the
``_foreach_*`` kernels loop over the tensors one op at a time, so they save only Python
dispatch; only the fused kernel saves memory passes, and it rounds differently from the
single-tensor update (its results differ from eager's default Adam in the last bits).

Then the whole compiled MNIST MLP step (R=4, GA=8, micro-batch 8) with ``Adam(fused=False)`` (the
per-parameter chain) and ``Adam(fused=True)`` (one fused kernel call, Note [fused optimizer
updates] in compile.py), on-chip and with sharded off-chip state (``rts_threshold=512,
optimizer_state="remote"``, as bench_compile.py: the fused call then runs over the stacked
shards, Note [per-element list ops] in runtime/explicit.py), and eager torch's same schedule
with ``fused=True``, all timed interleaved.

Usage: ``python benchmarks/bench_optimizer.py [rounds] [compiled rounds]``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import seed  # noqa: E402
from timing import describe, interleaved_samples, ratio, rounds_cli  # noqa: E402

SHAPES = [(784, 512), (512,), (512, 512), (512,), (512, 512), (512,), (512, 10), (10,)]
LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8


def main(rounds: int = 30) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    avgs = [torch.zeros(s) for s in SHAPES]
    sqs = [torch.zeros(s) for s in SHAPES]
    steps = [torch.tensor(3.0) for _ in SHAPES]
    step_size, bc2_sqrt = LR / (1 - BETA1**3), (1 - BETA2**3) ** 0.5

    def chain():
        for p, g, m, v in zip(params, grads, avgs, sqs, strict=True):
            m.lerp_(g, 1 - BETA1)
            v.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
            denom = v.sqrt().div_(bc2_sqrt).add_(EPS)
            p.addcdiv_(m, denom, value=-step_size)

    def foreach():
        torch._foreach_lerp_(avgs, grads, 1 - BETA1)
        torch._foreach_mul_(sqs, BETA2)
        torch._foreach_addcmul_(sqs, grads, grads, 1 - BETA2)
        denom = torch._foreach_sqrt(sqs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, EPS)
        torch._foreach_addcdiv_(params, avgs, denom, -step_size)

    def fused():
        torch._fused_adam_(params, grads, avgs, sqs, [], steps, lr=LR, beta1=BETA1, beta2=BETA2,
                           weight_decay=0.0, eps=EPS, amsgrad=False, maximize=False)  # fmt: skip

    fns = {"chain": chain, "foreach": foreach, "fused": fused}
    s = interleaved_samples(fns, rounds)
    print("Adam step over the MNIST MLP's 8 parameters (0.93 M values), median (min-max):")
    for name in fns:
        print(f"  {name:<8} {describe(s[name])}; chain / {name} {ratio(s['chain'], s[name])}")
    return {k: statistics.median(v) for k, v in s.items()}


SUFFIXES = {"on-chip": "", "remote+RTS": "_remote_rts"}


def compiled(rounds: int = 10) -> dict[str, float]:
    """The compiled MNIST MLP step with the per-parameter Adam chain and with the fused kernel, on
    chip and with sharded off-chip state."""
    x, y = seed.batch()
    R, GA, MICRO = seed.R, seed.GA, seed.MICRO
    trainers = {}
    for layout_name, layout in seed.LAYOUTS.items():
        for kind, fused in (("chain", False), ("fused", True)):
            torch.manual_seed(0)
            trainers[f"compiled_{kind}{SUFFIXES[layout_name]}"] = seed.trainer(
                layout, optimizer=lambda ps, fused=fused: torch.optim.Adam(ps, LR, fused=fused)
            )
    torch.manual_seed(0)
    eager_model = seed.make_model()
    eager_opt = torch.optim.Adam(eager_model.parameters(), LR, fused=True)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def eager_fused():
        eager_opt.zero_grad()
        for xc, yc in zip(xt.split(R * MICRO), yt.split(R * MICRO), strict=True):
            (torch.nn.functional.cross_entropy(eager_model(xc), yc) / GA).backward()
        eager_opt.step()

    fns = {name: (lambda t=t: t.step(x, y)) for name, t in trainers.items()}
    fns["eager_fused"] = eager_fused
    s = interleaved_samples(fns, rounds)
    print(f"compiled MNIST MLP step (R={R}, GA={GA}, micro-batch {MICRO}, Adam; on-chip, and "
          "remote+RTS: rts_threshold=512, off-chip state), median (min-max):")  # fmt: skip
    for name, trainer in trainers.items():
        chain = "compiled_chain" + ("_remote_rts" if name.endswith("_remote_rts") else "")
        fallbacks = trainer.explain()
        print(f"  {name:<26} {describe(s[name])}; chain / {name} "
              f"{ratio(s[chain], s[name])}; fused_reasons {trainer.fused_reasons}; "
              f"vmap fallback: {'; '.join(fallbacks) if fallbacks else 'none'}")  # fmt: skip
    print(f"  eager fused same schedule {describe(s['eager_fused'])}; eager / compiled_fused "
          f"{ratio(s['eager_fused'], s['compiled_fused'])}, eager / compiled_fused_remote_rts "
          f"{ratio(s['eager_fused'], s['compiled_fused_remote_rts'])}")  # fmt: skip
    return {k: statistics.median(v) for k, v in s.items()}


if __name__ == "__main__":
    cli = rounds_cli(__doc__, {"rounds": 30, "compiled_rounds": 10})
    main(cli.rounds)
    compiled(cli.compiled_rounds)
