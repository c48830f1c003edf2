"""Hugging Face model families through popxl.compile with AdamW (issue: generality on HF).

Each family is built from a small config (2 layers, width 32, vocabulary 128; its defaults
otherwise, dropout off for the value comparison), never downloaded, and trained at R=2, GA=2
returning its own loss (``loss_fn=None``: the inputs are the forward's keywords) beside eager
torch on the same global batches: every step's loss and the weights at the end agree.
GPT-2, BERT, T5, LLaMA, Qwen2, GPT-NeoX, OPT, RoBERTa and BART (SGD) are in
test_compile_capture_models.py. With their default dropout on, each family trains with
finite losses.

Tolerance: rtol 1e-4 / atol 1e-5 after two AdamW steps (lr 1e-3): float32 sums in another
order (per replica, per micro-batch), and Adam's ``m / sqrt(v)`` turns a gradient's last-bit
difference into an update's where the gradient is tiny.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from optim_checks import train_both

import torch_popxl as popxl
from torch_popxl.errors import DataDependentError

transformers = pytest.importorskip("transformers")

RTOL, ATOL = 1e-4, 1e-5
VOCAB = 128
_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
_NO_DROPOUT = {  # each family's own names for its dropout probabilities
    "gpt_neo": ("embed_dropout", "attention_dropout", "resid_dropout"),
    "gptj": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "gpt_bigcode": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "falcon": ("hidden_dropout", "attention_dropout"),
    "mbart": ("dropout", "attention_dropout", "activation_dropout"),
    "whisper": ("dropout", "attention_dropout", "activation_dropout"),
    "xlnet": ("dropout",),
    "deberta_v2": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "bigbird": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "vit": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "wav2vec2": ("hidden_dropout", "attention_dropout", "activation_dropout",
                 "feat_proj_dropout", "final_dropout"),
}  # fmt: skip


def _config(family: str):
    T = transformers
    seq = dict(max_position_embeddings=32)
    return {
        "mistral": lambda: T.MistralConfig(vocab_size=VOCAB, num_key_value_heads=1,
                                           sliding_window=8, **seq, **_SIZES),
        # mixtures of experts: torch._grouped_mm over the routed tokens (Note [a meta kernel
        # stricter than the kernel] in torch_popxl/ir/fake.py)
        "mixtral": lambda: T.MixtralConfig(vocab_size=VOCAB, num_key_value_heads=1,
                                           num_local_experts=4, num_experts_per_tok=2, **seq,
                                           **_SIZES),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(vocab_size=VOCAB, num_key_value_heads=1,
                                              head_dim=16, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, **seq, **_SIZES),
        "gpt_neo": lambda: T.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2,
                                          num_heads=2, attention_types=[[["global", "local"], 1]],
                                          window_size=8, **seq),
        "gptj": lambda: T.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2,
                                     rotary_dim=8, n_positions=32),
        "gpt_bigcode": lambda: T.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=2,
                                                  n_head=2, n_positions=32),  # multi-query
        "falcon": lambda: T.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2),
        "mamba": lambda: T.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                       state_size=8),  # the selective scan's slow path
        "mbart": lambda: T.MBartConfig(vocab_size=VOCAB, d_model=32, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, encoder_layers=2, decoder_layers=2,
                                       encoder_attention_heads=2, decoder_attention_heads=2, **seq),
        "xlnet": lambda: T.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=2,
                                       d_inner=64),
        "deberta_v2": lambda: T.DebertaV2Config(vocab_size=VOCAB, **seq, **_SIZES),
        "bigbird": lambda: T.BigBirdConfig(vocab_size=VOCAB, attention_type="original_full",
                                           **seq, **_SIZES),
        "vit": lambda: T.ViTConfig(image_size=16, patch_size=4, num_labels=5, **_SIZES),
        "whisper": lambda: T.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
        "wav2vec2": lambda: T.Wav2Vec2Config(  # conv front end, group norm, weight-normed conv
            vocab_size=32, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=3,
            classifier_proj_size=16, **_SIZES),
    }[family]()  # fmt: skip


_MODEL = {
    "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_neo": "GPTNeoForCausalLM", "gptj": "GPTJForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM", "falcon": "FalconForCausalLM",
    "mamba": "MambaForCausalLM", "mbart": "MBartForConditionalGeneration",
    "xlnet": "XLNetLMHeadModel", "deberta_v2": "DebertaV2ForMaskedLM",
    "bigbird": "BigBirdForMaskedLM", "vit": "ViTForImageClassification",
    "whisper": "WhisperForConditionalGeneration",
    "wav2vec2": "Wav2Vec2ForSequenceClassification",
}  # fmt: skip


def build(family: str, dropout: bool):
    config = _config(family)
    if not dropout:
        for name in _NO_DROPOUT.get(family, ()):
            setattr(config, name, 0.0)
        if family == "wav2vec2":  # LayerDrop and SpecAugment draw on the host
            config.layerdrop, config.mask_time_prob = 0.0, 0.0
    torch.manual_seed(0)
    return getattr(transformers, _MODEL[family])(config)


def batches(family: str, n: int = 2) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (8, 12), generator=g)
        if family == "vit":
            x = {"pixel_values": torch.randn(8, 3, 16, 16, generator=g),
                 "labels": torch.randint(0, 5, (8,), generator=g)}  # fmt: skip
        elif family == "whisper":
            x = {"input_features": torch.randn(8, 8, 16, generator=g), "labels": ids[:, :6]}
        elif family == "wav2vec2":
            x = {"input_values": torch.randn(8, 400, generator=g),
                 "labels": torch.randint(0, 3, (8,), generator=g)}  # fmt: skip
        elif family in ("deberta_v2", "bigbird"):  # masked LM: a third of the tokens ignored
            labels = ids.clone()
            labels[:, ::3] = -100
            x = {"input_ids": ids, "labels": labels}
        else:
            x = {"input_ids": ids, "labels": ids}
        out.append((x, None))
    return out


@pytest.mark.parametrize("family", sorted(_MODEL))
def test_hugging_face_family_trains_as_eager_with_adamw(family):
    """The family's loss at every step and its weights after two AdamW steps at R=2, GA=2
    equal eager torch's on the global batch; every fragment runs on the fast path
    (``explain()`` is empty: wav2vec2's weight-norm gradient ran once per replica before)."""
    trainer = train_both(build(family, dropout=False), None, batches(family), 2, 2,
                         optimizer=torch.optim.AdamW, lr=1e-3, rtol=RTOL, atol=ATOL)  # fmt: skip
    assert trainer.explain() == []


@pytest.mark.parametrize("family", ["mistral", "mixtral", "whisper", "wav2vec2"])
def test_hugging_face_family_trains_as_eager_with_sharded_remote_adamw(family):
    """The same with replicated tensor sharding (every tensor of 16 elements or more) and
    the optimizer state in remote buffers."""
    train_both(build(family, dropout=False), None, batches(family), 2, 2,
               optimizer=torch.optim.AdamW, lr=1e-3, rtol=RTOL, atol=ATOL, rts_threshold=16,
               optimizer_state="remote")  # fmt: skip


@pytest.mark.parametrize("family", sorted(set(_MODEL) - {"wav2vec2"}))
def test_hugging_face_family_with_default_dropout_trains(family):
    """Default dropout on: the losses are finite and go down on a repeated batch."""
    model = build(family, dropout=True)
    trainer = popxl.compile(model, None, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    inputs = batches(family, 1)[0][0]
    losses = [trainer.step(inputs) for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses


def clip():
    T = transformers
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 dropout=0.0, attention_dropout=0.0)  # fmt: skip
    config = T.CLIPConfig(text_config=dict(vocab_size=VOCAB, max_position_embeddings=16,
                                           bos_token_id=0, eos_token_id=2, pad_token_id=1,
                                           **sizes),
                          vision_config=dict(image_size=16, patch_size=4, **sizes),
                          projection_dim=16)  # fmt: skip
    torch.manual_seed(0)
    return T.CLIPModel(config)


def test_hugging_face_clip_trains_as_eager_and_its_contrastive_loss_is_not_split():
    """CLIPModel with ``return_loss=True`` among its inputs (a keyword option: Note [keyword
    options]) trains as eager at R=1; its loss pairs every text of the batch with every
    image, so no micro-batch parts add up to it and R=2 is refused when the program is built."""
    g = torch.Generator().manual_seed(2)
    data = [({"input_ids": torch.randint(3, VOCAB, (8, 10), generator=g),
              "pixel_values": torch.randn(8, 3, 16, 16, generator=g), "return_loss": True}, None)
            for _ in range(2)]  # fmt: skip
    train_both(clip(), None, data, 1, 1, optimizer=torch.optim.AdamW, lr=1e-3, rtol=RTOL,
               atol=ATOL)  # fmt: skip
    model = clip()
    split = popxl.compile(model, None, torch.optim.AdamW(model.parameters()), replication_factor=2)
    with pytest.raises(ValueError, match="pairs the samples of the batch with each other"):
        split.plan(data[0][0])


def test_hugging_face_wav2vec2_ctc_head_trains_as_eager_with_a_ctc_loss_fn():
    """Wav2Vec2ForCTC's logits under ``F.ctc_loss`` with int lengths (Note [CTC loss in a captured graph])
    train as eager at R=2, GA=2 on the fast path. Its own loss (``labels=``) stays refused: it
    checks ``labels.max()`` and selects the labels by a mask of their values."""
    model = build("wav2vec2", dropout=False)
    model = transformers.Wav2Vec2ForCTC(model.config)

    def ctc(out, labels):
        log_probs = out.logits.log_softmax(-1).transpose(0, 1)
        n = labels.shape[0]
        lengths = ((log_probs.shape[0],) * n, (labels.shape[1],) * n)
        return F.ctc_loss(log_probs, labels, *lengths, reduction="none").mean() / labels.shape[1]

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 400, generator=g), torch.randint(1, 32, (8, 6), generator=g))
            for _ in range(2)]  # fmt: skip
    trainer = train_both(model, ctc, data, 2, 2, optimizer=torch.optim.AdamW, lr=1e-3,
                         rtol=RTOL, atol=ATOL)  # fmt: skip
    assert trainer.explain() == []
    own = popxl.compile(model, None, torch.optim.AdamW(model.parameters()), replication_factor=2)
    with pytest.raises(DataDependentError):
        own.plan({"input_values": data[0][0], "labels": data[0][1]})
