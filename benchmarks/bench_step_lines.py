"""Where a compiled training step's time goes: every line of its generated code, timed.

``popxl.compile`` runs a step as one generated Python function (``Session.generated_code()``),
one torch op or runtime call per line. This script builds one of ``bench_peers.py``'s
workloads (the seed MLP by default), re-runs the step's generated function with a clock read
after each of its top-level lines (a loop counts as one line, read after it ends), and prints
per step, medians over the timed steps:

* the whole ``Trainer.step``, the generated function inside it, and the Python around it
  (batch checks, state checks, the run's bookkeeping, loss value, ``p.grad``);
* the lines that cost most, each with its median and minimum;
* the same time summed by what each line calls (``aten.gelu_backward``, ``GEMM``, the Adam
  kernel, ...), so many small lines of one kind show up together.

``--evict`` runs one eager step of the same model before every compiled step, as
``bench_peers.py``'s interleaved rounds do: the eager step's traffic leaves the compiled
step's data and the interpreter's code colder, which is how the peers benchmark times it.
The clock reads cost well under a microsecond each. This reads the fast executor's generated
functions and globals (runtime internals; explicit batching only).

Usage: ``python benchmarks/bench_step_lines.py [--model mlp] [--layout on-chip|remote+RTS]
[--steps N] [--threads N] [--cpu-time] [--evict] [--top N]``.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers  # noqa: E402
from timing import device_name  # noqa: E402

import torch_popxl as popxl  # noqa: E402

# the attributes the executor reads from a fragment's function
_FN_ATTRS = ("out_batched", "explicit", "vmap_reason", "one_op_vmaps", "vmapped_ops", "plan",
             "written_streams", "slot_views", "source")  # fmt: skip
_CALLEE = re.compile(r"^(?:[\w, ]+ = )?([A-Za-z_][\w.]*)\(")


def _timed_source(source: str) -> tuple[str, list[str]]:
    """``source`` (one ``def fn``) with ``_T(i)`` after each top-level line ``i`` of its body
    (after the whole block for a loop or a branch), and the lines' labels."""
    out: list[str] = []
    labels: list[str] = []
    pending: str | None = None
    for line in source.splitlines():
        text = line.strip()
        top = line.startswith("    ") and not line.startswith("     ")
        if top and pending is not None:  # the block that ``pending`` opened has ended
            labels.append(pending)
            out.append(f"    _T({len(labels) - 1})")
            pending = None
        if top and text.startswith("return"):
            out.append("    _T(-1)")
        out.append(line)
        if line.startswith("def "):
            out.append("    _T(-2)")
        elif top and text and not text.startswith(("#", "return", "del ")):
            if text.endswith(":"):
                pending = text
            else:
                labels.append(text)
                out.append(f"    _T({len(labels) - 1})")
    return "\n".join(out), labels


