"""Will a model fit, and with which setting? ``python -m torch_popxl plan`` and its Python API.

``sweep`` builds (never trains) the ``popxl.compile`` training program of a model for every
combination of replica count, sharding threshold (RTS off or on) and optimizer-state placement
(on chip or in streaming memory), through ``trainer.plan(inputs, targets)``, and reads each
program's memory report: per-replica memory, traffic and the modeled device step time. ``best``
picks the setting with the highest modeled throughput among those whose on-chip memory fits a
budget (by default one device's memory, ``CostModel.DEVICE_MEMORY_BYTES``). ``format_table``
and ``plot`` show the rows; ``main`` is the command line.

Shapes are those of one micro-batch (what one replica computes at a time): a setting with R
replicas and gradient accumulation GA builds the program for a global batch of ``R * GA`` of
them, so the per-replica memory of every row is for the same micro-batch.

Note [optimizer state per replica]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The memory report says where bytes live (full-copy variables, RTS shards, streaming memory),
not what they hold. Optimizer state is read off the program that keeps it off-chip: with
``optimizer_state="remote"`` every optimizer state tensor but 0-dim ones (the step count,
which stays on chip) lives in streaming memory, sharded where the threshold shards it, and
nothing else does. So the state one replica holds under a given replica count and threshold
is the streaming memory of that setting's remote program, wherever the row keeps it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .compile import compile as _compile
from .runtime.cost_model import CostModel
from .runtime.report import MemoryReport

__all__ = [
    "PlanRow",
    "Setting",
    "TensorSpec",
    "best",
    "format_table",
    "load_factory",
    "main",
    "parse_size",
    "parse_tensor_spec",
    "plot",
    "sweep",
]

MiB = 2**20
_LINK_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
_STREAMING_KINDS = ("remote_load", "remote_store")
_STATES = ("on_chip", "remote")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the sweep: ``rts_threshold`` None is sharding off."""

    replicas: int
    rts_threshold: int | None
    optimizer_state: str

    def label(self) -> str:
        rts = "off" if self.rts_threshold is None else f">={self.rts_threshold}"
        return f"R={self.replicas} RTS {rts} {self.optimizer_state}"


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """A setting, its program's memory report and the figures the table shows (bytes and
    seconds; memory per replica, traffic per step and replica)."""

    setting: Setting
    report: MemoryReport
    global_batch: int
    optimizer_state_bytes: int  # Note [optimizer state per replica]

    @property
    def on_chip_bytes(self) -> int:
        return self.report.on_chip_bytes

    @property
    def link_bytes(self) -> float:
        return sum(self.report.traffic[k] for k in _LINK_KINDS) / self.report.num_replicas

    @property
    def streaming_traffic_bytes(self) -> float:
        return sum(self.report.traffic[k] for k in _STREAMING_KINDS) / self.report.num_replicas

    @property
    def step_time_s(self) -> float:
        return self.report.estimated_step_time_s

    @property
    def samples_per_s(self) -> float:
        t = self.step_time_s
        return self.global_batch / t if t else float("inf")

    def fits(self, budget_bytes: float) -> bool:
        return self.on_chip_bytes <= budget_bytes


# ---- inputs ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """``[NAME=]SHAPE[:DTYPE]`` of one micro-batch, e.g. ``64x784:float32``, ``ids=2x64:int64``.

    Floating tensors are filled with normal samples, integer ones with zeros (a valid class
    index and token id for any model): the values never matter, the program is only built."""

    name: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype

    def make(self, rows: int) -> torch.Tensor:
        """The tensor for ``rows`` micro-batches stacked on dim 0."""
        shape = (self.shape[0] * rows, *self.shape[1:])
        if self.dtype.is_floating_point:
            return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(self.dtype)
        return torch.zeros(shape, dtype=self.dtype)


def parse_tensor_spec(text: str) -> TensorSpec:
    """``[NAME=]SHAPE[:DTYPE]`` -> ``TensorSpec`` (dtype default float32)."""
    m = re.fullmatch(r"(?:([A-Za-z_]\w*)=)?(\d+(?:x\d+)*)(?::(\w+))?", text.strip())
    dtype = getattr(torch, m.group(3) or "float32", None) if m else None
    if m is None or not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"a tensor is given as [NAME=]SHAPE[:DTYPE], for example 64x784:float32 or "
            f"input_ids=2x64:int64 (the shape of one micro-batch, dims joined by 'x', a torch "
            f"dtype name); got {text!r}."
        )
    shape = tuple(int(d) for d in m.group(2).split("x"))
    if 0 in shape:
        raise ValueError(f"a tensor's dims must be positive; got {text!r}.")
    return TensorSpec(m.group(1), shape, dtype)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}  # fmt: skip


def parse_size(text: str) -> int:
    """``900MB``, ``897MiB``, ``1.5GiB`` or a number of bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"a memory size is a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB), "
            f"for example 900MB or 897MiB; got {text!r}."
        )
    return int(float(m.group(1)) * _UNITS[unit])


