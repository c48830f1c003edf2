"""More public example training scripts ported to popxl.compile by replacing only the step.

Each test writes the loop of a pytorch/examples script (word_language_model's LSTM/GRU with
its hidden state carried and detached across batches, mnist_rnn, siamese_network,
super_resolution, fast_neural_style, a ViT with AdamW and a warmup-cosine LambdaLR, a dense
GCN, gat, language_translation, mnist_forward_forward, dcgan) at a tiny size, once with the eager step
(``zero_grad / backward / [clip] / step``) and once with ``trainer.step``, on the same
synthetic data, and compares the printed losses of every step and the weights at the end.

Tolerances: float32 sums in another order (replicas and micro-batches add in another order):
losses rtol 1e-5, weights rtol 1e-4 / atol 1e-5, unless a test says otherwise.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_compile_ported_examples import _eager_step

import torch_popxl as popxl

R, GA = 2, 2


def _same_weights(a, b, atol=1e-5):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=atol, msg=name)


def _batches(x, y, batch):
    """A DataLoader(shuffle=False, drop_last=False) over tensors (or tuples of them)."""
    n = (x[0] if isinstance(x, tuple) else x).shape[0]
    for i in range(0, n, batch):
        xb = tuple(t[i : i + batch] for t in x) if isinstance(x, tuple) else x[i : i + batch]
        yield xb, y[i : i + batch]


def _compare(run, rtol=1e-5, atol=1e-5):
    """``run(compiled)`` returns (model, printed values); both runs print the same values and
    end with the same weights."""
    eager, want = run(False)
    ported, got = run(True)
    assert len(got) == len(want) > 1
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-7)
    _same_weights(ported, eager, atol=atol)
    return got


# ---- word_language_model: RNN LM, hidden state carried and detached, tied weights, clipping,
# ---- SGD with the learning rate divided by 4 when validation does not improve ---------------


class RNNModel(torch.nn.Module):
    """The example's RNNModel: time-major (tokens as (seq, batch)), states (layers, batch,
    hidden), the decoder tied to the encoder."""

    def __init__(self, kind="LSTM", ntoken=30, ninp=16, nhid=16, nlayers=2):
        super().__init__()
        self.encoder = torch.nn.Embedding(ntoken, ninp)
        self.rnn = getattr(torch.nn, kind)(ninp, nhid, nlayers)
        self.decoder = torch.nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight  # tied
        self.kind, self.nhid, self.nlayers = kind, nhid, nlayers

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return F.log_softmax(self.decoder(output), dim=-1), hidden

    def init_hidden(self, bsz, batch_first=False):
        shape = (bsz, self.nlayers, self.nhid) if batch_first else (self.nlayers, bsz, self.nhid)
        z = torch.zeros(shape)
        return (z, z.clone()) if self.kind == "LSTM" else z


class BatchFirst(torch.nn.Module):
    """The same module on batch-first tensors, so that replicas and micro-batches cut the batch
    (dim 0): docs/compile.md 'Structured inputs and time-major models'."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input, hidden):
        swap = lambda h: h.transpose(0, 1).contiguous()  # noqa: E731
        hidden = tuple(map(swap, hidden)) if isinstance(hidden, tuple) else swap(hidden)
        output, hidden = self.inner(input.t(), hidden)
        hidden = tuple(map(swap, hidden)) if isinstance(hidden, tuple) else swap(hidden)
        return output.transpose(0, 1), hidden


def _repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(_repackage_hidden(v) for v in h)


def _lm_criterion(output, targets):
    logp = output[0]
    return F.nll_loss(logp.reshape(-1, logp.shape[-1]), targets.reshape(-1))


def _batchify(data, bsz):
    n = data.size(0) // bsz
    return data[: n * bsz].view(bsz, -1).t().contiguous()  # (seq, batch), as the example


