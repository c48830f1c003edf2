"""Phased execution (issue 16): remote-buffer-per-layer load / compute / store phases.

Spec: ../shared/spec/addons.md §10-§11 and §15 (test_phased_execution), the popxl-addons
phased-execution tutorial (load -> compute -> store per phase). Each phased program is checked
against hand-computed values or the same program with its variables on chip (fast and
reference executors), and the memory report's per-phase figures against hand-computed bytes.
"""

from __future__ import annotations

import importlib
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl import ops
from torch_popxl.addons import Module, NamedTensors
from torch_popxl.addons.transforms import phased
from torch_popxl.addons.transforms.use_fc_pass import (
    disable_fc_pass,
    enable_fc_pass,
    fc_pass_enabled,
)

EXECUTORS = ["fast", "reference"]


class Add(Module):
    """``weight += x`` in place (a by-reference variable), as upstream's phased test."""

    def build(self, x: popxl.Tensor):
        w = self.add_variable_input("weight", partial(np.random.normal, 0, 0.02, x.shape), x.dtype,
                                    by_ref=True)  # fmt: skip
        ops.scaled_add_(w, x)


def _phased_add_program(R: int, op: str | None, api: str):
    """Two phases over one two-entry buffer: load entry i, (gather,) add x, (reduce,) store."""
    ir = popxl.Ir(replication=R)
    data = np.random.normal(0, 1, (1, 4)).astype(np.float32)
    with ir.main_graph, popxl.in_sequence():
        data, x_stream, x = addons.host_load(data, popxl.float32, "x")
        args, graph = Add().create_graph(x)
        if api == "2.x":  # popxl-addons 2.x: positional threshold 0 shards everything
            buffers = phased.named_variable_buffers(args, 2, 0)
        else:
            buffers = addons.named_variable_buffers(args, 2, shard_over_dict=R > 1)
        load, names = addons.load_remote_graph(buffers)
        store = addons.store_remote_graph(buffers)
        if op is not None:
            gather, _ = phased.all_gather_replica_sharded_graph(
                NamedTensors.pack(names, load.graph.outputs)
            )
            reduce, _ = phased.reduce_replica_sharded_graph(
                NamedTensors.pack(names, gather.graph.outputs), op, 0
            )
        variables = NamedTensors(
            layer0=args.init_remote(buffers, 0), layer1=args.init_remote(buffers, 1)
        )
        for i in range(2):
            with popxl.name_scope(f"layer{i}"):
                ts = NamedTensors.pack(names, load.call(i))
                if op is not None:
                    ts = NamedTensors.pack(names, gather.bind(ts).call())
                graph.bind(ts).call(x)
                if op is not None:
                    ts = NamedTensors.pack(names, reduce.bind(ts).call())
                store.bind(ts).call(i)
    feed = data if R == 1 else np.repeat(data[np.newaxis], R, axis=0)
    return ir, variables, x_stream, data, feed


@pytest.mark.parametrize("executor", EXECUTORS)
def test_phased_load_add_store_updates_each_entry(executor):
    ir, variables, stream, data, feed = _phased_add_program(1, None, "3.x")
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        before = {t: v.copy() for t, v in session.get_tensors_data(variables.tensors).items()}
        session.run({stream: feed})
        after = session.get_tensors_data(variables.tensors)
    assert len(before) == 2
    for t, value in before.items():
        np.testing.assert_allclose(after[t], value + data, rtol=1e-6)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("api", ["2.x", "3.x"])
@pytest.mark.parametrize(("op", "scale"), [("local", 1), ("add", 4)])
def test_phased_rts_gather_add_reduce_store(executor, api, op, scale):
    """Upstream test_phased_rts: 4 replicas, each layer's weight sharded over them; a 'local'
    reduction keeps each replica's own shard (after = before + x), 'add' sums the 4 identical
    copies (after = 4 (before + x))."""
    ir, variables, stream, data, feed = _phased_add_program(4, op, api)
    with popxl.Session(ir, "ipu_hw", executor=executor) as session:
        before = {t: v.copy() for t, v in session.get_tensors_data(variables.tensors).items()}
        session.run({stream: feed})
        after = session.get_tensors_data(variables.tensors)
        report = session.memory_report()
    for t, value in before.items():
        assert t.info.shard.shard_over == 4  # stored as 1-element shards, one per replica
        np.testing.assert_allclose(after[t], (value + data) * scale, rtol=1e-5)
    # Per phase: one 4-byte shard loaded and stored by each of the 4 replicas.
    phases = {p.name: p for p in report.phases}
    for name in ("layer0", "layer1"):
        assert phases[name].remote_load_bytes == phases[name].remote_store_bytes == 4 * 4
        assert phases[name].num_remote_loads == phases[name].num_remote_stores == 1


