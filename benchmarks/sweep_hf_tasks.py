"""Every model Hugging Face transformers knows for a task, trained through popxl.compile beside
eager torch: transformers does the enumerating (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` for
``--task causal-lm``, the default; ``masked-lm`` and ``seq-cls`` (sequence classification)
likewise).

Each architecture is built offline from its default config made small (the integer sizes it
has among ``SMALL`` set so, its dropout-like probabilities set to 0), checked to run in eager
torch, then trained for two AdamW steps at R=2, GA=2 returning its own loss, beside eager
torch on the same global batches. A model counts as ``ok`` when both steps' losses and the
weights after them agree to 1e-4; ``build`` and ``eager`` are models the shrinking broke
(their configs' own constraints), not this project's failures.

Adam amplifies last-bit gradient differences where a gradient is ~0 (a router's gate under
top-k, an attention key's bias): a weight difference of ~1e-4 with agreeing losses is that
(session 16: cpmant and deepseek_v4, whose gradients after one SGD step agree to 2e-5 of
their largest, and exactly where they are not ~1e-12). Models that draw random numbers in
training under names ``_random`` does not know differ as dropout does.

Usage: ``python benchmarks/sweep_hf_tasks.py [--task causal-lm] [--models llama,mixtral]
[--timeout S] [--out results.jsonl]``; one line per model, a tally at the end.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import signal
import time

import torch

import torch_popxl as popxl

SMALL = {
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "dim": 32, "embed_dim": 32, "n_embed": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2, "num_attention_heads": 2, "n_head": 2, "n_heads": 2,
    "decoder_attention_heads": 2, "encoder_attention_heads": 2, "num_key_value_heads": 1,
    "intermediate_size": 64, "ffn_dim": 64, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64,
    "n_inner": 64, "d_ff": 64, "d_inner": 64, "head_dim": 16, "d_kv": 16, "vocab_size": 128,
    "max_position_embeddings": 64, "n_positions": 64, "num_experts": 4, "n_routed_experts": 4,
    "num_local_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "kv_lora_rank": 16,
    "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "qk_head_dim": 16,
    "v_head_dim": 16, "sliding_window": 16, "rotary_dim": 8, "state_size": 8, "conv_kernel": 4,
    "expand": 2, "n_groups": 1, "mamba_n_heads": 4, "mamba_d_head": 16,
}  # fmt: skip


def _random(key: str) -> bool:
    """Whether a config's float ``key`` is a probability of a random draw in training
    (dropout under any of its names, LayerDrop, a router's jitter): set to 0."""
    return "drop" in key or key.endswith("jitter_noise")


VOCAB = 128


def small_config(name: str):
    """``name``'s default config, made small and deterministic (see the module's text)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(name)
    parts = [config] + [getattr(config, k) for k in ("text_config", "decoder")
                        if hasattr(getattr(config, k, None), "to_dict")]  # fmt: skip
    for part in parts:
        for key, value in SMALL.items():
            old = getattr(part, key, None)
            if isinstance(old, int) and not isinstance(old, bool):
                _set(part, key, value)
        for key, value in part.to_dict().items():
            if _random(key) and isinstance(value, float):
                _set(part, key, 0.0)
        for key in ("layer_types", "mlp_layer_types"):
            if isinstance(getattr(part, key, None), list):
                _set(part, key, getattr(part, key)[:2])
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            token = getattr(part, key, None)
            if isinstance(token, int) and token >= VOCAB:
                _set(part, key, 0 if key == "pad_token_id" else 1)
        if getattr(part, "pad_token_id", 0) is None:  # (a classifier's last-token rule needs it)
            _set(part, "pad_token_id", 0)
    return config


def _batch(task: str, g: torch.Generator, rows: int) -> dict:
    """A batch of ``rows`` sequences of 12 tokens with the task's labels."""
    ids = torch.randint(3, VOCAB, (rows, 12), generator=g)
    if task == "causal-lm":
        return {"input_ids": ids, "labels": ids}
    if task == "masked-lm":  # a third of the positions ignored
        labels = ids.clone()
        labels[:, ::3] = -100
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": torch.randint(0, 2, (rows,), generator=g)}


def _tasks():
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSequenceClassification,
    )
    from transformers.models.auto import modeling_auto as auto

    return {
        "causal-lm": (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, AutoModelForCausalLM),
        "masked-lm": (auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, AutoModelForMaskedLM),
        "seq-cls": (auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                    AutoModelForSequenceClassification),
    }  # fmt: skip


def _set(obj, key: str, value) -> None:
    try:
        setattr(obj, key, value)
    except (AttributeError, TypeError, ValueError):  # a derived property: left as it is
        pass


class _Timeout(BaseException):  # (not caught as a model's own failure)
    pass


def _alarm(*_):
    raise _Timeout


def run(name: str, task: str = "causal-lm") -> dict:
    """Two AdamW steps of ``name``'s ``task`` model compiled (R=2, GA=2) and eager; what
    happened."""
    auto_class = _tasks()[task][1]
    torch.manual_seed(0)
    try:
        config = small_config(name)
        model = auto_class.from_config(config).train()
    except Exception as e:  # noqa: BLE001 - the shrunk config's own constraint
        return {"status": "build", "error": f"{type(e).__name__}: {str(e)[:200]}"}
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    try:
        eager(**_batch(task, g, 2))
    except Exception as e:  # noqa: BLE001
        return {"status": "eager", "error": f"{type(e).__name__}: {str(e)[:200]}"}
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    opt_e = torch.optim.AdamW(eager.parameters(), 1e-3)
    try:
        trainer = popxl.compile(model, None, opt, replication_factor=2, gradient_accumulation=2)
        loss_diff = 0.0
        for _ in range(2):
            batch = _batch(task, g, 8)
            opt_e.zero_grad()
            want = eager(**batch).loss
            want.backward()
            opt_e.step()
            got = trainer.step(batch)
            loss_diff = max(loss_diff, abs(float(got) - want.item()))
        trainer.sync_weights()
    except Exception as e:  # noqa: BLE001 - reported per model
        return {"status": "FAIL", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    weight_diff = max((p - q).abs().max().item()
                      for p, q in zip(model.parameters(), eager.parameters(), strict=True))  # fmt: skip
    ok = loss_diff < 1e-4 and weight_diff < 1e-4
    return {"status": "ok" if ok else "DIFFERS", "loss_diff": loss_diff,
            "weight_diff": weight_diff}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="causal-lm", choices=sorted(_tasks()))
    ap.add_argument("--models", help="comma-separated config names (default: all)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per model (default 120)")
    ap.add_argument("--out", help="also append one JSON line per model to this file")
    args = ap.parse_args()
    names = args.models.split(",") if args.models else sorted(_tasks()[args.task][0])
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    tally: collections.Counter = collections.Counter()
    for name in names:
        start = time.perf_counter()
        signal.alarm(args.timeout)
        try:
            record = run(name, args.task)
        except _Timeout:
            record = {"status": "timeout"}
        finally:
            signal.alarm(0)
        record = {
            "name": name,
            "task": args.task,
            **record,
            "s": round(time.perf_counter() - start, 1),
        }
        tally[record["status"]] += 1
        print(json.dumps(record), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
    print("tally:", dict(tally))


if __name__ == "__main__":
    main()