def _run_word_lm(compiled: bool, kind: str, batch_first: bool):
    torch.manual_seed(0)
    model = RNNModel(kind)
    net = BatchFirst(model) if batch_first else model
    lr, clip, bptt, bsz = 5.0, 0.25, 5, 4
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # the example's p.data.add_(p.grad, -lr)
    g = torch.Generator().manual_seed(5)
    train_data = _batchify(torch.randint(0, 30, (4 * 23,), generator=g), bsz)  # (23, 4)
    val_data = _batchify(torch.randint(0, 30, (4 * 11,), generator=g), bsz)
    if compiled:
        trainer = popxl.compile(net, _lm_criterion, opt, max_grad_norm=clip, return_outputs=True,
                                **({"replication_factor": R, "gradient_accumulation": GA}
                                   if batch_first else {}))  # fmt: skip
    printed, best_val = [], None

    def get_batch(source, i):
        seq_len = min(bptt, len(source) - 1 - i)  # the last one is short
        data, target = source[i : i + seq_len], source[i + 1 : i + 1 + seq_len]
        return (data.t().contiguous(), target.t().contiguous()) if batch_first else (data, target)

    def evaluate(source):
        net.eval()
        total, hidden = 0.0, model.init_hidden(bsz, batch_first)
        with torch.no_grad():
            for i in range(0, source.size(0) - 1, bptt):
                data, targets = get_batch(source, i)
                output, hidden = net(data, hidden)
                total += len(data if not batch_first else data.t()) * float(
                    _lm_criterion((output, hidden), targets)
                )
        return total / (len(source) - 1)

    for _epoch in range(2):
        net.train()
        hidden = model.init_hidden(bsz, batch_first)
        for i in range(0, train_data.size(0) - 1, bptt):
            data, targets = get_batch(train_data, i)
            hidden = _repackage_hidden(hidden)  # truncated backpropagation through time
            if compiled:
                loss, (_, hidden) = trainer.step((data, hidden), targets)
            else:
                model.zero_grad()
                output, hidden = net(data, hidden)
                loss = _lm_criterion((output, hidden), targets)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                loss = loss.item()
            printed.append(loss)
        val_loss = evaluate(val_data)
        printed.append(val_loss)
        if best_val is None or val_loss < best_val:
            best_val = val_loss
        else:  # anneal
            for group in opt.param_groups:
                group["lr"] /= 4.0
        for group in opt.param_groups:  # and here every epoch, so that it certainly happens
            group["lr"] /= 2.0
    return model, printed


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_word_language_model_rnn_time_major_with_carried_hidden_prints_eager_losses(kind):
    """As written: (seq, batch) tokens and an (h, c) tuple state carried across steps (a step's
    nested inputs, Note [nested inputs]); one replica, no accumulation, so nothing is cut."""
    losses = _compare(lambda c: _run_word_lm(c, kind, batch_first=False))
    assert len(losses) == 2 * (5 + 1)  # 5 bptt windows (the last short) and validation


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_word_language_model_batch_first_wrapper_trains_on_replicas_as_eager(kind):
    _compare(lambda c: _run_word_lm(c, kind, batch_first=True))


def test_a_time_major_batch_on_replicas_is_refused_with_the_way_out():
    torch.manual_seed(0)
    model = RNNModel()
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, _lm_criterion, torch.optim.SGD(model.parameters(), lr=1.0),
                            replication_factor=2)  # fmt: skip
    data = torch.randint(0, 30, (5, 4))
    advice = r"got \[5, 2, 2, 5\].*batch-first.*time-major models'\)\. Nothing was changed"
    with pytest.raises(ValueError, match=advice):
        trainer.step((data, model.init_hidden(4)), data)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---- mnist_rnn: an LSTM over image rows, the last step's output classified, StepLR -----------


class RowLSTM(torch.nn.Module):
    def __init__(self, batchnorm: bool):
        super().__init__()
        self.rnn = torch.nn.LSTM(input_size=8, hidden_size=16, batch_first=True)
        self.batchnorm = torch.nn.BatchNorm1d(16) if batchnorm else torch.nn.Identity()
        self.dropout1, self.dropout2 = torch.nn.Dropout(0.0), torch.nn.Dropout(0.0)  # off
        self.fc1, self.fc2 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 10)

    def forward(self, input):
        output, _hidden = self.rnn(input.reshape(-1, 8, 8))  # rows as the sequence
        x = self.dropout1(self.batchnorm(output[:, -1, :]))
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def _run_mnist_rnn(compiled: bool, batchnorm: bool):
    torch.manual_seed(0)
    model = RowLSTM(batchnorm)
    # batch norm over the global batch, as eager: one replica, no accumulation (with several,
    # the statistics are per replica: the ResNet-18 test of test_compile_ported_examples.py)
    r, ga = (1, 1) if batchnorm else (R, GA)
    opt = torch.optim.Adadelta(model.parameters(), lr=0.1, eps=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 10, (40,), generator=g)
    step = (popxl.compile(model, F.nll_loss, opt, replication_factor=r, gradient_accumulation=ga).step
            if compiled else _eager_step(model, opt, F.nll_loss))  # fmt: skip
    printed = []
    for _epoch in range(2):
        model.train()
        printed += [float(step(xb, yb)) for xb, yb in _batches(x, y, 16)]  # 16, 16, 8
        model.eval()
        with torch.no_grad():  # test(): the model's own forward, summed loss and accuracy
            out = model(x[:24])
            printed.append(float(F.nll_loss(out, y[:24], reduction="sum")))
            printed.append(float((out.argmax(1) == y[:24]).sum()))
        scheduler.step()
    return model, printed


@pytest.mark.parametrize("batchnorm", [False, True])
def test_mnist_rnn_lstm_classifier_prints_eager_losses(batchnorm):
    _compare(lambda c: _run_mnist_rnn(c, batchnorm))


# ---- siamese_network: two images through one tower, a sigmoid head, BCELoss ---------------