def test_phased_named_variable_buffers_2x_threshold_shards_large_factories_only():
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        facts = addons.NamedVariableFactories.from_dict({
            "big": addons.VariableFactory(lambda: np.zeros((32, 32), np.float32)),
            "odd": addons.VariableFactory(lambda: np.zeros((1030,), np.float32)),  # 1030 % 4
            "small": addons.VariableFactory(lambda: np.zeros((8,), np.float32)),
        })  # fmt: skip
        buffers = phased.named_variable_buffers(facts, 3)  # default threshold 1024
        spec = phased.replica_sharded_spec(popxl.TensorSpec((32, 32), popxl.float32))
        with pytest.raises(TypeError, match="non-negative int"):
            phased.named_variable_buffers(facts, 1, -1)
    assert (buffers.big.tensor_shape, buffers.big.meta_shape, buffers.big.entries) == (
        (256,),
        (32, 32),
        3,
    )
    assert (buffers.odd.tensor_shape, buffers.odd.meta_shape) == ((1030,), ())
    assert (buffers.small.tensor_shape, buffers.small.meta_shape) == ((8,), ())
    assert spec == popxl.TensorSpec((256,), popxl.float32, (32, 32))


# ---- a two-layer phased network against the same network on chip -----------------------


class Dense(Module):
    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        w = self.add_variable_input(
            "weight", partial(np.random.normal, 0, 0.1, (x.shape[-1], 64)), x.dtype
        )
        return ops.gelu(x @ w)


