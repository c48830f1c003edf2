"""popxl.compile captures what ordinary torch models do (issue 30, item 4).

Each test trains a few SGD steps through ``popxl.compile`` at replication 1/2 and gradient
accumulation 1/2 and compares the losses and weights with eager torch's loop on the same
global batches: Hugging Face GPT-2 with its default config (``use_cache=True``), BERT and T5
built from small configs, ``nn.TransformerEncoder`` given a causal mask (torch's own
data-dependent check on constants is folded at capture time), a module that stores a tensor on
itself in ``forward`` (nothing of the capture is left on it), ``torch.autocast`` regions, and
the RNN family (GRU, LSTM, RNN and their cells). With dropout on, a model is checked to train
(finite losses that go down).

Tolerance: float32 sums in another order (per replica, per micro-batch): rtol 1e-5 / atol 1e-6
on losses and weights after 3 SGD steps; bfloat16 autocast: rtol/atol 2e-2 (one bf16 ulp of
the activations).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from optim_checks import RTOL, train_both

import torch_popxl as popxl

LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]


# ---- Hugging Face models with their default configs --------------------------------------


def gpt2(dropout: float):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                     n_positions=32, resid_pdrop=dropout, embd_pdrop=dropout,
                                     attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)  # fmt: skip
    assert config.use_cache  # the default: the forward builds a DynamicCache
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def token_batches(n=3, size=8, seq=16, vocab=128):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (size, seq), generator=g) for _ in range(n)]


@pytest.mark.parametrize("R,GA", LAYOUTS)
def test_hugging_face_gpt2_default_config_trains_as_eager(R, GA):
    """GPT2LMHeadModel with use_cache=True returning its own loss (loss_fn=None, labels in the
    inputs) trains as eager torch does."""
    model = gpt2(0.0)
    batches = [({"input_ids": ids, "labels": ids}, None) for ids in token_batches()]
    train_both(model, None, batches, R, GA)


def test_hugging_face_gpt2_loss_fn_on_logits_trains_as_eager():
    """The same model with a loss_fn on ``.logits`` (next-token cross entropy)."""
    model = gpt2(0.0)

    def loss_fn(out, ids):
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    train_both(model, loss_fn, [(ids, ids) for ids in token_batches()], 2, 2)


def test_hugging_face_gpt2_with_dropout_trains():
    """Dropout on (the default config): losses are finite and go down on a repeated batch."""
    model = gpt2(0.1)
    trainer = popxl.compile(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    ids = token_batches(1)[0]
    losses = [trainer.step({"input_ids": ids, "labels": ids}) for _ in range(6)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.2, losses


def test_hugging_face_gpt2_outputs_of_a_step_and_inference_match_eager():
    """use_cache=True returns a DynamicCache: the step's outputs (return_outputs=True) and an
    inference program at R=2 give eager's logits, with ``past_key_values`` None (no tensor of
    the capture leaks out). The cache's ``torch.cat`` onto ``torch.tensor([])`` ran into the
    replica dimension before ("Tensors must have same number of dimensions: got 2 and 5")."""
    model = gpt2(0.0)
    ids = token_batches(1)[0]
    trainer = popxl.compile(model, None, torch.optim.SGD(model.parameters(), lr=0.0),
                            replication_factor=2, gradient_accumulation=2,
                            return_outputs=True)  # fmt: skip
    _, out = trainer.step({"input_ids": ids, "labels": ids})
    want = model(input_ids=ids, labels=ids)
    assert out.past_key_values is None
    torch.testing.assert_close(out.logits, want.logits.detach(), rtol=RTOL, atol=1e-5)
    model.eval()
    got = popxl.compile(model, replication_factor=2)(ids)
    assert got.past_key_values is None
    torch.testing.assert_close(got.logits, model(ids).logits.detach(), rtol=RTOL, atol=1e-5)


def bert_or_t5(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64,
                                         max_position_embeddings=32, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)  # fmt: skip
        return transformers.BertForMaskedLM(config)
    config = transformers.T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                   num_heads=2, dropout_rate=0.0,
                                   decoder_start_token_id=0)  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


@pytest.mark.parametrize("R,GA", [(1, 1), (2, 2)])
@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_hugging_face_bert_and_t5_train_as_eager(kind, R, GA):
    """BertForMaskedLM and T5ForConditionalGeneration built from small configs, returning
    their loss (labels -100 not counted). T5's attention mask is its learned relative position
    bias: the attention is captured through the math path, which has its gradient."""
    model = bert_or_t5(kind)
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 128, (8, 12), generator=g)
        labels = ids.clone()
        labels[:, ::3] = -100
        batches.append(({"input_ids": ids, "labels": labels}, None))
    train_both(model, None, batches, R, GA)


_FAMILIES = {  # (config class, model class, size arguments) of a few layers and width 32
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=64,
              num_key_value_heads=2, max_position_embeddings=32)),  # rotary, grouped queries
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=64,
              num_key_value_heads=2, max_position_embeddings=32)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(intermediate_size=64,
                 max_position_embeddings=32)),  # partial rotary
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=32,
            max_position_embeddings=32)),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(intermediate_size=64,
                max_position_embeddings=40)),  # position ids from a cumsum of the mask
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(
        d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=32)),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_hugging_face_model_families_train_as_eager_without_vmap(family):
    """More Hugging Face families from small configs, otherwise their defaults (eval mode: no
    dropout), returning their loss: they train as eager at R=2, GA=2, and every fragment of the
    program runs on stacked values (no vmap: rotary embeddings' slices, RoBERTa's cumsum)."""
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, sizes = _FAMILIES[family]
    if "d_model" not in sizes:
        sizes = dict(sizes, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(vocab_size=128, **sizes)
    model = getattr(transformers, model_cls)(config).eval()
    batches = [({"input_ids": ids + 3, "labels": ids + 3}, None)
               for ids in token_batches(n=2, seq=12, vocab=120)]  # fmt: skip
    trainer = train_both(model, None, batches, 2, 2)
    assert trainer.explain() == []
    for name, fn in trainer.session._executor.fns.items():
        assert fn.explicit, (name, fn.vmap_reason)


def test_hugging_face_t5_with_dropout_trains():
    """T5's default dropout (0.1) on, also inside its attention (the math path's dropout):
    losses are finite and go down on a repeated batch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                   num_heads=2, decoder_start_token_id=0)  # fmt: skip
    assert config.dropout_rate > 0
    model = transformers.T5ForConditionalGeneration(config)
    trainer = popxl.compile(model, None, torch.optim.SGD(model.parameters(), lr=0.5),
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    ids = torch.randint(0, 128, (8, 12), generator=torch.Generator().manual_seed(6))
    losses = [trainer.step({"input_ids": ids, "labels": ids}) for _ in range(6)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.2, losses


# ---- data-dependent checks on constants ----------------------------------------------------


class CausalEncoder(torch.nn.Module):
    """nn.TransformerEncoder given a causal mask without ``is_causal``: torch checks
    ``bool((mask == causal).all())`` on two tensors made from shapes."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.encoder(x, mask=mask))


@pytest.mark.parametrize("R,GA", LAYOUTS)
def test_transformer_encoder_with_causal_mask_trains_as_eager(R, GA):
    torch.manual_seed(0)
    model = CausalEncoder()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 6, 16, generator=g), torch.randn(4, 6, 4, generator=g))
               for _ in range(3)]  # fmt: skip
    train_both(model, F.mse_loss, batches, R, GA)


def test_a_branch_on_a_value_is_specialised_per_value():
    """Folding covers constants only: a branch on an input's value is specialised, a program
    per value (Note [guarded specialisation] in compile_guards.py)."""

    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) if bool(x.sum() > 0) else -self.fc(x)

    g = torch.Generator().manual_seed(0)
    batches = [(sign * torch.rand(4, 4, generator=g), torch.randn(4, 4, generator=g))
               for sign in (1, -1, 1)]  # fmt: skip
    train_both(Branch(), F.mse_loss, batches, 1, 1)


# ---- attributes a module sets on itself ----------------------------------------------------


class Remembers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        y = self.fc(x)
        self.last_mean = y.detach().mean()
        self.calls += 1
        return y


@pytest.mark.parametrize("R,GA", [(1, 1), (2, 2)])
def test_attributes_set_in_forward_keep_their_eager_values(R, GA):
    """Capture leaves no graph tensor on the module: attributes keep the values of the last
    eager forward (or stay absent), and a second compile of the same module trains as eager."""
    torch.manual_seed(0)
    model = Remembers()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    eager_mean = model(x).detach().mean()
    assert model.calls == 1
    train_both(model, F.mse_loss, [(x, y)] * 2, R, GA)
    assert model.calls == 1
    assert type(model.last_mean) is torch.Tensor  # a real tensor, not the capture's
    torch.testing.assert_close(model.last_mean, eager_mean)
    fresh = Remembers()
    train_both(fresh, F.mse_loss, [(x, y)] * 2, R, GA)
    assert not hasattr(fresh, "last_mean") and fresh.calls == 0


# ---- modules converted in their forward (Note [module conversions in captured code]) ------


class ConvertsItself(torch.nn.Module):
    """Converts a layer to a dtype it has already in every forward, as SwitchTransformers'
    router does (``self.classifier = self.classifier.to(self.dtype)``)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.dtype = dtype

    def forward(self, x):
        self.head = self.head.to(self.dtype)
        self.body.float().to(x.device)
        return self.head(torch.relu(self.body(x)))


@pytest.mark.parametrize("R,GA", [(1, 1), (2, 2)])
def test_a_forward_that_converts_its_modules_to_their_own_dtype_trains_as_eager(R, GA):
    """``module.to(dtype)`` / ``.float()`` in the forward changes nothing in eager torch where
    the module has that dtype; captured it trains as eager, and inference runs (was
    "_apply(): Couldn't swap Linear.weight")."""
    torch.manual_seed(0)
    model = ConvertsItself()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    train_both(model, F.mse_loss, batches, R, GA)
    x = batches[0][0]
    with torch.no_grad():
        torch.testing.assert_close(popxl.compile(model, replication_factor=R)(x), model(x),
                                   rtol=RTOL, atol=1e-6)  # fmt: skip


def test_a_forward_that_changes_a_parameters_dtype_is_refused_by_name():
    """``.to(float64)`` of a float32 layer in the forward would convert the module's
    parameter in eager torch (for the steps after too): refused, naming it, nothing changed."""
    model = ConvertsItself(torch.float64)
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(
        ValueError,
        match=r"converts parameter 'weight' of a Linear .*float32.*"
        r"to torch.float64.*before popxl.compile",
    ):
        trainer.step(torch.randn(8, 8), torch.randn(8, 4))
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


class SwitchRouted(torch.nn.Module):
    """Hugging Face SwitchTransformers' top-1 router (it converts its classifier in every
    forward) in front of dense experts: each token's routed expert, scaled by its
    probability, and the router's z-loss."""

    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.SwitchTransformersConfig(d_model=8, num_experts=4,
                                                       expert_capacity=3, router_jitter_noise=0.0)  # fmt: skip
        switch = transformers.models.switch_transformers.modeling_switch_transformers
        self.router = switch.SwitchTransformersTop1Router(config)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        index, probs, logits = self.router(x)
        h = torch.stack([e(x) for e in self.experts], -2)
        z_loss = torch.logsumexp(logits, -1).pow(2).mean()
        return (index.unsqueeze(-1) * h).sum(-2) * probs, z_loss


@pytest.mark.parametrize("R,GA", [(1, 1), (2, 2)])
def test_switch_transformers_router_trains_as_eager(R, GA):
    """The router's ``self.classifier = self.classifier.to(self.dtype)`` (was "_apply():
    Couldn't swap Linear.weight"), its capacity mask and z-loss train as eager."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 6, 8, generator=g), torch.randn(8, 6, 8, generator=g))
               for _ in range(3)]  # fmt: skip

    def loss_fn(out, y):
        return F.mse_loss(out[0], y) + 0.01 * out[1]

    train_both(SwitchRouted(), loss_fn, batches, R, GA)


# ---- autocast --------------------------------------------------------------------------------


class AutocastCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(4, 3),
        )  # fmt: skip

    def forward(self, x):
        with torch.autocast("cpu", torch.bfloat16):
            return self.body(x)


@pytest.mark.parametrize("R,GA", [(1, 1), (2, 1)])
def test_autocast_bf16_conv_batchnorm_pool_trains_as_eager(R, GA):
    """Autocast regions are captured as they run. With R replicas batch norm keeps per-replica
    statistics (as DDP does), so the eager reference runs each replica's rows separately and
    sums their equally weighted losses."""
    torch.manual_seed(0)
    model = AutocastCNN()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(3)]  # fmt: skip
    eager = copy.deepcopy(model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    trainer = popxl.compile(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                            replication_factor=R, gradient_accumulation=GA)  # fmt: skip
    for x, y in batches:
        opt_e.zero_grad()
        want = sum(F.cross_entropy(eager(xs), ys) for xs, ys in
                   zip(x.chunk(R), y.chunk(R), strict=True)) / R  # fmt: skip
        want.backward()
        opt_e.step()
        got = trainer.step(x, y)
        torch.testing.assert_close(torch.tensor(float(got)), want.detach().float(), rtol=2e-2,
                                   atol=2e-2)  # fmt: skip
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-2, atol=2e-2)


# ---- the RNN family --------------------------------------------------------------------------


class Recurrent(torch.nn.Module):
    """A recurrent layer over (batch, time, features), its last step classified. Cells are
    unrolled over the time steps in Python, as their users write it."""

    def __init__(self, kind: str):
        super().__init__()
        layer = getattr(torch.nn, kind)
        self.cell = kind.endswith("Cell")
        self.rnn = layer(8, 16) if self.cell else layer(8, 16, batch_first=True, num_layers=2)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        if not self.cell:
            return self.head(self.rnn(x)[0][:, -1])
        h = None
        for t in range(x.shape[1]):
            h = self.rnn(x[:, t], h)
        return self.head(h[0] if isinstance(h, tuple) else h)


@pytest.mark.parametrize("R,GA", [(1, 1), (2, 2)])
@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN", "GRUCell", "LSTMCell", "RNNCell"])
def test_rnn_family_trains_as_eager(kind, R, GA):
    """nn.GRU / GRUCell (autograd copies an input before an in-place op: the copy becomes a
    forward op), nn.LSTM (oneDNN's kernel is not captured: its cell's ops are), nn.RNN and the
    cells train as eager torch does."""
    torch.manual_seed(0)
    model = Recurrent(kind)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 5, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(3)]  # fmt: skip
    train_both(model, F.cross_entropy, batches, R, GA)


class SpatialTransformer(torch.nn.Module):
    """A spatial transformer: a predicted affine grid samples the input (``grid_sample``'s
    backward gives the grid's gradient only, its input gradient left out: None)."""

    def __init__(self):
        super().__init__()
        self.theta, self.head = torch.nn.Linear(48, 6), torch.nn.Linear(48, 4)

    def forward(self, x):
        theta = self.theta(x.flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.head(F.grid_sample(x, grid, align_corners=False).flatten(1))


@pytest.mark.parametrize("R,GA", [(1, 1), (2, 2)])
def test_spatial_transformer_grid_sample_trains_as_eager(R, GA):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 3, 4, 4, generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(3)]  # fmt: skip
    train_both(SpatialTransformer(), F.cross_entropy, batches, R, GA, rtol=1e-4, atol=1e-5)


class SparseEmbeddings(torch.nn.Module):
    def __init__(self, bag: bool):
        super().__init__()
        self.bag = bag
        self.emb = (torch.nn.EmbeddingBag(20, 8, mode="mean", sparse=True) if bag
                    else torch.nn.Embedding(20, 8, sparse=True))  # fmt: skip
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.emb(x) if self.bag else self.emb(x).mean(1))


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # eager Adagrad's, on sparse grads
@pytest.mark.parametrize("bag", [False, True])
@pytest.mark.parametrize(
    "optimizer",
    [torch.optim.SGD, lambda ps, lr: torch.optim.SGD(ps, lr, momentum=0.9), torch.optim.Adagrad],
    ids=["sgd", "momentum", "adagrad"],
)
def test_sparse_embeddings_train_as_eager_with_dense_gradients(bag, optimizer):
    """Note [sparse embedding gradients]: eager's sparse gradient and the program's dense one
    (zeros in the rows not looked up) give every optimizer that takes sparse gradients the
    same updates."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 20, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(3)]  # fmt: skip
    train_both(SparseEmbeddings(bag), F.cross_entropy, batches, 2, 2, optimizer=optimizer)


class DistributionVAE(torch.nn.Module):
    """A VAE whose posterior is a ``torch.distributions.Normal`` (checked arguments by default,
    Note [argument checks of torch.distributions]) with its KL to the prior."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = torch.nn.Linear(12, 8), torch.nn.Linear(4, 12)

    def forward(self, x):
        mu, log_std = self.enc(x).chunk(2, dim=-1)
        posterior = torch.distributions.Normal(mu, log_std.exp())
        prior = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
        kl = torch.distributions.kl_divergence(posterior, prior).sum(-1)
        return self.dec(posterior.mean), kl


def vae_loss(out, x):
    recon, kl = out
    return F.mse_loss(recon, x, reduction="sum") + kl.sum()


class Policy(torch.nn.Module):
    """A policy-gradient step: log-probabilities and entropy of a ``Categorical``."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Linear(6, 4)

    def forward(self, x):
        actions = torch.distributions.Categorical(logits=self.logits(x))
        taken = (x[:, 0] > 0).long()  # the actions the episode took
        return actions.log_prob(taken), actions.entropy()


def policy_loss(out, advantage):
    log_prob, entropy = out
    return -(log_prob * advantage).mean() - 0.01 * entropy.mean()


@pytest.mark.parametrize("R,GA", [(1, 1), (2, 2)])
def test_torch_distributions_in_a_forward_train_as_eager(R, GA):
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(0)
    data = [(x := torch.randn(8, 12, generator=g), x) for _ in range(3)]
    train_both(DistributionVAE(), vae_loss, data, R, GA, lr=1e-3, rtol=1e-4, atol=1e-5)
    torch.manual_seed(0)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, generator=g)) for _ in range(3)]
    train_both(Policy(), policy_loss, data, R, GA, rtol=1e-4, atol=1e-5)
    # the checks are back on after capture
    assert torch.distributions.Distribution._validate_args
    with pytest.raises(ValueError, match="scale"):
        torch.distributions.Normal(torch.zeros(2), -torch.ones(2))