class Siamese(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(),
                                         torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten())  # fmt: skip
        self.fc = torch.nn.Sequential(
            torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        self.sigmoid = torch.nn.Sigmoid()

    def forward(self, input1, input2):
        both = torch.cat((self.tower(input1), self.tower(input2)), 1)
        return self.sigmoid(self.fc(both))


def _run_siamese(compiled: bool):
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0, eps=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(40, 1, 8, 8, generator=g), torch.randn(40, 1, 8, 8, generator=g)
    same = torch.randint(0, 2, (40, 1), generator=g).float()
    criterion = torch.nn.BCELoss()
    step = (popxl.compile(model, criterion, opt, replication_factor=R, gradient_accumulation=GA).step
            if compiled else _eager_step(model, opt, criterion))  # fmt: skip
    printed = []
    for _epoch in range(2):
        model.train()
        printed += [float(step(xb, yb)) for xb, yb in _batches((a, b), same, 16)]
        model.eval()
        with torch.no_grad():
            out = model(a[:8], b[:8])
            printed.append(float(criterion(out, same[:8])))
            printed.append(float((torch.where(out > 0.5, 1, 0) == same[:8]).sum()))
        scheduler.step()
    return model, printed


def test_siamese_network_pairs_with_bce_on_a_sigmoid_prints_eager_losses():
    _compare(_run_siamese)


# ---- super_resolution: sub-pixel convolution (PixelShuffle), MSE, Adam, PSNR --------------


class SuperResolution(torch.nn.Module):
    def __init__(self, upscale=2):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 5, padding=2)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = torch.nn.Conv2d(8, upscale**2, 3, padding=1)
        self.pixel_shuffle = torch.nn.PixelShuffle(upscale)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.pixel_shuffle(self.conv3(x))


def _run_super_resolution(compiled: bool, reduction: str):
    torch.manual_seed(0)
    model = SuperResolution()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    g = torch.Generator().manual_seed(8)
    high = torch.rand(24, 1, 8, 8, generator=g)
    low = F.avg_pool2d(high, 2)
    criterion = torch.nn.MSELoss(reduction=reduction)  # a sum: the global batch's sum
    step = (popxl.compile(model, criterion, opt, replication_factor=R, gradient_accumulation=GA).step
            if compiled else _eager_step(model, opt, criterion))  # fmt: skip
    printed = []
    for _epoch in range(2):
        printed += [float(step(xb, yb)) for xb, yb in _batches(low, high, 8)]
        with torch.no_grad():  # test(): the average PSNR
            mse = F.mse_loss(model(low[:8]), high[:8])
            printed.append(10 * math.log10(1 / mse.item()))
    return model, printed


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_super_resolution_with_pixel_shuffle_and_mse_prints_eager_losses(reduction):
    _compare(lambda c: _run_super_resolution(c, reduction))


# ---- fast_neural_style: a frozen feature network, content + gram-matrix style losses ------


def _gram_matrix(y):
    b, ch, h, w = y.size()
    features = y.view(b, ch, w * h)
    return features.bmm(features.transpose(1, 2)) / (ch * h * w)


class Vgg(torch.nn.Module):
    """The frozen loss network (the example's VGG16 slices): two feature maps."""

    def __init__(self):
        super().__init__()
        self.slice1 = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU())
        self.slice2 = torch.nn.Sequential(torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 8, 3, padding=1),
                                          torch.nn.ReLU())  # fmt: skip
        self.requires_grad_(False)

    def forward(self, x):
        h1 = self.slice1(x)
        return h1, self.slice2(h1)


class TransformerNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect")
        self.in1 = torch.nn.InstanceNorm2d(8, affine=True)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
        self.in2 = torch.nn.InstanceNorm2d(8, affine=True)
        self.up = torch.nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.in1(self.conv1(x)))
        y = y + torch.relu(self.in2(self.conv2(y)))  # a residual block
        return self.up(y)


def _run_fast_neural_style(compiled: bool):
    torch.manual_seed(0)
    transformer, vgg = TransformerNet(), Vgg()
    opt = torch.optim.Adam(transformer.parameters(), lr=1e-2, eps=1e-4)
    g = torch.Generator().manual_seed(9)
    images, style = torch.rand(16, 3, 8, 8, generator=g), torch.rand(1, 3, 8, 8, generator=g)
    gram_style = [_gram_matrix(f) for f in vgg(style)]  # computed once, as the example
    content_weight, style_weight = 1.0, 10.0

    def criterion(y, x):
        features_y, features_x = vgg(y), vgg(x)
        content_loss = content_weight * F.mse_loss(features_y[1], features_x[1])
        style_loss = 0.0
        for ft_y, gm_s in zip(features_y, gram_style, strict=True):
            gm_y = _gram_matrix(ft_y)
            style_loss = style_loss + F.mse_loss(gm_y, gm_s.expand_as(gm_y))
        return content_loss + style_weight * style_loss

    step = (popxl.compile(transformer, criterion, opt, replication_factor=R,
                          gradient_accumulation=GA).step
            if compiled else _eager_step(transformer, opt, criterion))  # fmt: skip
    before = copy.deepcopy(vgg.state_dict())
    printed = [float(step(xb, xb)) for _ in range(2) for xb, _ in _batches(images, images, 8)]
    for k, v in vgg.state_dict().items():  # the loss network is never trained
        assert torch.equal(v, before[k]), k
    return transformer, printed


def test_fast_neural_style_with_a_frozen_loss_network_and_gram_matrices_prints_eager_losses():
    _compare(_run_fast_neural_style)


# ---- vision_transformer: patches, a class token, AdamW, linear warmup + cosine (LambdaLR) ----


class ViT(torch.nn.Module):
    def __init__(self, image=8, patch=4, dim=16, depth=2, heads=2, classes=10):
        super().__init__()
        self.patch = patch
        n = (image // patch) ** 2
        self.to_patch = torch.nn.Linear(3 * patch * patch, dim)
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embedding = torch.nn.Parameter(torch.randn(1, n + 1, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0,
                                                 batch_first=True, norm_first=True)  # fmt: skip
        self.transformer = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, classes))

    def forward(self, img):
        b, p = img.shape[0], self.patch
        patches = img.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5)
        x = self.to_patch(patches.reshape(b, -1, 3 * p * p))
        x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1) + self.pos_embedding
        return self.head(self.transformer(x)[:, 0])