def _two_layer_program(phased_: bool, w_values, x_value):
    """y = gelu(gelu(x @ w0) @ w1): the weights on chip, or each in its own buffer entry,
    loaded, used and stored back in its own phase."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x_stream = popxl.h2d_stream(x_value.shape, popxl.float32, "x")
        x = ops.host_load(x_stream)
        args, graph = Dense().create_graph(x)
        if phased_:
            buffers = addons.named_variable_buffers(args, 2)
            load, names = addons.load_remote_graph(buffers)
            store = addons.store_remote_graph(buffers)
            variables = [args.init_remote(buffers, i) for i in range(2)]
        else:
            variables = [args.init() for _ in range(2)]
        for i in range(2):
            with popxl.name_scope(f"fc{i}"):
                if phased_:
                    ws = NamedTensors.pack(names, load.call(i))
                    (x,) = graph.bind(ws).call(x)
                    store.bind(ws).call(i)
                else:
                    (x,) = graph.bind(variables[i]).call(x)
        with popxl.name_scope("output"):
            y_stream = addons.host_store(x)
    weights = {v.weight: w for v, w in zip(variables, w_values, strict=True)}
    return ir, x_stream, y_stream, weights


@pytest.mark.parametrize("executor", EXECUTORS)
def test_phased_two_layer_network_matches_on_chip_network_and_reports_per_phase_memory(executor):
    rng = np.random.default_rng(0)
    x_value = rng.normal(size=(8, 64)).astype(np.float32)
    w_values = [rng.normal(0, 0.1, (64, 64)).astype(np.float32) for _ in range(2)]
    results, reports = {}, {}
    for phased_ in (False, True):
        ir, xs, ys, weights = _two_layer_program(phased_, w_values, x_value)
        with popxl.Session(ir, "ipu_model", executor=executor) as session:
            session.write_variables_data(weights)
            results[phased_] = session.run({xs: x_value})[ys]
            reports[phased_] = session.memory_report()
    gelu = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))  # noqa: E731
    expected = gelu(gelu(x_value @ w_values[0]) @ w_values[1])
    np.testing.assert_allclose(results[True], results[False], rtol=1e-6)
    np.testing.assert_allclose(results[True], expected, rtol=1e-3, atol=1e-4)

    w_bytes, act_bytes = 64 * 64 * 4, 8 * 64 * 4
    on_chip, phased_report = reports[False], reports[True]
    assert on_chip.variable_bytes == 2 * w_bytes and phased_report.variable_bytes == 0
    assert phased_report.streaming_bytes == 2 * w_bytes
    phases = {p.name: p for p in phased_report.phases}
    assert list(phases) == ["", "fc0", "fc1", "output"]
    for name in ("fc0", "fc1"):
        p = phases[name]
        # Loaded and stored: this layer's weight only.
        assert (p.remote_load_bytes, p.remote_store_bytes) == (w_bytes, w_bytes)
        # Live when the phase starts: only the activation handed over from the last phase.
        assert p.live_in_bytes == act_bytes
        # While it runs: its own loaded weight, the input activation and, inside the layer's
        # call, x @ w and gelu(x @ w); never the other layer's weight.
        assert p.peak_intermediate_bytes == w_bytes + 3 * act_bytes
    assert phases["output"].remote_load_bytes == 0 and phases["output"].host_bytes == act_bytes
    assert phased_report.peak_intermediate_bytes == max(
        p.peak_intermediate_bytes for p in phased_report.phases
    )
    # Phasing keeps one layer's weight on chip at a time instead of both.
    # (the phased program's constants are its 4 int32 buffer offsets)
    assert phased_report.constant_bytes == 16 and on_chip.constant_bytes == 0
    assert phased_report.on_chip_bytes - 16 + w_bytes == on_chip.on_chip_bytes
    assert sum(p.modeled_time_s for p in phased_report.phases) == pytest.approx(
        phased_report.estimated_step_time_s
    )
    text = str(phased_report)
    assert "Phases by name_scope" in text and "fc0" in text and "(no name_scope)" in text
    assert phased_report.to_dict()["phases"][1]["name"] == "fc0"


def test_report_has_no_phases_without_name_scopes():
    ir = popxl.Ir()
    with ir.main_graph:
        s = popxl.h2d_stream((4,), popxl.float32, "x")
        addons.host_store(ops.host_load(s) + 1)
    with popxl.Session(ir, "ipu_model") as session:
        session.run({s: np.zeros(4, np.float32)})
        report = session.memory_report()
    assert report.phases == () and "Phases" not in str(report)
    assert report.to_dict()["phases"] == []


# ---- use_fc_pass ----------------------------------------------------------------------------


def test_disable_fc_pass_records_the_setting_per_matmul_and_keeps_the_numbers():
    rng = np.random.default_rng(1)
    x_value = rng.normal(size=(8, 64)).astype(np.float32)
    w_values = [rng.normal(0, 0.1, (64, 64)).astype(np.float32) for _ in range(2)]
    outs = []
    for disable in (False, True):
        ir, xs, ys, weights = _two_layer_program(False, w_values, x_value)
        matmuls = [
            op for g in ir.graphs for op in g.ops if "mm" in str(getattr(op.attrs, "target", ""))
        ]
        assert matmuls and all(fc_pass_enabled(ir, op) for op in matmuls)
        if disable:
            disable_fc_pass(ir)
            assert not any(fc_pass_enabled(ir, op) for op in matmuls)
        with popxl.Session(ir, "ipu_model") as session:
            session.write_variables_data(weights)
            outs.append(session.run({xs: x_value})[ys])
        if disable:
            enable_fc_pass(ir)
            assert all(fc_pass_enabled(ir, op) for op in matmuls)
    np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(TypeError, match="expects a popxl Ir"):
        disable_fc_pass(ir.main_graph)
    not_matmul = next(op for op in ir.main_graph.ops if op.kind == "host_load")
    with pytest.raises(ValueError, match="not a matmul"):
        fc_pass_enabled(ir, not_matmul)


# ---- the phased MNIST example ---------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example():
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module("mnist_phased")
    finally:
        sys.path.remove(str(EXAMPLES))


def test_mnist_phased_step_matches_torch_adam_on_the_global_batch():
    """One step of the 7-phase program (DP 2, GA 2, RTS threshold 512) == torch Adam on the
    mean loss of all its samples, and each micro batch's loss is streamed back."""
    ex = _example()
    opts = ex.Options(micro_batch_size=3, gradient_accumulation=2, data_parallel=2)
    session, (img_stream, label_stream), variables, loss_stream = ex.train_program(opts)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 2, 3, 784)).astype(np.float32)  # (GA, DP, micro, 784)
    labels = rng.integers(0, 10, size=(2, 2, 3)).astype(np.int32)
    tensors = [t for v, _ in variables.values() for t in v.tensors]
    with session:
        before = session.get_tensors_data(tensors)
        losses = session.run({img_stream: images, label_stream: labels})[loss_stream]
        after = session.get_tensors_data(tensors)
        report = session.memory_report()

    params = {}
    for name, (vs, _) in variables.items():
        for key, t in vs.to_dict().items():
            params[f"{name}.{key}"] = torch.tensor(before[t].reshape(t.shape), requires_grad=True)
    x = torch.tensor(images.reshape(-1, 784))
    for i in (1, 2, 3):
        x = torch.nn.functional.gelu(
            x @ params[f"fc{i}.weight"] + params[f"fc{i}.bias"], approximate="tanh"
        )
    logits = x @ params["fc4.weight"] + params["fc4.bias"]
    target = torch.tensor(labels.reshape(-1), dtype=torch.long)
    per_sample = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    np.testing.assert_allclose(
        losses, per_sample.reshape(2, 2, 3).mean(-1).detach().numpy(), rtol=1e-5
    )
    per_sample.mean().backward()
    torch.optim.Adam(params.values(), lr=1e-3, eps=1e-5).step()
    for name, (vs, _) in variables.items():
        for key, t in vs.to_dict().items():
            np.testing.assert_allclose(
                after[t].reshape(t.shape), params[f"{name}.{key}"].detach().numpy(), atol=2e-5,
                err_msg=f"{name}.{key}",
            )  # fmt: skip

    # The report: nothing on chip between phases, each phase loads its own layer.
    assert report.variable_bytes == 0
    phases = {p.name: p for p in report.phases}
    assert list(phases) == ["fc1.fwd", "fc2.fwd", "fc3.fwd", "output", "fc3.bwd", "fc2.bwd",
                            "fc1.bwd"]  # fmt: skip
    assert all(p.live_in_bytes == 0 for p in report.phases)
    # fc2 forward, over both replicas: the weight and bias shards (512x512 and 512 floats in
    # all), and the GA input activations of each replica (3x512 floats).
    assert phases["fc2.fwd"].remote_load_bytes == (512 * 512 + 512) * 4 + 2 * 2 * 3 * 512 * 4
    # It stores its output and the pre-GELU activation its backward needs (its input is in
    # x_buffer already: the backward loads it from there, batch_serialise_fwd_and_grad).
    assert phases["fc2.fwd"].remote_store_bytes == 2 * (2 * 2 * 3 * 512 * 4)
    assert phases["fc2.fwd"].num_remote_loads == 2 + 2  # weight and bias shards, 2 inputs
    # A phase holds one layer's tensors: a forward phase less than the weights of all layers,
    # a backward phase less than what the unphased program keeps on chip throughout (the
    # weights, Adam's two moments and the gradient accumulators); larger layers need more.
    all_weights = (784 * 512 + 2 * 512 * 512 + 512 * 10 + 3 * 512 + 10) * 4
    peak = {name: p.peak_intermediate_bytes for name, p in phases.items()}
    assert max(peak["fc1.fwd"], peak["fc2.fwd"], peak["fc3.fwd"]) < all_weights
    assert max(peak.values()) < 4 * all_weights
    assert peak["fc1.bwd"] > peak["fc2.bwd"] == peak["fc3.bwd"] > peak["output"]


