"""An inference program of nn.TransformerEncoder with a padding mask gives eager's outputs at
padded positions too (Note [the nested-tensor path of TransformerEncoder], compile_infer.py).

In eval mode without a gradient to record, eager torch runs the encoder on a nested tensor and
pads its result with zeros before the final norm; with a gradient, a mask that is not
left-aligned, an attention mask beside it or the fast path disabled, it runs the padded batch.
Every test compares with eager torch on the same module and batch. Tolerance: rtol 1e-5 /
atol 1e-5 (torch's fused fast-path kernels round differently from the layers' ops).
"""

import pytest
import torch

import torch_popxl as popxl

TOL = {"rtol": 1e-5, "atol": 1e-5}
# eager torch's own warning on its first nested tensor
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")


class Encoder(torch.nn.Module):
    def __init__(self, norm=True, float_mask=False, causal=False):
        super().__init__()
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        final = torch.nn.LayerNorm(16) if norm else None
        self.encoder = torch.nn.TransformerEncoder(layer, 2, norm=final)
        if final is not None:
            with torch.no_grad():
                final.bias.normal_()  # the norm of the zeros at padded positions is not 0
        self.head = torch.nn.Linear(16, 3)
        self.float_mask, self.causal = float_mask, causal

    def forward(self, x, pad):
        if self.float_mask:
            pad = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))
        mask = None
        if self.causal:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        h = self.encoder(x, mask=mask, src_key_padding_mask=pad, is_causal=self.causal or None)
        return h, self.head(h.mean(1))  # a mean over every position, padded ones too


def batch(rows=5, left_aligned=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 6, 16, generator=g)
    pad = torch.zeros(rows, 6, dtype=torch.bool)
    pad[0, 4:] = True
    pad[2, 1:] = True
    pad[3, 5:] = True
    if not left_aligned:
        pad[1, 0] = True  # a row padded at its start
    return {"x": x, "pad": pad}


def check(model, inputs, R=1, grad=False):
    model.eval()
    with torch.set_grad_enabled(grad):
        want = model(**inputs)
        got = popxl.compile(model, replication_factor=R)(inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.detach(), **TOL)
    return want


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("float_mask", [False, True])
def test_eval_without_grad_gives_the_nested_paths_zeros_at_padded_positions(norm, R, float_mask):
    h, _ = check(Encoder(norm=norm, float_mask=float_mask), batch(), R=R)
    padded = h[0, 4]  # eager's nested path: 0, then the final norm of 0 (its bias)
    expected = Encoder(norm=norm).encoder.norm.bias if norm else torch.zeros(16)
    torch.testing.assert_close(padded, expected.detach(), **TOL)


@pytest.mark.parametrize(
    "case", ["grad", "not_left_aligned", "with_an_attention_mask", "fast_path_disabled"]
)
def test_where_eager_runs_the_padded_batch_so_does_the_program(case):
    model = Encoder(causal=case == "with_an_attention_mask")
    inputs = batch(left_aligned=case != "not_left_aligned")
    enabled = torch.backends.mha.get_fastpath_enabled()
    try:
        torch.backends.mha.set_fastpath_enabled(case != "fast_path_disabled")
        h, _ = check(model, inputs, grad=case == "grad")
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
    assert not torch.allclose(h[0, 4], model.encoder.norm.bias)  # (values, not the norm of 0)


def test_the_grad_mode_selects_the_program_as_it_selects_eagers_path():
    model = Encoder().eval()
    infer = popxl.compile(model)
    inputs = batch()
    for grad in (False, True, False):
        with torch.set_grad_enabled(grad):
            got, want = infer(inputs), model(**inputs)
        torch.testing.assert_close(got[1], want[1].detach(), **TOL)
    assert len(infer.programs) == 2
