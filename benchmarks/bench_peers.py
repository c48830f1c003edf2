"""The same training step through every peer a user would pick, side by side, on one device.

Peers: eager torch on the same schedule (GA micro-batches of R x micro, loss / GA, one optimizer
step), ``torch.compile`` of the model and of ``opt.step``, with ``--local-tensor`` DDP on R
ranks simulated by torch's ``LocalTensorMode`` (CPU), and popxl.compile with everything on
chip and with sharded (RTS), off-chip optimizer state. Every peer first trains 3 steps from the
same weights on the same data and is checked equal to eager (weights); then all are timed in
interleaved rounds (GPU calls synchronised). Prints ms per step, median (min-max), each peer's
ratio to the fastest non-popxl peer (>= 1: popxl is faster) and the step's achieved matmul
rate (FLOPs counted by torch's FlopCounterMode on one eager step) against the device's measured
float32 GEMM rate.

Models: ``mlp`` (the MNIST MLP 784-512x3-10, Adam, R=4, GA=8, micro-batch 8), ``gpt``
(GPT-2, 4 layers, width 256, seq 64, vocab 1024, AdamW, R=4, GA=4, 2 sequences per
micro-batch; Hugging Face's GPT2LMHeadModel without dropout when transformers is installed),
``hf-gpt2`` (the same through GPT2LMHeadModel with its default config: dropout, ``use_cache``;
needs transformers), ``resnet18``
(torchvision, 32x32, SGD momentum, R=2, GA=2, micro-batch 8) and ``cnn`` (an MNIST CNN with
batch norm and dropout, R=2, GA=2, micro-batch 16). The last two are checked for finite
weights only: batch norm keeps per-replica statistics (as DDP does) and dropout draws; so is
``hf-gpt2``.

On a loaded machine ``--cpu-time --threads 1`` times each step by the process's CPU time on
one thread, which other processes' load hardly moves (wall-clock time does).

``--fused-adam`` builds every peer's Adam/AdamW with ``fused=True`` (torch's one-call kernel
over a param group, which rounds differently from the default single-tensor step; the
compiled step calls the same kernel: Note [fused optimizer updates] in
torch_popxl/compile_updates.py); the equality checks are the same. By default every peer runs
torch's default Adam, which the compiled step matches bit for bit.

Usage: ``python benchmarks/bench_peers.py [--device cpu|cuda] [--models mlp,gpt]
[--rounds N] [--no-torch-compile] [--cpu-time] [--threads N] [--fused-adam]``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
from timing import device_name, describe  # noqa: E402

LAYOUTS = {
    "popxl on-chip": {},
    "popxl remote+RTS": {"rts_threshold": 512, "optimizer_state": "remote"},
}


@dataclass
class Workload:
    name: str
    make_model: Callable[[], torch.nn.Module]
    loss: Callable
    optimizer: Callable
    R: int
    GA: int
    micro: int
    batch: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]


def _mlp() -> Workload:
    from seed import make_model

    def batch(rng, n):
        return rng.normal(size=(n, 784)).astype(np.float32), rng.integers(0, 10, n)

    return Workload("MNIST MLP 784-512x3-10, Adam", make_model, torch.nn.functional.cross_entropy,
                    lambda ps: torch.optim.Adam(ps, 1e-3), 4, 8, 8, batch)  # fmt: skip


def _gpt() -> Workload:
    import bench_gpt2 as g

    def batch(rng, n):
        tokens = rng.integers(0, g.VOCAB, (n, g.SEQ + 1))
        return tokens[:, :-1], tokens[:, 1:]

    return Workload(f"GPT-2 {g.LAYERS} layers width {g.WIDTH} seq {g.SEQ}, AdamW", g.make_model,
                    g.lm_loss, lambda ps: torch.optim.AdamW(ps, 1e-3), g.R, g.GA, g.MICRO, batch)  # fmt: skip


def _hf_gpt2() -> Workload:
    """Hugging Face's GPT2LMHeadModel with its default config (dropout 0.1 everywhere,
    ``use_cache=True``, tanh GELU, tied LM head), made small: 4 layers, width 256, vocabulary
    1024; the step is the usual ``cross_entropy`` on the returned ``logits``."""
    import bench_gpt2 as g
    import transformers

    def make_model():
        config = transformers.GPT2Config(vocab_size=g.VOCAB, n_embd=g.WIDTH, n_layer=g.LAYERS,
                                         n_head=g.HEADS, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return transformers.GPT2LMHeadModel(config)

    def loss(out, targets):
        return g.lm_loss(out.logits, targets)

    def batch(rng, n):
        tokens = rng.integers(0, g.VOCAB, (n, g.SEQ + 1))
        return tokens[:, :-1], tokens[:, 1:]

    return Workload(f"Hugging Face GPT-2, default config at {g.LAYERS} layers width {g.WIDTH}, "
                    "AdamW", make_model, loss, lambda ps: torch.optim.AdamW(ps, 1e-3), g.R, g.GA,
                    g.MICRO, batch)  # fmt: skip


def _resnet() -> Workload:
    import bench_resnet as b

    def batch(rng, n):
        return rng.normal(size=(n, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, n)

    return Workload("torchvision resnet18 at 32x32, SGD momentum", b.make_model,
                    torch.nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, 0.01, momentum=0.9), b.R, b.GA, b.MICRO,
                    batch)  # fmt: skip


class DropoutCNN(torch.nn.Module):
    """A small MNIST CNN with batch norm and dropout (the slow path of earlier versions)."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Dropout(0.25), torch.nn.Flatten(),
        )  # fmt: skip
        self.head = torch.nn.Sequential(torch.nn.Linear(64 * 12 * 12, 128), torch.nn.ReLU(),
                                        torch.nn.Dropout(0.5), torch.nn.Linear(128, 10))  # fmt: skip

    def forward(self, x):
        return self.head(self.features(x))


