"""addons.TaskSession: named streams and exact checkpoint save / restore of weights and
optimizer state."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl.addons.layers import Linear
from torch_popxl.addons.optimizers.adam import AdamOptimizerStep
from torch_popxl.addons.task_session import TaskSession


def build_training_session(seed: int = 0) -> TaskSession:
    """One Adam step of a linear layer on ``sum((x @ W + b) ** 2)`` per run."""
    np.random.seed(seed)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        inputs = addons.InputStreams(x=((4, 3), popxl.float32))
        outputs = addons.OutputStreams(loss=((), popxl.float32))
        x = popxl.ops.host_load(inputs.x)
        facts, fwd = Linear(2).create_graph(x)
        names = ["weight", "bias"]
        bwd = addons.autodiff(fwd, grads_required=[fwd.args[n] for n in names])
        weights = facts.init()
        info = fwd.bind(weights).call_with_info(x)
        y = info.outputs[0]
        loss = popxl.ops.reduce_sum(y * y)
        popxl.ops.host_store(outputs.loss, loss)
        grads = bwd.call(y * 2.0, args=bwd.grad_graph_info.inputs_dict(info))
        opt = AdamOptimizerStep()
        optim = {}
        for name, grad in zip(names, grads, strict=True):
            w = weights[name]
            opt_facts, opt_graph = opt.create_graph(w, grad.spec, lr=0.1)
            state = opt_facts.init(prefix=f"optim.{name}")
            opt_graph.bind(state).call(w, grad)
            optim[name] = state
    model = addons.NamedTensors(fwd=weights, optim=addons.NamedTensors(**optim))
    return TaskSession(inputs, outputs, model, ir, "ipu_model")


def batches(n):
    rng = np.random.default_rng(7)
    return [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(n)]


def test_task_session_checkpoint_restores_weights_and_optimizer_state_exactly(tmp_path):
    data = batches(5)
    path = str(tmp_path / "ckpt" / "model.npz")
    with build_training_session() as a:
        assert sorted(a.model.to_dict()) == [
            "fwd.bias", "fwd.weight",
            "optim.bias.first_order", "optim.bias.second_order", "optim.bias.step",
            "optim.weight.first_order", "optim.weight.second_order", "optim.weight.step",
        ]  # fmt: skip
        for x in data[:3]:
            a.run({a.inputs.x: x})
        a.save_checkpoint(path)
        losses_a = [float(a.run({a.inputs.x: x})[a.outputs.loss]) for x in data[3:]]
        final_a = a.get_tensors_data(a.model.tensors)
    with build_training_session(seed=1) as b:  # different initial weights: all come from the file
        b.load_checkpoint(path, report_missing="error")
        losses_b = [float(b.run({b.inputs.x: x})[b.outputs.loss]) for x in data[3:]]
        final_b = b.get_tensors_data(b.model.tensors)
    assert losses_a == losses_b
    by_key_a = {k: final_a[t] for k, t in a.model.to_dict().items()}
    for k, t in b.model.to_dict().items():
        np.testing.assert_array_equal(final_b[t], by_key_a[k])
        assert final_b[t].dtype == by_key_a[k].dtype
    assert by_key_a["optim.weight.first_order"].dtype == np.float16  # Adam's default state dtype
    with np.load(path) as f:
        assert sorted(f.files) == sorted(a.model.to_dict())


def test_load_checkpoint_reports_missing_keys_and_writes_nothing_on_a_mismatch(tmp_path, caplog):
    path = str(tmp_path / "part.npz")
    with build_training_session() as s:
        before = {k: v.copy() for k, v in s.get_tensors_data(s.model.tensors).items()}
        np.savez(path, **{"fwd.weight": np.ones((3, 2), np.float32), "extra": np.zeros(1)})
        with pytest.raises(ValueError, match=r"Checkpoint Tensors not in model: \['extra'\]"):
            s.load_checkpoint(path, report_missing="error")
        with caplog.at_level(logging.WARNING):
            s.load_checkpoint(path)  # default 'warn': loads what matches
        assert "Model Tensors not in checkpoint" in caplog.text
        np.testing.assert_array_equal(
            s.get_tensor_data(s.model.fwd.weight), np.ones((3, 2), np.float32)
        )
        np.savez(
            path,
            **{"fwd.weight": np.zeros((3, 2), np.float32), "fwd.bias": np.zeros((5,), np.float32)},
        )
        with pytest.raises(ValueError):
            s.load_checkpoint(path, report_missing="none")  # bias has the wrong shape
        # all-or-nothing: the weight was not overwritten by the failed load
        np.testing.assert_array_equal(
            s.get_tensor_data(s.model.fwd.weight), np.ones((3, 2), np.float32)
        )
        np.testing.assert_array_equal(s.get_tensor_data(s.model.fwd.bias), before[s.model.fwd.bias])
        with pytest.raises(ValueError, match="report_missing must be one of"):
            s.load_checkpoint(path, report_missing="loud")


def test_load_from_session_copies_state_by_key_and_reads_upstream_pickled_checkpoints(tmp_path):
    with build_training_session(seed=3) as src, build_training_session(seed=4) as dst:
        src.run({src.inputs.x: batches(1)[0]})
        dst.load_from_session(src)
        want = {k: src.get_tensor_data(t) for k, t in src.model.to_dict().items()}
        for k, t in dst.model.to_dict().items():
            np.testing.assert_array_equal(dst.get_tensor_data(t), want[k])
        legacy = str(tmp_path / "legacy.npz")
        np.savez(
            legacy, ckpt={"fwd.weight": np.full((3, 2), 5, np.float32)}
        )  # popxl-addons' layout
        dst.load_checkpoint(legacy, report_missing="none")
        np.testing.assert_array_equal(
            dst.get_tensor_data(dst.model.fwd.weight), np.full((3, 2), 5, np.float32)
        )
