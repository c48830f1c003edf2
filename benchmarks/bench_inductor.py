"""The MNIST MLP step through popxl.compile with ``backend="inductor"`` against the default
backend (Note [inductor backend] in torch_popxl/runtime/executor.py).

MLP 784-512-512-512-10 (GELU), Adam; 4 replicas x micro-batch 8, gradient accumulation 8, on
chip and with remote + RTS state (as bench_compile.py). Prints, per backend and layout, the
first step (build + torch.compile with an empty inductor cache + one step), then the steady
step time of all four programs timed interleaved, median (min-max), and the break-even point:
how many steps a job needs before inductor's compile time is won back. Which fragments fell
back to the plain function (``backend_reasons``) is printed too.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

# An empty cache (set before torch reads it): the first step pays the full compilation, as a
# user's first run does.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench_inductor_"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from seed import GA, LAYOUTS, MICRO, R, batch, trainer  # noqa: E402
from timing import describe, interleaved_samples, ratio, rounds_cli  # noqa: E402


def main(repeats: int = 20) -> dict[str, float]:
    torch.manual_seed(0)
    x, y = batch()
    trainers, first = {}, {}
    for layout_name, layout in LAYOUTS.items():
        for backend in ("default", "inductor"):
            name = f"{layout_name} {backend}"
            t0 = time.perf_counter()
            trainers[name] = trainer(layout, backend=backend)
            trainers[name].step(x, y)
            first[name] = time.perf_counter() - t0
    fns = {name: (lambda t=t: t.step(x, y)) for name, t in trainers.items()}
    s = interleaved_samples(fns, repeats)
    print(f"MNIST MLP step (R={R}, GA={GA}, micro-batch {MICRO}, Adam), default vs inductor:")
    for layout_name in LAYOUTS:
        d, i = f"{layout_name} default", f"{layout_name} inductor"
        step_d, step_i = np.median(s[d]), np.median(s[i])
        extra = first[i] - first[d]
        gain = step_d - step_i
        reasons = trainers[i].session._executor.backend_reasons
        fallen = {k: v[:120] for k, v in reasons.items() if v is not None}
        if "normal" in fallen:
            even = "n/a (the step fell back to the plain function)"
        else:
            even = f"{extra / gain:.0f} steps" if gain > 0 else "never (inductor is not faster)"
        print(f"  {layout_name:<10} first step: default {first[d]:.2f} s, inductor "
              f"{first[i]:.2f} s; steady step: default {describe(s[d])}, inductor "
              f"{describe(s[i])}, default/inductor {ratio(s[d], s[i])}; break-even after "
              f"{even}; fallbacks: {fallen or 'none'}")  # fmt: skip
    return {k: float(np.median(v)) for k, v in s.items()}


if __name__ == "__main__":
    main(rounds_cli(__doc__, {"rounds": 20}).rounds)