def _run_vit(compiled: bool):
    torch.manual_seed(0)
    model = ViT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, eps=1e-4)
    warmup, total = 2, 6

    def lr_lambda(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(24, 3, 8, 8, generator=g), torch.randint(0, 10, (24,), generator=g)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    step = (popxl.compile(model, criterion, opt, replication_factor=R, gradient_accumulation=GA).step
            if compiled else _eager_step(model, opt, criterion))  # fmt: skip
    printed = []
    for _epoch in range(2):
        model.train()
        for xb, yb in _batches(x, y, 8):
            printed.append(float(step(xb, yb)))
            scheduler.step()  # per iteration
        model.eval()
        with torch.no_grad():
            printed.append(float((model(x[:8]).argmax(1) == y[:8]).sum()))
    return model, printed


def test_vision_transformer_with_adamw_and_warmup_cosine_lambdalr_prints_eager_losses():
    _compare(_run_vit)


# ---- gcn: a dense normalised adjacency, full-batch node classification on a train mask ----


class GCN(torch.nn.Module):
    def __init__(self, features=8, hidden=16, classes=4):
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(features, hidden), torch.nn.Linear(hidden, classes)

    def forward(self, x, adj):
        x = F.relu(adj @ self.w1(x))
        return F.log_softmax(adj @ self.w2(x), dim=1)


def _run_gcn(compiled: bool):
    torch.manual_seed(0)
    model = GCN()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4, eps=1e-4)
    g = torch.Generator().manual_seed(11)
    nodes = 20
    x, labels = torch.randn(nodes, 8, generator=g), torch.randint(0, 4, (nodes,), generator=g)
    a = (torch.rand(nodes, nodes, generator=g) < 0.2).float()
    a = ((a + a.t()) > 0).float() + torch.eye(nodes)
    d = a.sum(1).rsqrt()
    adj = d[:, None] * a * d[None, :]  # D^-1/2 (A + I) D^-1/2
    train_mask = torch.arange(nodes) < 12
    target = torch.where(train_mask, labels, -100)  # the train nodes only

    def criterion(out, t):
        return F.nll_loss(out, t, ignore_index=-100)

    # the whole graph is one sample: one replica, no accumulation (rows mix through adj)
    step = (popxl.compile(model, criterion, opt).step if compiled
            else _eager_step(model, opt, criterion))  # fmt: skip
    printed = []
    for _epoch in range(5):
        model.train()
        printed.append(float(step((x, adj), target)))
        model.eval()
        with torch.no_grad():
            out = model(x, adj)
            printed.append(float(F.nll_loss(out[~train_mask], labels[~train_mask])))
    return model, printed


def test_gcn_with_a_dense_adjacency_and_a_train_mask_prints_eager_losses():
    _compare(_run_gcn)


# ---- gat: graph attention, heads averaged or concatenated, edges masked, a train index ------


class GraphAttention(torch.nn.Module):
    """The example's layer: shared W, per-head attention vector a, scores for every pair of
    nodes, non-edges set to -9e16 before the softmax over neighbours."""

    def __init__(self, inputs, outputs, heads, concat=False, dropout=0.0, slope=0.2):
        super().__init__()
        self.heads, self.concat, self.dropout = heads, concat, dropout
        self.hidden = outputs // heads if concat else outputs
        self.W = torch.nn.Parameter(torch.empty(inputs, self.hidden * heads))
        self.a = torch.nn.Parameter(torch.empty(heads, 2 * self.hidden, 1))
        torch.nn.init.xavier_normal_(self.W)
        torch.nn.init.xavier_normal_(self.a)
        self.leaky = torch.nn.LeakyReLU(slope)

    def forward(self, h, adj):
        n = h.shape[0]
        wh = F.dropout(torch.mm(h, self.W), self.dropout, training=self.training)
        wh = wh.view(n, self.heads, self.hidden).permute(1, 0, 2)  # (heads, nodes, hidden)
        source = torch.matmul(wh, self.a[:, : self.hidden, :])
        target = torch.matmul(wh, self.a[:, self.hidden :, :])
        e = self.leaky(source + target.mT)
        e = torch.where(adj > 0, e, -9e16 * torch.ones_like(e))
        attention = F.dropout(F.softmax(e, dim=-1), self.dropout, training=self.training)
        out = torch.matmul(attention, wh)
        if self.concat:
            return out.permute(1, 0, 2).contiguous().view(n, self.heads * self.hidden)
        return out.mean(dim=0)


class GAT(torch.nn.Module):
    def __init__(self, features=10, hidden=8, heads=4, classes=3, concat=False):
        super().__init__()
        self.gat1 = GraphAttention(features, hidden, heads, concat=concat)
        self.gat2 = GraphAttention(hidden, classes, 1)

    def forward(self, x, adj):
        return F.log_softmax(self.gat2(F.elu(self.gat1(x, adj)), adj), dim=1)


