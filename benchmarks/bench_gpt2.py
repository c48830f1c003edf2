"""A small GPT-2 through popxl.compile versus eager torch on the same schedule, side by side.

GPT-2 (4 layers, width 256, 4 heads, sequence 64, vocabulary 1024), AdamW; 4 replicas x 2
sequences per micro-batch, gradient accumulation 4 (32 sequences per optimizer step), in two
layouts: everything on chip, and optimizer state sharded (threshold 512) and off-chip. The
model is Hugging Face's ``GPT2LMHeadModel`` built from a config when ``transformers`` is
installed, else ``MiniGPT2`` below, the same architecture in plain torch (learned positions,
pre-LayerNorm blocks, causal attention, tanh GELU, an LM head tied to the token embedding).
Prints build seconds, ms per step as median (min-max) over interleaved rounds, the ratios
eager/simulator (>= 1: the simulator is faster) and the fragments that fall back to vmap.

Usage: ``python benchmarks/bench_gpt2.py [rounds] [--inductor]``; ``--inductor`` adds the on-chip
program with ``backend="inductor"`` (its first step compiles it, about a minute here).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
from timing import (  # noqa: E402
    add_aten_kernel_row,
    describe,
    interleaved_samples,
    print_aten_kernel_row,
    ratio,
    rounds_cli,
)

R, GA, MICRO, SEQ = 4, 4, 2, 64
LAYERS, WIDTH, HEADS, VOCAB = 4, 256, 4, 1024
LAYOUTS = {
    "on-chip": {},
    "remote+RTS": {"rts_threshold": 512, "optimizer_state": "remote"},
}


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(WIDTH)
        self.c_attn = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = torch.nn.Linear(WIDTH, WIDTH)
        self.ln_2 = torch.nn.LayerNorm(WIDTH)
        self.c_fc = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.mlp_proj = torch.nn.Linear(4 * WIDTH, WIDTH)
        self.register_buffer(
            "mask", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)), persistent=False
        )

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // HEADS)
        scores = scores.masked_fill(~self.mask[:t, :t], torch.finfo(scores.dtype).min)
        a = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(a)
        h = torch.nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp_proj(h)


class MiniGPT2(torch.nn.Module):
    """GPT-2's architecture in plain torch: token ids ``[B, T]`` -> logits ``[B, T, vocab]``."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, WIDTH)
        self.wpe = torch.nn.Embedding(SEQ, WIDTH)
        self.h = torch.nn.ModuleList(_Block() for _ in range(LAYERS))
        self.ln_f = torch.nn.LayerNorm(WIDTH)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the LM head tied to the token embedding


def make_model() -> torch.nn.Module:
    try:
        import transformers  # optional: not a dependency of the project
    except ImportError:
        return MiniGPT2()
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH,
                                     n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)  # fmt: skip

    class HFLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(config)

        def forward(self, ids):
            return self.gpt(input_ids=ids).logits

    return HFLogits()


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


def main(repeats: int = 5, inductor: bool = False) -> dict[str, float]:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (R * GA * MICRO, SEQ + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    trainers, builds = {}, {}
    layouts = dict(LAYOUTS)
    if inductor:  # the on-chip program through torch.compile (its first step compiles it)
        layouts["inductor"] = {"backend": "inductor"}
    for name, layout in layouts.items():
        model = make_model()
        t0 = time.perf_counter()
        trainers[name] = popxl.compile(model, lm_loss, torch.optim.AdamW(model.parameters(), 1e-3),
                                       replication_factor=R, gradient_accumulation=GA, **layout)  # fmt: skip
        trainers[name].step(x, y)
        builds[name] = time.perf_counter() - t0
    eager_model = make_model()
    opt = torch.optim.AdamW(eager_model.parameters(), 1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def eager_schedule():
        opt.zero_grad()
        for xc, yc in zip(xt.split(R * MICRO), yt.split(R * MICRO), strict=True):
            (lm_loss(eager_model(xc), yc) / GA).backward()
        opt.step()

    fns = {name: (lambda t=t: t.step(x, y)) for name, t in trainers.items()}
    fns["eager_schedule"] = eager_schedule
    add_aten_kernel_row(
        fns, lambda: trainers["on-chip"].step(x, y)
    )  # the same, torch's matmul kernel
    cpu: dict[str, list[float]] = {}
    s = interleaved_samples(fns, repeats, warmup=1, cpu=cpu)
    steady = {name: statistics.median(s[name]) for name in trainers}
    kind = type(eager_model).__name__
    print(f"small GPT-2 ({kind}: {LAYERS} layers, width {WIDTH}, seq {SEQ}, vocab {VOCAB}; R={R}, "
          f"GA={GA}, {MICRO} sequences per micro-batch, AdamW), median (min-max):")  # fmt: skip
    print(f"  eager same schedule      {describe(s['eager_schedule'])}")
    for name, trainer in trainers.items():
        fallbacks = trainer.explain()
        print(f"  popxl.compile {name:<10} {describe(s[name])}: eager / simulator "
              f"{ratio(s['eager_schedule'], s[name])}; build {builds[name] - steady[name]:.2f} s; "
              f"vmap fallback: {'; '.join(fallbacks) if fallbacks else 'none'}")  # fmt: skip
    print_aten_kernel_row(s, "eager_schedule")
    if inductor:
        saved = steady["on-chip"] - steady["inductor"]
        extra = builds["inductor"] - builds["on-chip"]
        even = f"{extra / saved:.0f} steps" if saved > 0 else "never"
        print(f"  inductor: first step {builds['inductor']:.1f} s (compilation included), "
              f"{saved * 1e3:.1f} ms per step saved: it pays for itself after {even}")  # fmt: skip
    print("  CPU time per step: " + ", ".join(f"{k} {describe(v)}" for k, v in cpu.items())
          + f"; eager / on-chip {ratio(cpu['eager_schedule'], cpu['on-chip'])}, "
          f"/ remote+RTS {ratio(cpu['eager_schedule'], cpu['remote+RTS'])}")  # fmt: skip
    return {k: statistics.median(v) for k, v in s.items()}


if __name__ == "__main__":
    cli = rounds_cli(
        __doc__, {"rounds": 5}, inductor="also time the on-chip step with backend='inductor'"
    )
    main(cli.rounds, inductor=cli.inductor)
