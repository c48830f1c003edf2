"""A tensor-parallel GPT-2 layer written in popxl-addons style against HuggingFace's GPT-2.

Four replicas form one tensor-parallel group with one attention head each: the QKV and MLP
up-projections are split by columns and the output projections by rows; each block enters with
``replicated_all_reduce_identical_inputs`` and leaves with
``replicated_all_reduce_identical_grad_inputs``; the token embedding is sharded over the
vocabulary (``Embedding`` with per-replica offsets) and the layer norms are ``LayerNorm``.
Outputs and input gradients must match HuggingFace on every replica; so must each replica's
slice of the weight gradients. Needs ``transformers`` (models built from a config, nothing is
downloaded); skipped where it is not installed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl import ops
from torch_popxl.addons.array_munging import shard, tensor_parallel_input
from torch_popxl.addons.layers import Embedding, LayerNorm, Linear
from torch_popxl.addons.ops.replicated_all_reduce_TP import (
    replicated_all_reduce_identical_grad_inputs,
    replicated_all_reduce_identical_inputs,
)

transformers = pytest.importorskip("transformers")

TP = 4
HIDDEN, HEADS, SEQ, BATCH, VOCAB = 16, 4, 5, 2, 50
HEAD = HIDDEN // HEADS
LOCAL_HEADS = HEADS // TP


def hf_config():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_head=HEADS, n_layer=1, n_positions=SEQ,
        resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return config


class Attention(addons.Module):
    def __init__(self, group, shards):
        super().__init__()
        self.group = group
        self.qkv = Linear(3 * HEAD * LOCAL_HEADS, replica_grouping=shards)  # column shard
        self.out = Linear(HIDDEN, bias=False, replica_grouping=shards)  # row shard

    def build(self, x):
        x = replicated_all_reduce_identical_inputs(x, group=self.group)
        qkv = self.qkv(x)  # (B*S, 3 * local hidden)
        q, k, v = ops.split(qkv, 3, axis=-1)

        def heads(t):  # (B*S, local hidden) -> (B, local heads, S, head)
            return ops.transpose(ops.reshape(t, (BATCH, SEQ, LOCAL_HEADS, HEAD)), (0, 2, 1, 3))

        q, k, v = heads(q), heads(k), heads(v)
        scores = (q @ ops.transpose(k, (0, 1, 3, 2))) * (1.0 / math.sqrt(HEAD))
        causal = np.triu(np.full((SEQ, SEQ), -1e9, np.float32), 1)
        probs = ops.softmax(scores + popxl.constant(causal), axis=-1)
        ctx = ops.reshape(ops.transpose(probs @ v, (0, 2, 1, 3)), (BATCH * SEQ, LOCAL_HEADS * HEAD))
        partial = self.out(ctx)
        return replicated_all_reduce_identical_grad_inputs(partial, group=self.group)


class MLP(addons.Module):
    def __init__(self, group, shards):
        super().__init__()
        self.group = group
        self.fc = Linear(4 * HIDDEN // TP, replica_grouping=shards)
        self.proj = Linear(HIDDEN, bias=False, replica_grouping=shards)

    def build(self, x):
        x = replicated_all_reduce_identical_inputs(x, group=self.group)
        y = self.proj(ops.gelu(self.fc(x)))
        return replicated_all_reduce_identical_grad_inputs(y, group=self.group)


class Block(addons.Module):
    def __init__(self, group, shards):
        super().__init__()
        self.ln_1 = LayerNorm()
        self.attn = Attention(group, shards)
        self.ln_2 = LayerNorm()
        self.mlp = MLP(group, shards)

    def build(self, x):
        # The row-parallel outputs' biases are replicated, added once after the reduction.
        attn_bias = self.add_variable_input("attn_out_bias", lambda: np.zeros(HIDDEN), x.dtype)
        mlp_bias = self.add_variable_input("mlp_out_bias", lambda: np.zeros(HIDDEN), x.dtype)
        x = x + self.attn(self.ln_1(x)) + attn_bias
        return x + self.mlp(self.ln_2(x)) + mlp_bias


def per_shard(a: np.ndarray, axis: int) -> np.ndarray:
    return shard(a, TP, axis)  # (TP, ...): replica r holds shard r


def block_weights(variables, hf_block) -> dict:
    """HF GPT2Block parameters laid out on the TP replicas."""
    p = {k: v.detach().numpy() for k, v in hf_block.state_dict().items()}
    w_qkv, b_qkv = p["attn.c_attn.weight"], p["attn.c_attn.bias"]  # Conv1D: (in, out)
    cols = lambda w: np.concatenate([per_shard(part, -1) for part in np.split(w, 3, -1)], -1)  # noqa: E731
    return {
        variables.ln_1.weight: p["ln_1.weight"], variables.ln_1.bias: p["ln_1.bias"],
        variables.ln_2.weight: p["ln_2.weight"], variables.ln_2.bias: p["ln_2.bias"],
        variables.attn.qkv.weight: cols(w_qkv), variables.attn.qkv.bias: cols(b_qkv),
        variables.attn.out.weight: per_shard(p["attn.c_proj.weight"], 0),
        variables.attn_out_bias: p["attn.c_proj.bias"],
        variables.mlp.fc.weight: per_shard(p["mlp.c_fc.weight"], -1),
        variables.mlp.fc.bias: per_shard(p["mlp.c_fc.bias"], -1),
        variables.mlp.proj.weight: per_shard(p["mlp.c_proj.weight"], 0),
        variables.mlp_out_bias: p["mlp.c_proj.bias"],
    }  # fmt: skip


def test_tensor_parallel_gpt2_block_matches_huggingface_outputs_and_gradients():
    torch.manual_seed(0)
    hf = transformers.models.gpt2.modeling_gpt2.GPT2Block(hf_config())
    with torch.no_grad():  # non-trivial layer norms
        for ln in (hf.ln_1, hf.ln_2):
            ln.weight.normal_(1.0, 0.2)
            ln.bias.normal_(0.0, 0.2)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    seed = torch.randn(BATCH, SEQ, HIDDEN)

    ir = popxl.Ir(replication=TP)
    group = ir.replica_grouping(1, TP)
    with ir.main_graph, popxl.in_sequence(True):
        xs = popxl.h2d_stream((BATCH * SEQ, HIDDEN), popxl.float32, "x")
        ss = popxl.h2d_stream((BATCH * SEQ, HIDDEN), popxl.float32, "seed")
        xt, st = ops.host_load(xs), ops.host_load(ss)
        facts, fwd = Block(group, group.transpose()).create_graph(xt)
        names = ["attn.qkv.weight", "mlp.fc.weight", "attn.out.weight"]
        bwd = addons.autodiff(
            fwd, grads_required=[fwd.graph.inputs[0]] + [fwd.args[n] for n in names]
        )
        variables = facts.init()
        info = fwd.bind(variables).call_with_info(xt)
        dx, *dws = bwd.call(st, args=bwd.grad_graph_info.inputs_dict(info))
        outs = [addons.host_store(t) for t in (info.outputs[0], dx, *dws)]
    feed = {
        xs: np.stack([x.reshape(-1, HIDDEN).numpy()] * TP),
        ss: np.stack([seed.reshape(-1, HIDDEN).numpy()] * TP),
    }
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variables_data(block_weights(variables, hf))
        result = session.run(feed)
    y, got_dx, *got_dws = (result[o] for o in outs)

    tx = x.clone().requires_grad_(True)
    # A GPT2Block used on its own gets its causal mask from the caller (GPT2Model builds one).
    causal = torch.triu(torch.full((SEQ, SEQ), torch.finfo(torch.float32).min), 1).expand(
        BATCH, 1, SEQ, SEQ
    )
    ty = hf(tx, attention_mask=causal)
    ty = ty[0] if isinstance(ty, tuple) else ty
    ty.backward(seed)
    want_y = ty.detach().reshape(-1, HIDDEN).numpy()
    want_dx = tx.grad.reshape(-1, HIDDEN).numpy()
    for r in range(TP):  # every replica holds the full output and input gradient
        np.testing.assert_allclose(y[r], want_y, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got_dx[r], want_dx, rtol=1e-4, atol=1e-5)
    g = {k: v.grad.numpy() for k, v in hf.named_parameters()}
    cols = lambda w: np.concatenate([per_shard(part, -1) for part in np.split(w, 3, -1)], -1)  # noqa: E731
    want_dws = [
        cols(g["attn.c_attn.weight"]),
        per_shard(g["mlp.c_fc.weight"], -1),
        per_shard(g["attn.c_proj.weight"], 0),
    ]
    for got, want in zip(got_dws, want_dws, strict=True):  # each replica: its own shard's gradient
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class Embeddings(addons.Module):
    """Token embedding sharded over the vocabulary across the TP group, plus positions."""

    def __init__(self, group, shards):
        super().__init__()
        self.group = group
        self.wte = Embedding(popxl.float32, VOCAB, HIDDEN, replica_grouping=shards)
        self.wpe = Embedding(popxl.float32, SEQ, HIDDEN)

    def build(self, ids, positions):
        tokens = replicated_all_reduce_identical_grad_inputs(self.wte(ids), group=self.group)
        return tokens + self.wpe(positions)


def test_tensor_parallel_gpt2_embeddings_match_huggingface_and_shard_the_table_gradient():
    torch.manual_seed(1)
    hf = transformers.GPT2Model(hf_config())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    seed = torch.randn(BATCH, SEQ, HIDDEN)
    ir = popxl.Ir(replication=TP)
    group = ir.replica_grouping(1, TP)
    shards = group.transpose()
    layer = Embeddings(group, shards)
    size, offsets = layer.wte.vocab_shard_size, layer.wte.offsets
    assert size == 16 and list(offsets) == [0, 16, 32, 48]
    with ir.main_graph, popxl.in_sequence(True):
        id_s = popxl.h2d_stream((BATCH * SEQ,), popxl.int32, "ids")
        ss = popxl.h2d_stream((BATCH * SEQ, HIDDEN), popxl.float32, "seed")
        idt, st = ops.host_load(id_s), ops.host_load(ss)
        pos = popxl.constant(np.tile(np.arange(SEQ, dtype=np.int32), BATCH))
        facts, fwd = layer.create_graph(idt, pos)
        bwd = addons.autodiff(fwd, grads_required=[fwd.args.wte.weight, fwd.args.wpe.weight])
        variables = facts.init()
        info = fwd.bind(variables).call_with_info(idt, pos)
        d_wte, d_wpe = bwd.call(st, args=bwd.grad_graph_info.inputs_dict(info))
        outs = [addons.host_store(t) for t in (info.outputs[0], d_wte, d_wpe)]
    positions = np.zeros((layer.wpe.vocab_shard_size, HIDDEN), np.float32)  # rows padded to 16
    positions[:SEQ] = hf.wpe.weight.detach().numpy()
    table = np.zeros((TP * size, HIDDEN), np.float32)
    table[:VOCAB] = hf.wte.weight.detach().numpy()
    # Each replica receives the ids shifted by its shard's first vocabulary index (upstream's
    # tensor_parallel_input with a repeat_fn), one host transfer.
    shifted = tensor_parallel_input(
        ids.reshape(1, -1).numpy(), TP, TP, lambda a, i: a - offsets[i]
    ).astype(np.int32)
    with popxl.Session(ir, "ipu_model") as session:
        session.write_variables_data({variables.wte.weight: table.reshape(TP, size, HIDDEN),
                                      variables.wpe.weight: positions})  # fmt: skip
        result = session.run({id_s: shifted, ss: np.stack([seed.reshape(-1, HIDDEN).numpy()] * TP)})
    y, got_wte, got_wpe = (result[o] for o in outs)
    emb = hf.wte(ids) + hf.wpe(torch.arange(SEQ))
    emb.backward(seed)
    for r in range(TP):
        np.testing.assert_allclose(
            y[r], emb.detach().reshape(-1, HIDDEN).numpy(), rtol=1e-6, atol=1e-6
        )
    want_wte = np.zeros((TP * size, HIDDEN), np.float32)
    want_wte[:VOCAB] = hf.wte.weight.grad.numpy()
    np.testing.assert_allclose(got_wte, want_wte.reshape(TP, size, HIDDEN), rtol=1e-5, atol=1e-6)
    for r in range(TP):
        np.testing.assert_allclose(
            got_wpe[r][:SEQ], hf.wpe.weight.grad.numpy(), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_array_equal(got_wpe[r][SEQ:], 0)