def _run_gat(compiled: bool, concat: bool):
    torch.manual_seed(13)
    model = GAT(concat=concat)
    opt = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
    g = torch.Generator().manual_seed(14)
    nodes = 24
    x, labels = torch.rand(nodes, 10, generator=g), torch.randint(0, 3, (nodes,), generator=g)
    x = x / x.sum(1, keepdim=True)  # the example's row-normalised bag of words
    edges = (torch.rand(nodes, nodes, generator=g) < 0.15).long()
    adj = torch.eye(nodes) + edges  # self-loops plus the (directed) citations
    order = torch.randperm(nodes, generator=g)
    idx_val, idx_train = order[:8], order[8:]  # index tensors, as the example splits

    def criterion(out, t):
        return F.nll_loss(out[idx_train], t[idx_train])

    # the whole graph is one sample (attention mixes the nodes): one replica, no accumulation
    step = (popxl.compile(model, criterion, opt).step if compiled
            else _eager_step(model, opt, criterion))  # fmt: skip
    printed = []
    for _epoch in range(5):
        model.train()
        printed.append(float(step((x, adj), labels)))
        model.eval()  # the example's test(): eager, on the weights the step left in the module
        with torch.no_grad():
            out = model(x, adj)[idx_val]
            printed.append(float(F.nll_loss(out, labels[idx_val])))
            printed.append(float((out.argmax(1) == labels[idx_val]).float().sum() / len(idx_val)))
    return model, printed


@pytest.mark.parametrize("concat", [False, True])
def test_gat_with_masked_attention_heads_and_an_index_split_prints_eager_losses(concat):
    _compare(lambda compiled: _run_gat(compiled, concat))


# ---- language_translation: nn.Transformer seq2seq, padding masks, a causal target mask, a
# ---- token mean over non-pad targets; the DataLoader's last batch does not split over R -----

PAD, BOS, VOCAB = 0, 1, 12