def _callee(label: str, program) -> str:
    """What a generated line calls: the op's name for the program's op literals."""
    m = _CALLEE.match(label)
    if m is None:
        return "(assignment)"
    name = m.group(1)
    if re.fullmatch(r"v\d+\..+", name):
        return "Tensor." + name.split(".", 1)[1]
    if name in program.overloads:  # a raw op builtin: its OpOverload
        return str(program.overloads[name])
    found = program.globals.get(name)
    inner = getattr(found, "func", found)  # functools.partial
    qual = getattr(inner, "__qualname__", None)
    return qual.split(".<locals>")[0] if isinstance(qual, str) else name


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(bench_peers.WORKLOADS))
    parser.add_argument("--layout", default="on-chip", choices=["on-chip", "remote+RTS"])
    parser.add_argument("--steps", type=int, default=100, help="timed steps (default 100)")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads")
    parser.add_argument("--cpu-time", action="store_true",
                        help="process CPU time (robust on a loaded machine with --threads 1)")  # fmt: skip
    parser.add_argument("--evict", action="store_true",
                        help="one eager step before each compiled step (as bench_peers)")  # fmt: skip
    parser.add_argument("--top", type=int, default=25, help="lines to list (default 25)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    w = bench_peers.WORKLOADS[args.model]()
    layout = bench_peers.LAYOUTS["popxl " + args.layout]
    model = w.make_model()
    trainer = popxl.compile(model, w.loss, w.optimizer(model.parameters()),
                            replication_factor=w.R, gradient_accumulation=w.GA, **layout)  # fmt: skip
    x, y = w.batch(np.random.default_rng(0), w.R * w.GA * w.micro)
    for _ in range(3):
        trainer.step(x, y)
    executor = trainer.session._executor
    fn = executor.fns["normal"]
    if not getattr(fn, "explicit", False):
        raise SystemExit(f"{args.model}: the step does not run explicitly batched; nothing to time")
    source, labels = _timed_source(fn.source)
    stamps: list[tuple[int, float]] = []

    def stamp(i: int, _append=stamps.append, _clock=clock) -> None:
        _append((i, _clock()))

    scope: dict = {}
    exec(compile(source, "<timed step>", "exec"), {**executor.program.globals, "_T": stamp}, scope)
    timed = scope["fn"]
    for attr in _FN_ATTRS:
        setattr(timed, attr, getattr(fn, attr))
    executor.fns["normal"] = timed

    evict = None
    if args.evict:
        eager_model = w.make_model()
        opt = w.optimizer(eager_model.parameters())
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        n = w.R * w.micro

        def evict():
            opt.zero_grad()
            for i in range(w.GA):
                w.loss(eager_model(xt[i * n : (i + 1) * n]), yt[i * n : (i + 1) * n]).div(
                    w.GA
                ).backward()
            opt.step()

    per_line: dict[int, list[float]] = collections.defaultdict(list)
    steps, inside = [], []
    try:
        for _ in range(args.steps):
            if evict is not None:
                evict()
            stamps.clear()
            t0 = clock()
            trainer.step(x, y)
            steps.append(clock() - t0)
            inside.append(stamps[-1][1] - stamps[0][1])
            for (_, before), (i, after) in zip(stamps, stamps[1:], strict=False):
                per_line[i].append(after - before)
    finally:
        executor.fns["normal"] = fn
    med = {i: 1e3 * statistics.median(v) for i, v in per_line.items()}
    low = {i: 1e3 * min(v) for i, v in per_line.items()}
    step_ms, fn_ms = 1e3 * statistics.median(steps), 1e3 * statistics.median(inside)
    print(f"device: {device_name(torch.device('cpu'))}; {torch.get_num_threads()} threads, "
          f"{'process CPU' if args.cpu_time else 'wall-clock'} time; {w.name}, {args.layout}; "
          f"{args.steps} steps{', each after an eager step' if args.evict else ''}")  # fmt: skip
    print(f"  step {step_ms:.3f} ms: generated function {fn_ms:.3f} (its lines' medians sum "
          f"to {sum(med.values()):.3f}), Python around it {step_ms - fn_ms:.3f}")  # fmt: skip
    print(f"  the {args.top} costliest lines, median / minimum ms:")
    for i in sorted(med, key=lambda i: -med[i])[: args.top]:
        label = labels[i] if i >= 0 else "return"
        print(f"  {med[i]:8.3f} {low[i]:8.3f}  {label[:110]}")
    by_callee: dict[str, list[float]] = collections.defaultdict(list)
    for i, v in med.items():
        by_callee[_callee(labels[i], executor.program) if i >= 0 else "return"].append(v)
    print("  by what the lines call, summed medians:")
    for name, vs in sorted(by_callee.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(vs):8.3f} ms  {len(vs):3d} lines  {name}")
    return {
        "step_ms": step_ms,
        "fn_ms": fn_ms,
        "by_callee": {k: sum(v) for k, v in by_callee.items()},
    }


if __name__ == "__main__":
    main()
