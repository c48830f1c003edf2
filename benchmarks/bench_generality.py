"""Which models' training steps run explicitly batched (Note [explicit batching]), and which
ops keep a fragment off that path.

Models: Hugging Face families built offline from small configs with their default settings
(ConvNeXt, ViT, BERT, GPT-2, Llama, Mistral, T5, ResNet, Swin) and torchvision CNNs on small
images (resnet18, mobilenet_v3_small, efficientnet_b0, convnext_tiny). Each is compiled into a
training step with ``popxl.compile`` (R=2, SGD momentum) and run once; per model it prints the
fragments that run under ``torch.func.vmap`` (traced once, or at every step) with the op that
sent them there (``vmap_reason``), and the ops the fragments run through torch's batching rule
one op at a time (Note [one op through torch's batching rule]). ``--time`` also times each
step (process CPU time, median of ``--rounds``; run with ``--threads 1`` on a loaded machine).

Usage: ``python benchmarks/bench_generality.py [--models convnext,swin] [--time] [--rounds N]
[--threads N]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402

R = 2  # replicas
N = 2  # samples per replica
IMAGE = 32  # side of the images of the vision models
SEQ = 16  # tokens per sequence of the language models
VOCAB = 128


class _Logits(torch.nn.Module):
    """A Hugging Face model returning its ``logits`` (what a loss function reads)."""

    def __init__(self, model: torch.nn.Module, **call):
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, x):
        return self.model(x, **self.call).logits


class _Seq2Seq(torch.nn.Module):
    """T5: the targets' tokens are the decoder's input (teacher forcing on the same ids)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(input_ids=x, decoder_input_ids=x).logits


def _images(n: int, side: int = IMAGE) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3, side, side)).astype(np.float32), np.arange(n) % 10


def _tokens(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, VOCAB, (n, SEQ)), rng.integers(0, VOCAB, (n, SEQ))


def _image_loss(out, y):
    return torch.nn.functional.cross_entropy(out, y)


def _lm_loss(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@dataclass
class Model:
    make: Callable[..., torch.nn.Module]  # keyword arguments: the config's or constructor's
    batch: Callable[[int], tuple[np.ndarray, np.ndarray]]
    loss: Callable


def _hf(name: str, **config):
    import transformers

    return getattr(transformers, name)(**config)


def _hf_image(cls: str, config: str, **kw) -> Model:
    def make(**overrides):
        import transformers

        config_ = _hf(config, num_labels=10, **(kw | overrides))
        return _Logits(getattr(transformers, cls)(config_))

    return Model(make, _images, _image_loss)


def _hf_text(cls: str, config: str, classify: bool = False, **kw) -> Model:
    def make():
        import transformers

        cfg = _hf(config, vocab_size=VOCAB, **kw)
        if classify:
            cfg.num_labels = 10
        return _Logits(getattr(transformers, cls)(cfg))

    if classify:
        return Model(make, lambda n: (_tokens(n)[0], np.arange(n) % 10), _image_loss)
    return Model(make, _tokens, _lm_loss)


def _t5() -> Model:
    def make():
        import transformers

        cfg = _hf("T5Config", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                  num_heads=4, decoder_start_token_id=0)  # fmt: skip
        return _Seq2Seq(transformers.T5ForConditionalGeneration(cfg))

    return Model(make, _tokens, _lm_loss)


def _vision(name: str, side: int = IMAGE) -> Model:
    def make(**overrides):
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10, **overrides)

    return Model(make, lambda n: _images(n, side), _image_loss)


_SMALL_LM = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
MODELS: dict[str, Callable[[], Model]] = {
    "hf_convnext": lambda: _hf_image("ConvNextForImageClassification", "ConvNextConfig",
                                     hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1]),
    "hf_vit": lambda: _hf_image("ViTForImageClassification", "ViTConfig", image_size=IMAGE,
                                patch_size=8, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64),
    "hf_resnet": lambda: _hf_image("ResNetForImageClassification", "ResNetConfig",
                                   embedding_size=8, hidden_sizes=[8, 16, 32, 64],
                                   depths=[1, 1, 1, 1]),
    "hf_swin": lambda: _hf_image("SwinForImageClassification", "SwinConfig", image_size=IMAGE,
                                 patch_size=2, embed_dim=8, depths=[2, 2], num_heads=[2, 2],
                                 window_size=4),
    "hf_bert": lambda: _hf_text("BertForSequenceClassification", "BertConfig", classify=True,
                                hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=64),
    "hf_gpt2": lambda: _hf_text("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2,
                                n_head=4, n_positions=64),
    "hf_llama": lambda: _hf_text("LlamaForCausalLM", "LlamaConfig", **_SMALL_LM),
    "hf_mistral": lambda: _hf_text("MistralForCausalLM", "MistralConfig", **_SMALL_LM),
    "hf_t5": _t5,
    "resnet18": lambda: _vision("resnet18"),
    "mobilenet_v3_small": lambda: _vision("mobilenet_v3_small"),
    "efficientnet_b0": lambda: _vision("efficientnet_b0"),
    "convnext_tiny": lambda: _vision("convnext_tiny"),
}  # fmt: skip


def trainer(name: str, **options):
    """``MODELS[name]`` compiled into a training step (R replicas, SGD momentum), and its
    batch."""
    torch.manual_seed(0)
    spec = MODELS[name]()
    model = spec.make()
    opt = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    t = popxl.compile(model, spec.loss, opt, replication_factor=R, **options)
    return t, spec.batch(R * N)


def fallbacks(t) -> dict[str, str]:
    """{fragment: why it runs under vmap} of a trainer's current program (empty: every
    fragment runs explicitly batched)."""
    fns = t.session._executor.fns
    return {name: fn.vmap_reason or "" for name, fn in fns.items() if not fn.explicit}


def vmapped_ops(t) -> list[str]:
    """The ops the explicit fragments run through torch's batching rule one at a time."""
    fns = t.session._executor.fns
    return sorted({op for fn in fns.values() for op in getattr(fn, "vmapped_ops", ())})


def cpu_ms(step: Callable[[], object], rounds: int) -> str:
    for _ in range(2):
        step()
    samples = []
    for _ in range(rounds):
        c0 = time.process_time()
        step()
        samples.append((time.process_time() - c0) * 1e3)
    return f"{statistics.median(samples):.1f} ({min(samples):.1f}-{max(samples):.1f}) ms CPU"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for name in args.models.split(","):
        try:
            t, (x, y) = trainer(name)
            loss = t.step(x, y)
        except Exception as e:  # noqa: BLE001 - a model that does not build is reported
            print(f"{name:20s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            continue
        found, ops = fallbacks(t), vmapped_ops(t)
        line = f"{name:20s} loss {loss:.4f}; "
        line += "; ".join(f"{k} under vmap: {v}" for k, v in found.items()) or "all explicit"
        if ops:
            line += f"; one op at a time through vmap: {', '.join(ops)}"
        if t.explain():
            line += f"; explain: {t.explain()}"
        if args.time:
            line += f"; step {cpu_ms(lambda t=t, x=x, y=y: t.step(x, y), args.rounds)}"
        print(line, flush=True)
        results[name] = (found, ops)
    return results


if __name__ == "__main__":
    main()