class Seq2Seq(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.src_emb = torch.nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.tgt_emb = torch.nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.pos = torch.nn.Parameter(torch.randn(1, 10, d) * 0.1)
        self.transformer = torch.nn.Transformer(d, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.generator = torch.nn.Linear(d, VOCAB)

    def forward(self, src, tgt_in):
        steps = tgt_in.shape[1]
        src_pad, tgt_pad = src == PAD, tgt_in == PAD
        out = self.transformer(
            self.src_emb(src) + self.pos[:, : src.shape[1]],
            self.tgt_emb(tgt_in) + self.pos[:, :steps],
            tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(steps),
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return self.generator(out)


def _translation_data(n=15):
    g = torch.Generator().manual_seed(3)
    src = torch.randint(3, VOCAB, (n, 7), generator=g)
    tgt = torch.randint(3, VOCAB, (n, 6), generator=g)
    for i in range(n):  # sentences of different lengths, padded at the end
        src[i, 7 - i % 4 :] = PAD
        tgt[i, 6 - i % 3 :] = PAD
    return src, torch.cat([torch.full((n, 1), BOS), tgt[:, :-1]], 1), tgt


def _run_translation(compiled: bool):
    torch.manual_seed(0)
    model = Seq2Seq()
    # the example's Adam has eps=1e-9, which turns the attention key biases' gradients (0 up to
    # rounding: a softmax does not see a shift) into full steps either way: eps=1e-6 here
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-6)

    def criterion(logits, tgt_out):
        return F.cross_entropy(logits.reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=PAD)

    src, tgt_in, tgt_out = _translation_data()
    step = (popxl.compile(model, criterion, opt, replication_factor=R,
                          gradient_accumulation=GA).step if compiled
            else _eager_step(model, opt, criterion))  # fmt: skip
    printed = []
    for _epoch in range(2):  # batches of 6, 6 and 3: 3 rows on 2 replicas (Note [padded rows])
        for (s, t_in), t_out in _batches((src, tgt_in), tgt_out, 6):
            printed.append(float(step((s, t_in), t_out)))
    return model, printed


@pytest.mark.filterwarnings("ignore:Support for mismatched")
def test_language_translation_seq2seq_with_a_last_batch_that_does_not_split_prints_eager_losses():
    _compare(_run_translation)


# ---- mnist_forward_forward: per-layer goodness losses, each layer trained on detached input -


class FFLayer(torch.nn.Linear):
    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return torch.relu(super().forward(x_direction))


class FFNet(torch.nn.Module):
    """The layers' losses summed: each layer sees its input detached, so its gradient is its
    own loss's (the example trains the layers one by one with an optimizer each; Adam is per
    parameter, so one Adam over all layers makes the same updates)."""

    def __init__(self, dims=(16, 12, 12), threshold=2.0):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            FFLayer(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        self.threshold = threshold

    def forward(self, x_pos, x_neg):
        loss = 0.0
        for layer in self.layers:
            g_pos, g_neg = layer(x_pos).pow(2).mean(1), layer(x_neg).pow(2).mean(1)
            loss = loss + torch.log(1 + torch.exp(torch.cat([-g_pos + self.threshold,
                                                              g_neg - self.threshold]))).mean()  # fmt: skip
            x_pos, x_neg = layer(x_pos).detach(), layer(x_neg).detach()
        return loss


def _run_forward_forward(compiled: bool):
    torch.manual_seed(0)
    model = FFNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.03, eps=1e-4)
    g = torch.Generator().manual_seed(12)
    x_pos, x_neg = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    if compiled:
        trainer = popxl.compile(model, None, opt, replication_factor=R, gradient_accumulation=GA)
    printed = []
    for _ in range(4):
        if compiled:
            printed.append(trainer.step((x_pos, x_neg)))
        else:
            opt.zero_grad()
            loss = model(x_pos, x_neg)
            loss.backward()
            opt.step()
            printed.append(loss.item())
    return model, printed


def test_mnist_forward_forward_per_layer_losses_prints_eager_losses():
    _compare(_run_forward_forward)


# ---- dcgan: two models, two optimizers, two trainers sharing the discriminator ------------


def _dcgan_models():
    torch.manual_seed(0)
    netG = torch.nn.Sequential(  # noise (nz, 1, 1) -> a 1x8x8 image
        torch.nn.ConvTranspose2d(4, 8, 4, 1, 0, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(True), torch.nn.ConvTranspose2d(8, 1, 4, 2, 1, bias=False), torch.nn.Tanh(),
    )  # fmt: skip
    netD = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 4, 2, 1, bias=False), torch.nn.LeakyReLU(0.2, inplace=True),
        torch.nn.Conv2d(8, 8, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.LeakyReLU(0.2, inplace=True), torch.nn.Conv2d(8, 1, 4, 1, 0, bias=False),
        torch.nn.Sigmoid(), torch.nn.Flatten(0),
    )  # fmt: skip
    return netG, netD


class RealAndFake(torch.nn.Module):
    """The discriminator's step as one forward: real then fake, as the example's two calls."""

    def __init__(self, netD):
        super().__init__()
        self.netD = netD

    def forward(self, real, fake):
        return self.netD(real), self.netD(fake)


class GThroughD(torch.nn.Module):
    def __init__(self, netG, netD):
        super().__init__()
        self.netG, self.netD = netG, netD

    def forward(self, noise):
        return self.netD(self.netG(noise))


def _run_dcgan(compiled: bool):
    netG, netD = _dcgan_models()
    criterion = torch.nn.BCELoss()
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999), eps=1e-4)
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999), eps=1e-4)
    g = torch.Generator().manual_seed(13)
    data = torch.rand(24, 1, 8, 8, generator=g) * 2 - 1
    noises = torch.randn(3, 8, 4, 1, 1, generator=g)

    def d_loss(out, _labels):
        out_real, out_fake = out
        return criterion(out_real, torch.ones_like(out_real)) + criterion(
            out_fake, torch.zeros_like(out_fake)
        )

    def g_loss(out, _labels):  # fake labels are real for the generator's cost
        return criterion(out, torch.ones_like(out))

    if compiled:
        # One replica: batch norm's statistics over the whole batch, as the eager loop. The
        # generator's trainer reads the discriminator as frozen (not in optG): its values are
        # the module's at every step, after the discriminator's trainer has updated them.
        trainerD = popxl.compile(RealAndFake(netD), d_loss, optD)
        trainerG = popxl.compile(GThroughD(netG, netD), g_loss, optG)
    printed = []
    for i, (real, _) in enumerate(_batches(data, data, 8)):
        noise = noises[i]
        if compiled:
            with torch.no_grad():  # the fake the discriminator sees (netG in train mode)
                fake = netG(noise)
            printed.append(trainerD.step((real, fake), torch.zeros(8)))
            # the example reuses that fake's graph; the generator's trainer recomputes it
            # (the same values: netG is unchanged since)
            printed.append(trainerG.step(noise, torch.zeros(8)))
        else:
            netD.zero_grad()
            output = netD(real)
            errD_real = criterion(output, torch.ones_like(output))
            errD_real.backward()
            fake = netG(noise)
            output = netD(fake.detach())
            errD_fake = criterion(output, torch.zeros_like(output))
            errD_fake.backward()
            optD.step()
            printed.append((errD_real + errD_fake).item())
            netG.zero_grad()
            output = netD(fake)
            errG = criterion(output, torch.ones_like(output))
            errG.backward()
            optG.step()
            printed.append(errG.item())
    return torch.nn.ModuleList([netG, netD]), printed


def test_dcgan_two_trainers_sharing_the_discriminator_print_eager_losses():
    """Parameters as eager's; batch norm's running statistics differ only in the generator's
    (its forward runs twice per iteration here, once in eager)."""
    _compare(_run_dcgan)


# ---- ordinary loop features: gradient hooks (clip by value), param groups, schedulers ------


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _data(n=40, seed=14):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g)


def _run_clip_by_value(compiled: bool, R_GA=(R, GA), norm=None):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, y = _data()
    if compiled:
        # clip_grad_value_ runs between backward and step, inside the compiled step: the same
        # clamp as a gradient hook (Note [parameter gradient hooks])
        for p in model.parameters():
            p.register_hook(lambda g: g.clamp(-0.01, 0.01))
        trainer = popxl.compile(model, F.cross_entropy, opt, replication_factor=R_GA[0],
                                gradient_accumulation=R_GA[1], max_grad_norm=norm)  # fmt: skip
    printed = []
    for _epoch in range(2):
        for xb, yb in _batches(x, y, 16):
            if compiled:
                printed.append(trainer.step(xb, yb))
                continue
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            if norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), norm)
            opt.step()
            printed.append(loss.item())
    if compiled:  # p.grad as after clip_grad_value_
        assert all(p.grad.abs().max() <= 0.01 for p in model.parameters())
    return model, printed