def load_factory(spec: str) -> Callable[[], Any]:
    """``module:factory`` or ``path/to/file.py:factory`` -> the factory (a callable that
    returns an ``nn.Module`` or ``(model, loss_fn)``)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"a model is given as MODULE:FACTORY (an importable module or a .py file, and a "
            f"callable in it returning an nn.Module or (model, loss_fn)), for example "
            f"mymodels:make_mlp or ./models.py:make_mlp; got {spec!r}."
        )
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"{spec!r}: no file {path}.")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        assert loader is not None and loader.loader is not None
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        if "" not in sys.path:
            sys.path.insert(0, "")  # as `python -m` does: modules in the current directory
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{spec!r}: {module_name} has no callable {attr!r}.")
    return factory


def _hf_factory(model_type: str, overrides: dict[str, Any]) -> Callable[[], Any]:
    """A Hugging Face causal LM built from its default config with ``overrides`` (never
    downloads: ``AutoConfig.for_model`` makes the config locally, weights are random)."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(
            "--hf-config needs Hugging Face transformers, which is not installed "
            "(pip install transformers); or give the model as MODULE:FACTORY."
        ) from e
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except ValueError as e:
        raise ValueError(f"--hf-config {model_type!r}: {e}") from None

    def factory():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)

    factory.config = config  # type: ignore[attr-defined]
    return factory


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ValueError(f"--set takes KEY=VALUE, for example n_layer=2; got {text!r}.")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a plain string


# ---- the sweep ------------------------------------------------------------------------------


def _build(factory, optimizer, lr, setting, gradient_accumulation, inputs, targets, keep_grads):
    made = factory()
    model, loss_fn = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"the model factory must return an nn.Module or (model, loss_fn); got "
            f"{type(made).__name__}."
        )
    if loss_fn is None and targets:
        loss_fn = torch.nn.functional.cross_entropy
    trainer = _compile(
        model,
        loss_fn,
        optimizer(model.parameters(), lr=lr),
        replication_factor=setting.replicas,
        gradient_accumulation=gradient_accumulation,
        rts_threshold=setting.rts_threshold,
        optimizer_state=setting.optimizer_state,
        keep_grads=keep_grads,
    )
    rows = setting.replicas * gradient_accumulation

    def batch(specs):
        if all(s.name for s in specs):
            return {s.name: s.make(rows) for s in specs}
        if any(s.name for s in specs):
            raise ValueError("give every input a NAME= (keyword inputs) or none (positional).")
        tensors = tuple(s.make(rows) for s in specs)
        return tensors[0] if len(tensors) == 1 else tensors

    trainer.plan(batch(inputs), batch(targets) if targets else None)
    return trainer.memory_report()


def _optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    classes = {
        n.lower(): c
        for n, c in vars(torch.optim).items()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    }
    if name.lower() not in classes:
        raise ValueError(
            f"unknown optimizer {name!r}; expected one of torch.optim's: "
            f"{', '.join(sorted(classes))}."
        )
    return classes[name.lower()]