def _cnn() -> Workload:
    def batch(rng, n):
        return rng.normal(size=(n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n)

    return Workload("CNN with batch norm and dropout (MNIST shapes), SGD momentum",
                    DropoutCNN, torch.nn.functional.cross_entropy,
                    lambda ps: torch.optim.SGD(ps, 0.01, momentum=0.9), 2, 2, 16, batch)  # fmt: skip


def _fused_adam(make: Callable) -> Callable:
    """``make`` (params -> optimizer) with an Adam/AdamW built ``fused=True``; any other
    optimizer as ``make`` builds it."""

    def build(params):
        params = list(params)
        opt = make(params)
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
            return opt
        keep = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
        return type(opt)(params, **{k: opt.defaults[k] for k in keep}, fused=True)

    return build


WORKLOADS = {"mlp": _mlp, "gpt": _gpt, "hf-gpt2": _hf_gpt2, "resnet18": _resnet, "cnn": _cnn}
# Models whose training draws random numbers (dropout) or keeps per-replica batch-norm
# statistics: checked for finite losses, not weights equal to eager's.
_NOT_EQUAL_TO_EAGER = {"cnn", "resnet18", "hf-gpt2"}


def gemm_rate(device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """The device's float32 matmul rate (FLOP/s): the best of a few square products through
    torch's matmul and through the simulator's (Note [gemm kernel]: on some CPUs it is faster),
    timed by ``clock``, the steps' own (with ``--cpu-time`` a loaded machine's waits for a core
    then count in neither)."""
    n = 4096 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = 0.0
    for mm in (torch.mm, torch.ops.torch_popxl.gemm):
        for _ in range(5):
            _sync(device)
            t0 = clock()
            for _ in range(4):
                mm(a, b)
            _sync(device)
            best = max(best, 4 * 2 * n**3 / (clock() - t0))
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eager_step(model, opt, loss_fn, w: Workload, device, compiled_opt_step=None):
    """The eager schedule: GA micro-batches of R x micro, loss / GA, one optimizer step."""

    def step(x, y):
        opt.zero_grad()
        xt, yt = torch.as_tensor(x).to(device), torch.as_tensor(y).to(device)
        for xc, yc in zip(xt.split(w.R * w.micro), yt.split(w.R * w.micro), strict=True):
            (loss_fn(model(xc), yc) / w.GA).backward()
        (compiled_opt_step or opt.step)()

    return step


def _local_tensor_ddp(base: torch.nn.Module, w: Workload):
    """DDP on ``w.R`` ranks simulated in this process by torch's ``LocalTensorMode``: every rank
    holds the parameters (a ``LocalTensor`` of R copies) and runs its share of each
    micro-batch; before each rank's optimizer step the gradients are averaged over the ranks
    (the all-reduce, done on the local copies: a process group, even a fake one, would make
    this process look like one of several to popxl.compile)."""
    from torch.distributed._local_tensor import LocalTensorMode

    mode = LocalTensorMode(w.R)
    model = copy.deepcopy(base)
    local: dict[int, torch.nn.Parameter] = {}  # tied parameters stay tied
    with mode:
        for m in model.modules():
            for name, p in list(m.named_parameters(recurse=False)):
                if id(p) not in local:
                    copies = mode.rank_map(lambda r, p=p: p.detach().clone())
                    local[id(p)] = torch.nn.Parameter(copies)
                setattr(m, name, local[id(p)])
        opt = w.optimizer(model.parameters())

    def all_reduce_mean(g):
        parts = list(g._local_tensors.values())
        mean = torch.stack(parts).mean(0)
        for part in parts:
            part.copy_(mean)

    def step(x, y):
        xt, yt = torch.as_tensor(x), torch.as_tensor(y)
        with mode:
            opt.zero_grad()
            for k in range(w.GA):

                def rows(t, k=k):
                    return mode.rank_map(
                        lambda r: t[(k * w.R + r) * w.micro : (k * w.R + r + 1) * w.micro]
                    )

                (w.loss(model(rows(xt)), rows(yt)) / w.GA).backward()
            for p in model.parameters():
                all_reduce_mean(p.grad)
            opt.step()

    def weights():
        with mode:
            return [p.reconcile() for p in model.parameters()]

    return step, weights


def peers(w: Workload, device: torch.device, torch_compile: bool, local_tensor: bool = False):
    """``{name: (step(x, y), weights())}`` for every peer, each from the same initial model."""
    torch.manual_seed(0)
    base = w.make_model()
    out = {}
    model = copy.deepcopy(base).to(device)
    opt = w.optimizer(model.parameters())
    out["eager"] = (_eager_step(model, opt, w.loss, w, device), model.parameters)
    if torch_compile:
        cmodel = copy.deepcopy(base).to(device)
        copt = w.optimizer(cmodel.parameters())
        compiled = torch.compile(cmodel)
        opt_step = torch.compile(copt.step)
        out["torch.compile"] = (_eager_step(compiled, copt, w.loss, w, device, opt_step),
                                cmodel.parameters)  # fmt: skip
    if local_tensor and device.type == "cpu":
        out["LocalTensorMode DDP"] = _local_tensor_ddp(base, w)
    for name, layout in LAYOUTS.items():
        pmodel = copy.deepcopy(base)
        trainer = popxl.compile(pmodel, w.loss, w.optimizer(pmodel.parameters()),
                                replication_factor=w.R, gradient_accumulation=w.GA,
                                device=device, **layout)  # fmt: skip

        def weights(t=trainer, m=pmodel):
            t.sync_weights()
            return m.parameters()

        out[name] = (trainer.step, weights)
    return out


def check_equal(fns, batches, device, exact: bool = True) -> dict[str, float]:
    """Train each peer on the same batches; the greatest weight difference to eager's.

    Adam's step lr * m / (sqrt(v) + eps) amplifies float32 rounding where a gradient is near
    zero (up to one step, lr = 1e-3, per weight), so the check is: no weight further than lr
    from eager's, and 99.9 % of them within 1e-5."""
    for step, _ in fns.values():
        for x, y in batches:
            step(x, y)
    _sync(device)
    ref = torch.cat([p.detach().cpu().flatten() for p in fns["eager"][1]()])
    diffs = {}
    for name, (_, weights) in fns.items():
        got = torch.cat([p.detach().cpu().flatten() for p in weights()])
        d = (got - ref).abs()
        diffs[name] = float(d.max())
        close = float((d <= 1e-5).double().mean())
        if not torch.isfinite(got).all():
            raise AssertionError(f"{name} trains to non-finite weights")
        if exact and (diffs[name] > 1e-3 or close < 0.999):
            raise AssertionError(f"{name} trains differently from eager: max |w - eager| "
                                 f"{diffs[name]:.2e}, {100 * close:.2f} % within 1e-5")  # fmt: skip
    return diffs


def run(key: str, device: torch.device, rounds: int, torch_compile: bool, rate: float,
        local_tensor: bool = False, clock: Callable[[], float] = time.perf_counter,
        fused_adam: bool = False) -> dict:  # fmt: skip
    w = WORKLOADS[key]()
    if fused_adam:
        w = dataclasses.replace(w, optimizer=_fused_adam(w.optimizer))
    rng = np.random.default_rng(0)
    n = w.R * w.GA * w.micro
    batches = [w.batch(rng, n) for _ in range(3)]
    t0 = time.perf_counter()
    fns = peers(w, device, torch_compile, local_tensor)
    diffs = check_equal(fns, batches, device, exact=key not in _NOT_EQUAL_TO_EAGER)
    setup = time.perf_counter() - t0
    x, y = batches[0]
    # FLOPs of one step: one eager forward + backward of the global batch (the optimizer's
    # elementwise work is not counted).
    model = w.make_model().to(device)
    with FlopCounterMode(display=False) as counter:
        w.loss(model(torch.as_tensor(x).to(device)), torch.as_tensor(y).to(device)).backward()
    flops = counter.get_total_flops()

    def timed(step):
        def call():
            step(x, y)
            _sync(device)

        return call

    samples: dict[str, list[float]] = {k: [] for k in fns}
    for step, _ in fns.values():
        timed(step)()  # warm-up
    for _ in range(rounds):
        for name, (step, _) in fns.items():
            t0 = clock()
            timed(step)()
            samples[name].append(clock() - t0)
    meds = {k: statistics.median(v) for k, v in samples.items()}
    fastest = min((k for k in meds if not k.startswith("popxl")), key=meds.get)
    adam = " (fused=True)" if fused_adam and "Adam" in w.name else ""
    print(f"\n{w.name}{adam}; R={w.R}, GA={w.GA}, micro-batch {w.micro} ({n} samples per step); "
          f"{flops / 1e9:.2f} GFLOP of matmul-counted work per step; setup + 3 checked steps "
          f"{setup:.1f} s")  # fmt: skip
    print(f"  {'peer':<18} {'ms / step, median (min-max)':<30} {'vs ' + fastest:<22} "
          f"{'GFLOP/s':>8} {'of GEMM rate':>12}  max |w - eager|")  # fmt: skip
    for name, s in samples.items():
        per_round = [a / b for a, b in zip(samples[fastest], s, strict=True)]
        vs = f"{meds[fastest] / meds[name]:.2f}x ({min(per_round):.2f}-{max(per_round):.2f})"
        achieved = flops / meds[name]
        print(f"  {name:<18} {describe(s):<30} {vs:<22} {achieved / 1e9:8.1f} "
              f"{100 * achieved / rate:11.1f}%  {diffs[name]:.1e}")  # fmt: skip
    return {"median_ms": {k: v * 1e3 for k, v in meds.items()}, "gflop": flops / 1e9}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--models", default=",".join(WORKLOADS),
                        help=f"comma-separated: {', '.join(WORKLOADS)}")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--no-torch-compile", action="store_true",
                        help="leave out the torch.compile peer (its first step compiles)")  # fmt: skip
    parser.add_argument("--local-tensor", action="store_true",
                        help="add DDP simulated by torch's LocalTensorMode (CPU; slow)")  # fmt: skip
    parser.add_argument("--cpu-time", action="store_true",
                        help="time steps by process CPU time (CPU; robust on a loaded machine)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads (default: torch's own choice)")  # fmt: skip
    parser.add_argument("--fused-adam", action="store_true",
                        help="every peer's Adam/AdamW with fused=True (default: torch's default)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 everywhere, as the simulator
    rate = gemm_rate(device, clock)
    print(f"device: {device_name(device)} ({device}); torch {torch.__version__}; measured "
          f"float32 GEMM rate {rate / 1e12:.2f} TFLOP/s; {torch.get_num_threads()} threads; "
          f"{'CPU' if args.cpu_time else 'wall-clock'} time per step")  # fmt: skip
    options = (rate, args.local_tensor, clock, args.fused_adam)
    compiled = not args.no_torch_compile
    return {
        key: run(key, device, args.rounds, compiled, *options) for key in args.models.split(",")
    }


if __name__ == "__main__":
    main()