@pytest.mark.parametrize("R_GA", [(1, 1), (R, GA)])
@pytest.mark.parametrize("norm", [None, 0.015])
def test_clip_grad_value_as_a_parameter_hook_clips_the_global_gradient_as_eager(R_GA, norm):
    """The hook sees the whole gradient of the global batch (not a micro-batch's), before
    clip_grad_norm_; the clamp bites (gradients reach 0.06 unclamped)."""
    _compare(lambda c: _run_clip_by_value(c, R_GA, norm))


def test_a_parameter_hook_added_or_removed_later_builds_a_new_program():
    model, ref = _mlp(), _mlp()
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    trainer = popxl.compile(model, F.cross_entropy, opt, replication_factor=R)
    x, y = _data(16)
    losses = [trainer.step(x, y)]
    handles = [p.register_hook(lambda g: g * 0.5) for p in model.parameters()]
    losses.append(trainer.step(x, y))
    for h in handles:
        h.remove()
    losses.append(trainer.step(x, y))
    want = []
    for scale in (1.0, 0.5, 1.0):
        opt_ref.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        for p in ref.parameters():
            p.grad.mul_(scale)
        opt_ref.step()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    _same_weights(model, ref)
    assert len(trainer.programs) == 2  # with and without the hooks


def test_parameter_hooks_that_cannot_run_as_in_eager_are_refused_before_anything_changes():
    x, y = _data(16)
    for kw, match in [({"replication_factor": 2, "rts_threshold": 1}, "sharded"),
                      ({"loss_scaling": 128.0}, "loss_scaling")]:  # fmt: skip
        model = _mlp()
        before = copy.deepcopy(model.state_dict())
        model[0].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
        trainer = popxl.compile(model, F.cross_entropy, torch.optim.Adam(model.parameters()), **kw)
        with pytest.raises(ValueError, match=rf"'0.weight' has a gradient hook.*{match}"):
            trainer.step(x, y)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
    model = _mlp()
    model[2].bias.register_post_accumulate_grad_hook(lambda p: None)
    trainer = popxl.compile(model, F.cross_entropy, torch.optim.Adam(model.parameters()))
    with pytest.raises(ValueError, match=r"\['2.bias'\].*register_post_accumulate_grad_hook"):
        trainer.step(x, y)


def _loop(model, opt, step, x, y, epochs, batch=16, on_epoch=None):
    printed = []
    for epoch in range(epochs):
        model.train()
        printed += [float(step(xb, yb)) for xb, yb in _batches(x, y, batch)]
        model.eval()
        with torch.no_grad():
            printed.append(float(F.cross_entropy(model(x[:8]), y[:8])))
        if on_epoch is not None:
            on_epoch(epoch, printed[-1])
    return printed


def _step_for(compiled, model, opt, **kw):
    if compiled:
        return popxl.compile(model, F.cross_entropy, opt, replication_factor=R,
                             gradient_accumulation=GA, **kw).step  # fmt: skip
    return _eager_step(model, opt, F.cross_entropy)