def sweep(
    factory: Callable[[], Any],
    inputs: Sequence[TensorSpec],
    targets: Sequence[TensorSpec] = (),
    *,
    optimizer: str = "adam",
    lr: float = 1e-3,
    replicas: Sequence[int] = (1, 2, 4),
    rts_thresholds: Sequence[int | None] = (None, 512),
    optimizer_states: Sequence[str] = _STATES,
    gradient_accumulation: int = 1,
    keep_grads: bool = False,
    progress: Callable[[Setting], None] | None = None,
) -> list[PlanRow]:
    """Build the training program of ``factory()`` for every setting and read its report.

    ``factory`` returns an ``nn.Module`` or ``(model, loss_fn)``; without a ``loss_fn`` the
    loss is cross-entropy when ``targets`` are given, else the loss the model returns.
    Sharding needs more than one replica: rows with R=1 keep only ``None`` (off).
    """
    opt = _optimizer_class(optimizer)
    bad = [s for s in optimizer_states if s not in _STATES]
    if bad or not optimizer_states:
        raise ValueError(
            f"optimizer states are 'on_chip' and 'remote'; got {list(optimizer_states)}."
        )
    if not inputs:
        raise ValueError("give the shape of at least one input (--input SHAPE[:DTYPE]).")
    settings = []
    for r in replicas:
        for t in dict.fromkeys(None if r == 1 else t for t in rts_thresholds):
            settings += [Setting(r, t, s) for s in optimizer_states]
    reports: dict[Setting, MemoryReport] = {}

    def report(setting: Setting) -> MemoryReport:
        if setting not in reports:
            if progress is not None:
                progress(setting)
            reports[setting] = _build(
                factory, opt, lr, setting, gradient_accumulation, inputs, targets, keep_grads
            )
        return reports[setting]

    rows = []
    for s in settings:
        remote = report(dataclasses.replace(s, optimizer_state="remote"))
        rows.append(
            PlanRow(
                s,
                report(s),
                s.replicas * gradient_accumulation * inputs[0].shape[0],
                remote.streaming_bytes,
            )  # fmt: skip
        )
    return rows


def best(rows: Sequence[PlanRow], budget_bytes: float) -> PlanRow | None:
    """The row with the highest modeled throughput whose on-chip memory fits the budget
    (ties: fewer replicas, then the earlier row); None if none fits."""
    fitting = [r for r in rows if r.fits(budget_bytes)]
    if not fitting:
        return None
    return max(fitting, key=lambda r: (r.samples_per_s, -r.setting.replicas))


# ---- output ---------------------------------------------------------------------------------

_COLUMNS = (
    # (header, unit, value of a row)
    ("variables", "MiB", lambda r: r.report.variable_bytes / MiB),
    ("RTS shards", "MiB", lambda r: r.report.rts_shard_bytes / MiB),
    ("opt. state", "MiB", lambda r: r.optimizer_state_bytes / MiB),
    ("peak act.", "MiB", lambda r: r.report.peak_intermediate_bytes / MiB),
    ("on chip", "MiB", lambda r: r.on_chip_bytes / MiB),
    ("streaming", "MiB", lambda r: r.report.streaming_bytes / MiB),
    ("links", "MiB", lambda r: r.link_bytes / MiB),
    ("stream IO", "MiB", lambda r: r.streaming_traffic_bytes / MiB),
    ("step", "ms", lambda r: r.step_time_s * 1e3),
    ("samples/s", "", lambda r: r.samples_per_s),
)


def format_table(rows: Sequence[PlanRow], budget_bytes: float, device: str | None = None) -> str:
    """The rows as a table in MiB and ms, the best fitting one marked ``*``."""
    device = device or CostModel().device
    chosen = best(rows, budget_bytes)
    head = ("", "replicas", "RTS", "opt. state at", *(c[0] for c in _COLUMNS), "fits")
    units = ("", "", "", "", *(c[1] for c in _COLUMNS), "")
    body = []
    for r in rows:
        s = r.setting
        cells = [f"{f(r):.2f}" if unit else f"{f(r):,.0f}" for _, unit, f in _COLUMNS]
        body.append((
            "*" if r is chosen else "",
            str(s.replicas),
            "off" if s.rts_threshold is None else f">={s.rts_threshold}",
            s.optimizer_state,
            *cells,
            "yes" if r.fits(budget_bytes) else "no",
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in (head, units, *body)) for i in range(len(head))]

    def fmt(line):
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(
            zip(line, widths, strict=True))).rstrip()  # fmt: skip

    lines = [
        f"Per replica on one {device}; memory in MiB (2^20 bytes) per replica, traffic in MiB",
        "per step and replica, modeled device time per optimizer step "
        f"(docs/cost_model.md); budget {budget_bytes / MiB:,.1f} MiB on chip.",
        "",
        fmt(head),
        fmt(units),
        *(fmt(line) for line in body),
        "",
    ]
    if chosen is None:
        smallest = min(rows, key=lambda r: r.on_chip_bytes)
        lines.append(
            f"No setting fits {budget_bytes / MiB:,.1f} MiB; the smallest is "
            f"{smallest.setting.label()} with {smallest.on_chip_bytes / MiB:,.2f} MiB on chip."
        )
    else:
        lines.append(
            f"* best that fits: {chosen.setting.label()}: {chosen.on_chip_bytes / MiB:,.2f} MiB "
            f"on chip, {chosen.step_time_s * 1e3:.3f} ms per step, "
            f"{chosen.samples_per_s:,.0f} samples/s (modeled)."
        )
    return "\n".join(lines)