def _mnist_found() -> bool:
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module("common").find_mnist() is not None
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.mark.skipif(
    not _mnist_found(),
    reason="MNIST not found locally: set TORCH_POPXL_MNIST_DIR (tests do not download)",
)
def test_mnist_phased_example_learns_and_prints_the_phase_table(capsys):
    ex = _example()
    accuracy = ex.main(["--limit-steps", "12", "--micro-batch-size", "32", "--quiet"])
    assert accuracy >= 75  # 12 of 234 steps; the full epoch reaches 95 % and more
    out = capsys.readouterr().out
    table = out[out.index("Phases by name_scope") :]
    for name in ("fc1.fwd", "fc2.fwd", "fc3.fwd", "output", "fc3.bwd", "fc2.bwd", "fc1.bwd"):
        assert f"\n  {name} " in table


def test_docs_phased_block_prints_the_documented_phase_figures(capsys):
    root = Path(__file__).resolve().parent.parent
    pages = [p for p in sorted(root.glob("docs/*.md")) if "## Phased execution" in p.read_text()]
    assert len(pages) == 1, f"one docs page should hold '## Phased execution'; found {pages}"
    (page,) = pages
    text = page.read_text()
    section = text[text.index("## Phased execution") :]
    block = section[section.index("```python\n") + 10 : section.index("```\n")]
    exec(compile(block, str(page), "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "0 49152"  # three 64x64 float32 weights, all in streaming memory
    w, act = 64 * 64 * 4, 8 * 64 * 4
    assert lines[1:] == [f"layer{i} {w + 3 * act} {w} {w}" for i in range(3)]