def _run_param_groups_and_frozen(compiled: bool):
    """Fine-tuning as the examples do it: the first layer frozen, a param group per layer with
    its own learning rate and weight decay, ReduceLROnPlateau on the validation loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 4))  # fmt: skip
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([{"params": model[2].parameters(), "lr": 0.01},
                           {"params": model[4].parameters(), "weight_decay": 1e-3}],
                          lr=0.2, momentum=0.9)  # fmt: skip
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.2)
    x, y = _data()
    frozen = model[0].weight.detach().clone()
    printed = _loop(model, opt, _step_for(compiled, model, opt), x, y, 4,
                    on_epoch=lambda _e, val: plateau.step(val))  # fmt: skip
    assert torch.equal(model[0].weight, frozen) and model[0].weight.grad is None
    printed += [g["lr"] for g in opt.param_groups]
    return model, printed


def test_param_groups_frozen_layers_and_reduce_lr_on_plateau_print_eager_losses():
    printed = _compare(_run_param_groups_and_frozen)
    assert printed[-2:] != [0.01, 0.2]  # the plateau lowered the learning rates


def _run_one_cycle(compiled: bool):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=9)
    x, y = _data()
    step = _step_for(compiled, model, opt)

    def scheduled(xb, yb):
        loss = step(xb, yb)
        sched.step()  # per batch; OneCycleLR also cycles AdamW's beta1 (momentum)
        return loss

    printed = _loop(model, opt, scheduled, x, y, 3)
    return model, printed + [opt.param_groups[0]["betas"][0]]


def test_one_cycle_lr_with_cycled_momentum_prints_eager_losses():
    _compare(_run_one_cycle)


def _run_checkpointed(compiled: bool, resume: bool):
    """Three epochs with StepLR; with ``resume`` a checkpoint (torch.save of the model's,
    optimizer's and scheduler's state_dict, as the examples write it) after the second epoch
    is loaded into fresh objects, which train the third: the run is the uninterrupted one."""
    import io

    def fresh():
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    x, y = _data()
    model, opt, sched = fresh()
    step = _step_for(compiled, model, opt)
    printed = _loop(model, opt, step, x, y, 2, on_epoch=lambda *_: sched.step())
    if resume:
        buf = io.BytesIO()
        torch.save({"epoch": 2, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict()}, buf)  # fmt: skip
        buf.seek(0)
        checkpoint = torch.load(buf)
        model, opt, sched = fresh()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the fresh run's own values: replaced by the checkpoint's
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        sched.load_state_dict(checkpoint["scheduler"])
        step = _step_for(compiled, model, opt)
    printed += _loop(model, opt, step, x, y, 1, on_epoch=lambda *_: sched.step())
    return model, printed + [opt.param_groups[0]["lr"]]


@pytest.mark.parametrize("resume", [False, True])
def test_checkpoint_save_and_resume_mid_training_prints_eager_losses(resume):
    eager, want = _run_checkpointed(False, resume=False)  # uninterrupted, eager
    ported, got = _run_checkpointed(True, resume=resume)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    _same_weights(ported, eager)


def test_inference_with_a_carried_state_as_nested_inputs_matches_eager():
    """word_language_model's evaluate() compiled: (data, (h, c)) in, (log-probs, (h, c)) out,
    the state carried across windows; time-major as written (one replica)."""
    torch.manual_seed(0)
    model = RNNModel().eval()
    infer = popxl.compile(model)
    g = torch.Generator().manual_seed(15)
    source = _batchify(torch.randint(0, 30, (4 * 11,), generator=g), 4)
    hidden, ref_hidden = model.init_hidden(4), model.init_hidden(4)
    for i in range(0, 10, 5):
        output, hidden = infer((source[i : i + 5], hidden))
        with torch.no_grad():
            want, ref_hidden = model(source[i : i + 5], ref_hidden)
        torch.testing.assert_close(output, want, rtol=1e-5, atol=1e-6)
        for h, r in zip(hidden, ref_hidden, strict=True):
            torch.testing.assert_close(h, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_word_language_model_with_dropout_between_rnn_layers_trains(kind):
    """The example's dropout between the RNN's layers: the draws differ from eager's, so the
    losses are not compared one by one; the dropout acts (the first loss is not the
    dropout-free one) and the model trains."""
    torch.manual_seed(0)
    model = RNNModel(kind)
    model.rnn.dropout = 0.3
    net = BatchFirst(model)
    trainer = popxl.compile(net, _lm_criterion, torch.optim.SGD(model.parameters(), lr=5.0),
                            replication_factor=R, gradient_accumulation=GA, max_grad_norm=0.25,
                            return_outputs=True)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 30, (8, 6), generator=g)
    hidden = model.init_hidden(8, batch_first=True)
    model.rnn.dropout = 0.0
    with torch.no_grad():
        no_dropout = float(_lm_criterion(net(data[:, :-1], hidden), data[:, 1:]))
    model.rnn.dropout = 0.3
    losses = []
    for _ in range(6):
        loss, (_, hidden) = trainer.step((data[:, :-1], _repackage_hidden(hidden)), data[:, 1:])
        losses.append(loss)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.2
    assert abs(losses[0] - no_dropout) > 1e-4  # summation order moves it by ~1e-6


# ---- pytorch/tutorials' spatial transformer network: affine_grid + grid_sample ---------------


class STNet(torch.nn.Module):
    """The tutorial's network: a localisation net regresses an affine transform (its last layer
    starts at the identity), the input is resampled with it, then classified."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        nn = torch.nn
        self.conv1, self.conv2 = nn.Conv2d(1, 10, 5), nn.Conv2d(10, 20, 5)
        self.fc1, self.fc2 = nn.Linear(320, 50), nn.Linear(50, 10)
        self.localization = nn.Sequential(
            nn.Conv2d(1, 8, 7), nn.MaxPool2d(2, 2), nn.ReLU(True),
            nn.Conv2d(8, 10, 5), nn.MaxPool2d(2, 2), nn.ReLU(True),
        )  # fmt: skip
        self.fc_loc = nn.Sequential(nn.Linear(90, 32), nn.ReLU(True), nn.Linear(32, 6))
        self.fc_loc[2].weight.data.zero_()
        self.fc_loc[2].bias.data.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))

    def forward(self, x):
        theta = self.fc_loc(self.localization(x).view(-1, 90)).view(-1, 2, 3)
        grid = F.affine_grid(theta, x.size(), align_corners=False)
        x = F.grid_sample(x, grid, align_corners=False)
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.view(-1, 320)))), dim=1)


def test_spatial_transformer_tutorial_prints_eager_losses():
    """At the identity transform grid_sample samples exactly at pixel centres, where its
    gradient jumps: affine_grid must give eager's bits (Note [one op through torch's batching
    rule]), or the localisation head's gradient is 40 % off at R * GA > 1."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 1, 28, 28, generator=g), torch.randint(0, 10, (48,), generator=g)

    def run(compiled):
        model = STNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        trainer = (popxl.compile(model, F.nll_loss, opt, replication_factor=R,
                                 gradient_accumulation=GA) if compiled else None)  # fmt: skip
        step = trainer.step if compiled else _eager_step(model, opt, F.nll_loss)
        losses = [step(xb, yb) for xb, yb in _batches(x, y, 16)]
        return model, losses

    _compare(run)