def plot(rows: Sequence[PlanRow], budget_bytes: float, path: str | os.PathLike | None = None):
    """A matplotlib figure of the sweep (on-chip memory against the budget, modeled
    throughput); saved to ``path`` when given, returned either way."""
    try:
        mfigure = importlib.import_module("matplotlib.figure")  # optional: imported on use
    except ImportError as e:
        raise ImportError(
            "a chart needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'torch_popxl[examples]'), or leave out --chart."
        ) from e
    fig = mfigure.Figure(figsize=(11, 1.5 + 0.3 * len(rows)))
    ax_mem, ax_time = fig.subplots(1, 2, sharey=True)
    labels = [r.setting.label() for r in rows]
    lefts = [0.0] * len(rows)
    for name, part in (
        ("full-copy variables", lambda r: r.report.variable_bytes),
        ("RTS shards", lambda r: r.report.rts_shard_bytes),
        ("constants + peak activations",
         lambda r: r.report.constant_bytes + r.report.peak_intermediate_bytes),
    ):  # fmt: skip
        values = [part(r) / MiB for r in rows]
        ax_mem.barh(labels, values, left=lefts, label=name)
        lefts = [b + v for b, v in zip(lefts, values, strict=True)]
    ax_mem.axvline(budget_bytes / MiB, color="black", linestyle="--", label="budget")
    ax_mem.invert_yaxis()
    ax_mem.set_xlabel("MiB on chip per replica")
    ax_mem.set_title("On-chip memory", fontsize=9)
    ax_mem.legend(fontsize=7)
    colors = ["tab:green" if r.fits(budget_bytes) else "tab:gray" for r in rows]
    ax_time.barh(labels, [r.samples_per_s for r in rows], color=colors)
    ax_time.set_xlabel("samples/s (modeled; gray: does not fit)")
    ax_time.set_title(f"Modeled throughput, one {CostModel().device} per replica", fontsize=9)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


# ---- command line ---------------------------------------------------------------------------


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse: its ValueError message becomes the usage error's."""

    def parse_arg(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_arg


def _list(parse: Callable[[str], Any]) -> Callable[[str], list]:
    def parse_list(text: str) -> list:
        return [parse(item.strip()) for item in text.split(",") if item.strip()]

    return _arg(parse_list)


def _threshold(text: str) -> int | None:
    if text.lower() in ("off", "none", "0"):
        return None
    value = int(text)
    if value < 1:
        raise ValueError(f"an RTS threshold is 'off' or a positive element count; got {text!r}.")
    return value


DESCRIPTION = """\
Will the model fit, and with which setting? Builds (never trains) the popxl.compile training
program of a model for every combination of replica count, sharding threshold (RTS) and
optimizer-state placement, and prints per-replica memory, traffic and the modeled device step
time of each in MiB and ms, marking the fastest setting whose on-chip memory fits the budget.
Shapes are those of one micro-batch; a row with R replicas builds R x gradient-accumulation of
them. docs/memory_report.md explains the columns."""

EXAMPLES = """\
examples:
  python -m torch_popxl plan examples/mnist_compile.py:make_model \\
      --input 8x784:float32 --target 8:int64 --gradient-accumulation 8 --chart plan.png
  python -m torch_popxl plan --hf-config gpt2 --set n_layer=4 --set n_embd=256 --seq-len 64"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's options."""
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "model",
        nargs="?",
        metavar="MODULE:FACTORY",
        help="a callable returning an nn.Module or (model, loss_fn): an importable module or a "
        ".py file, then its name (mymodels:make_mlp, ./models.py:make_mlp)",
    )
    model.add_argument(
        "--hf-config",
        metavar="MODEL_TYPE",
        help="a Hugging Face causal LM built from its default config (gpt2, llama, ...; random "
        "weights, nothing downloaded; needs transformers)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a --hf-config field, for example --set n_layer=2 --set n_embd=128",
    )
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        type=_arg(parse_tensor_spec),
        metavar="[NAME=]SHAPE[:DTYPE]",
        help="one micro-batch of an input (repeat for several; NAME= makes them keyword "
        "arguments), e.g. 64x784:float32. With --hf-config the default is "
        "input_ids and labels of 1xSEQ:int64",
    )
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        type=_arg(parse_tensor_spec),
        metavar="SHAPE[:DTYPE]",
        help="one micro-batch of the targets, e.g. 64:int64 (leave out when the model returns "
        "its loss); the loss is the factory's loss_fn, else cross-entropy",
    )
    parser.add_argument("--seq-len", type=int, default=128, help="--hf-config's sequence length")
    parser.add_argument("--optimizer", default="adam", help="a torch.optim class, any case")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    parser.add_argument(
        "--replicas", type=_list(int), default=[1, 2, 4], metavar="R,...",
        help="replica counts to try (default: 1,2,4)",
    )  # fmt: skip
    parser.add_argument(
        "--rts-threshold", type=_list(_threshold), default=[None, 512], metavar="T,...",
        help="sharding thresholds to try: off, or the element count from which optimizer "
        "state is sharded over the replicas (default: off,512)",
    )  # fmt: skip
    parser.add_argument(
        "--state", type=_list(str), default=list(_STATES), metavar="WHERE,...",
        help="optimizer state placements to try: on_chip, remote (default: on_chip,remote)",
    )  # fmt: skip
    parser.add_argument(
        "--gradient-accumulation", type=int, default=1, help="micro-batches per optimizer step"
    )
    parser.add_argument(
        "--keep-grads", action="store_true",
        help="count a full gradient per parameter, as a loop that reads p.grad needs",
    )  # fmt: skip
    parser.add_argument(
        "--budget", type=_arg(parse_size), default=CostModel.DEVICE_MEMORY_BYTES, metavar="SIZE",
        help="on-chip memory per replica, e.g. 900MB or 2GiB (default: one "
        f"{CostModel.DEVICE}, {CostModel.DEVICE_MEMORY_BYTES / MiB:.0f} MiB)",
    )  # fmt: skip
    parser.add_argument("--chart", metavar="PATH", help="save a chart there (needs matplotlib)")


def run(args: argparse.Namespace) -> list[PlanRow]:
    """``plan`` with parsed arguments: prints the table, saves the chart; returns the rows."""
    inputs, targets = list(args.input), list(args.target)
    if args.hf_config:
        overrides = dict(_parse_override(o) for o in args.set)
        factory = _hf_factory(args.hf_config, overrides)
        if not inputs:
            limit = getattr(factory.config, "max_position_embeddings", args.seq_len)  # type: ignore[attr-defined]
            seq = min(args.seq_len, limit)
            inputs = [TensorSpec(n, (1, seq), torch.int64) for n in ("input_ids", "labels")]
        what = f"Hugging Face {args.hf_config} ({', '.join(args.set) or 'default config'})"
    else:
        if args.set:
            raise ValueError("--set overrides fields of --hf-config's model; no --hf-config given.")
        factory = load_factory(args.model)
        what = args.model
    rts = ",".join("off" if t is None else f">={t}" for t in args.rts_threshold)
    print(
        f"Planning {what}: replicas {','.join(map(str, args.replicas))}, RTS {rts}, optimizer "
        f"state {','.join(args.state)} (each program is built, not trained)",
        flush=True,
    )
    rows = sweep(
        factory,
        inputs,
        targets,
        optimizer=args.optimizer,
        lr=args.lr,
        replicas=args.replicas,
        rts_thresholds=args.rts_threshold,
        optimizer_states=args.state,
        gradient_accumulation=args.gradient_accumulation,
        keep_grads=args.keep_grads,
        progress=lambda s: print(f"  building {s.label()}", file=sys.stderr, flush=True),
    )
    print(format_table(rows, args.budget))
    if args.chart:
        plot(rows, args.budget, args.chart)
        print(f"chart: {args.chart}")
    return rows


def main(argv: Sequence[str] | None = None) -> list[PlanRow]:
    parser = argparse.ArgumentParser(
        prog="python -m torch_popxl plan",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
