"""addons.TaskSession (popxl-addons 3.4 API): named streams and exact checkpoint save / restore
of weights and optimizer state, as checkpoint directories with one .npz per state tensor."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl.addons.layers import Linear
from torch_popxl.addons.optimizers.adam import AdamOptimizerStep
from torch_popxl.addons.task_session import TaskSession


def build_training_session(
    seed: int = 0, memmap_dir=None, read_only_if_exists=False
) -> TaskSession:
    """One Adam step of a linear layer on ``sum((x @ W + b) ** 2)`` per run; with
    ``memmap_dir`` the weights and optimizer state are np.memmap files there."""
    mm = {"memmap_dir": memmap_dir, "read_only_if_exists": read_only_if_exists}
    np.random.seed(seed)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        inputs = addons.InputStreams(x=((4, 3), popxl.float32))
        outputs = addons.OutputStreams(loss=((), popxl.float32))
        x = popxl.ops.host_load(inputs.x)
        facts, fwd = Linear(2).create_graph(x)
        names = ["weight", "bias"]
        bwd = addons.autodiff(fwd, grads_required=[fwd.args[n] for n in names])
        weights = facts.init(**mm)
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
            state = opt_facts.init(prefix=f"optim.{name}", **mm)
            opt_graph.bind(state).call(w, grad)
            optim[name] = state
    model = addons.NamedTensors(fwd=weights, optim=addons.NamedTensors(**optim))
    return TaskSession(inputs, outputs, state=model, ir=ir, device_desc="ipu_model")


def batches(n):
    rng = np.random.default_rng(7)
    return [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(n)]


def test_task_session_checkpoint_restores_weights_and_optimizer_state_exactly(tmp_path):
    data = batches(5)
    path = str(tmp_path / "ckpt")
    with build_training_session() as a:
        assert sorted(a.state.to_dict()) == [
            "fwd.bias", "fwd.weight",
            "optim.bias.first_order", "optim.bias.second_order", "optim.bias.step",
            "optim.weight.first_order", "optim.weight.second_order", "optim.weight.step",
        ]  # fmt: skip
        for x in data[:3]:
            a.run({a.inputs.x: x})
        a.save_checkpoint(path)
        by_key_a_at_save = {k: v.copy() for k, v in a.get_named_tensors_data().to_dict().items()}
        losses_a = [float(a.run({a.inputs.x: x})[a.outputs.loss]) for x in data[3:]]
        final_a = a.get_tensors_data(a.state.tensors)
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
    # One .npz per flat key under model/, holding the array under that key.
    files = sorted(p.name for p in (tmp_path / "ckpt" / "model").iterdir())
    assert files == sorted(f"{k}.npz" for k in a.state.to_dict())
    with np.load(tmp_path / "ckpt" / "model" / "fwd.weight.npz") as f:
        assert f.files == ["fwd.weight"]
        np.testing.assert_array_equal(f["fwd.weight"], by_key_a_at_save["fwd.weight"])
    assert b.session_state == {"steps": 5}  # 3 saved + 2 runs after loading


def _write_ckpt(folder, arrays, session_state=None):
    """A checkpoint directory in popxl-addons 3.4's layout, written by hand."""
    (folder / "model").mkdir(parents=True, exist_ok=True)
    for k, v in arrays.items():
        np.savez(folder / "model" / f"{k}.npz", **{k: v})
    if session_state is not None:
        (folder / "session_info.json").write_text(json.dumps(session_state))
    return str(folder)


def test_load_checkpoint_reports_missing_keys_and_writes_nothing_on_a_mismatch(tmp_path, caplog):
    with build_training_session() as s:
        before = {k: v.copy() for k, v in s.get_tensors_data(s.state.tensors).items()}
        part = _write_ckpt(
            tmp_path / "part",
            {"fwd.weight": np.ones((3, 2), np.float32), "extra": np.zeros(1)},
            {"steps": 7},
        )
        with pytest.raises(ValueError, match=r"Checkpoint keys not in state: \['extra'\]"):
            s.load_checkpoint(part, report_missing="error")
        assert s.session_state == {"steps": 0}  # the failed load changed nothing
        with caplog.at_level(logging.WARNING):
            s.load_checkpoint(part)  # default 'warn': loads what matches
        assert "state keys not in checkpoint" in caplog.text
        np.testing.assert_array_equal(
            s.get_tensor_data(s.state.fwd.weight), np.ones((3, 2), np.float32)
        )
        assert s.session_state == {"steps": 7}
        bad = _write_ckpt(
            tmp_path / "bad",
            {"fwd.weight": np.zeros((3, 2), np.float32), "fwd.bias": np.zeros((5,), np.float32)},
            {"steps": 9},
        )
        with pytest.raises(ValueError):
            s.load_checkpoint(bad, report_missing="none")  # bias has the wrong shape
        # all-or-nothing: neither the weight nor the session state changed in the failed load
        np.testing.assert_array_equal(
            s.get_tensor_data(s.state.fwd.weight), np.ones((3, 2), np.float32)
        )
        np.testing.assert_array_equal(s.get_tensor_data(s.state.fwd.bias), before[s.state.fwd.bias])
        assert s.session_state == {"steps": 7}
        with pytest.raises(ValueError, match="report_missing must be one of"):
            s.load_checkpoint(bad, report_missing="loud")
        with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
            s.load_checkpoint(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("report_missing", ["none", "warn", "error"])
def test_checkpoint_dir_without_session_info_raises_file_not_found_and_writes_nothing(
    tmp_path, report_missing
):
    # popxl-addons 3.4's __load_checkpoint_from_file opens <dir>/session_info.json with open()
    # whatever report_missing says: a directory lacking it raises FileNotFoundError (upstream
    # after writing the variables; here before anything is written).
    no_info = str(tmp_path / "no_info")
    with build_training_session(seed=2) as src:
        src.save_checkpoint(no_info)
        saved = src.get_tensor_data(src.state.fwd.weight).copy()
    os.remove(os.path.join(no_info, "session_info.json"))
    with build_training_session() as s:
        s.run({s.inputs.x: batches(1)[0]})
        before = {k: s.get_tensor_data(t).copy() for k, t in s.state.to_dict().items()}
        with pytest.raises(FileNotFoundError, match=r"no_info.*has no session_info\.json"):
            s.load_checkpoint(no_info, report_missing=report_missing)
        for k, t in s.state.to_dict().items():
            np.testing.assert_array_equal(s.get_tensor_data(t), before[k])
        assert s.session_state == {"steps": 1}
        (tmp_path / "no_info" / "session_info.json").write_text(json.dumps({"steps": 0}))
        s.load_checkpoint(no_info, report_missing="none")  # the fix the error names
        np.testing.assert_array_equal(s.get_tensor_data(s.state.fwd.weight), saved)
        assert s.session_state == {"steps": 0}


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
        # Unpickling runs code, so it is opt-in (test_pickled_checkpoint_... below).
        dst.load_checkpoint(legacy, report_missing="none", allow_pickle=True)
        np.testing.assert_array_equal(
            dst.get_tensor_data(dst.model.fwd.weight), np.full((3, 2), 5, np.float32)
        )


class _Payload:
    """Unpickling this creates the directory ``marker``: proof that loading ran code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _crafted_checkpoint(tmp_path, layout: str) -> tuple[str, str]:
    marker = str(tmp_path / "payload_ran")
    path = str(tmp_path / f"crafted_{layout}.npz")
    payload = np.array(_Payload(marker), dtype=object)
    if layout == "ckpt":  # popxl-addons' layout: one pickled dict under "ckpt"
        np.savez(path, ckpt={"fwd.weight": payload})
    else:  # an object array under a state key
        np.savez(path, **{"fwd.weight": payload})
    return path, marker


@pytest.mark.parametrize("layout", ["ckpt", "state_key"])
@pytest.mark.parametrize("api", ["load_checkpoint", "load_checkpoint_from_file"])
def test_pickled_checkpoint_is_refused_without_allow_pickle_and_runs_nothing(tmp_path, layout, api):
    # popxl-addons' TaskSession.load_checkpoint_from_file (task_session.py) calls
    # np.load(file_path, allow_pickle=True): a crafted file runs code when loaded. Here loading
    # is safe by default, as torch.load(weights_only=True) is torch's default.
    path, marker = _crafted_checkpoint(tmp_path, layout)
    with build_training_session(seed=5) as s:
        before = {k: s.get_tensor_data(t).copy() for k, t in s.state.to_dict().items()}
        with pytest.raises(ValueError, match=r"pickled.*pass allow_pickle=True"):
            getattr(s, api)(path, report_missing="none")
        assert not os.path.exists(marker), "loading ran code from the file"
        for k, t in s.state.to_dict().items():  # nothing was written
            np.testing.assert_array_equal(s.get_tensor_data(t), before[k])


def test_allow_pickle_opts_in_to_popxl_addons_pickled_format(tmp_path):
    path, marker = _crafted_checkpoint(tmp_path, "ckpt")
    with build_training_session(seed=5) as s:
        # Opting in unpickles (the payload runs: the caller said the file is trusted); the
        # resulting value is not a float32 array of the variable's shape, so nothing is written.
        with pytest.raises(TypeError, match="dtype"):
            s.load_checkpoint(path, report_missing="none", allow_pickle=True)
    assert os.path.exists(marker)


# ---- memmap-backed model state ---------------------------------------------------------------


def _files(folder):
    return {p.name: np.load(p) for p in sorted(folder.iterdir())}


def test_memmap_backed_task_session_trains_into_its_files_and_checkpoints_exactly(tmp_path):
    data = batches(5)
    mm_dir = tmp_path / "weights"
    ckpt = str(tmp_path / "ckpt")
    # Reference: the same training held in memory.
    with build_training_session() as ref:
        ref_losses = [float(ref.run({ref.inputs.x: x})[ref.outputs.loss]) for x in data]
        ref_final = {k: ref.get_tensor_data(t) for k, t in ref.model.to_dict().items()}
    with build_training_session(memmap_dir=str(mm_dir)) as a:
        # One .npy file per variable, named by the variable's name.
        assert sorted(_files(mm_dir)) == sorted(f"{t.name}.npy" for t in a.model.tensors)
        assert "optim.weight.first_order.npy" in _files(mm_dir)
        losses = [float(a.run({a.inputs.x: x})[a.outputs.loss]) for x in data[:3]]
        a.save_checkpoint(ckpt)
        # As upstream, a memmap-held tensor is checkpointed as a copy of its .npy file.
        assert sorted(_files(tmp_path / "ckpt" / "model")) == sorted(_files(mm_dir))
        losses += [float(a.run({a.inputs.x: x})[a.outputs.loss]) for x in data[3:]]
        final = {k: a.get_tensor_data(t) for k, t in a.model.to_dict().items()}
    assert losses == ref_losses  # memmaps change where weights live, not the numbers
    for k, v in final.items():
        np.testing.assert_array_equal(v, ref_final[k])
    # After the session, the files hold the trained state (weights_to_host wrote through).
    on_disk = {k: np.load(mm_dir / f"{t.name}.npy") for k, t in a.model.to_dict().items()}
    for k, v in on_disk.items():
        np.testing.assert_array_equal(v, final[k])
        assert v.dtype == final[k].dtype
    # A new session over the same folder reuses the files: it resumes from the trained state.
    with build_training_session(seed=9, memmap_dir=str(mm_dir)) as b:
        for k, t in b.model.to_dict().items():
            np.testing.assert_array_equal(b.get_tensor_data(t), final[k])
        # Restoring the checkpoint replays the last two steps exactly, into the files.
        b.load_checkpoint(ckpt, report_missing="error")
        again = [float(b.run({b.inputs.x: x})[b.outputs.loss]) for x in data[3:]]
    assert again == losses[3:]
    for k, t in b.model.to_dict().items():
        np.testing.assert_array_equal(np.load(mm_dir / f"{t.name}.npy"), final[k])


def test_memmap_checkpoint_load_is_all_or_nothing_and_read_only_files_refuse_it(tmp_path):
    mm_dir = tmp_path / "weights"
    with build_training_session(memmap_dir=str(mm_dir)) as s:
        s.run({s.inputs.x: batches(1)[0]})
    before = {p: v.copy() for p, v in _files(mm_dir).items()}
    bad = str(tmp_path / "bad.npz")
    np.savez(
        bad, **{"fwd.weight": np.zeros((3, 2), np.float32), "fwd.bias": np.zeros(5, np.float32)}
    )
    with build_training_session(memmap_dir=str(mm_dir)) as s:
        with pytest.raises(ValueError):
            s.load_checkpoint(bad, report_missing="none")  # the bias does not fit
    for p, v in _files(mm_dir).items():  # no file was touched, not even the weight's
        np.testing.assert_array_equal(v, before[p])
    good = str(tmp_path / "good.npz")
    np.savez(good, **{"fwd.weight": np.zeros((3, 2), np.float32)})
    s = build_training_session(memmap_dir=str(mm_dir), read_only_if_exists=True)
    assert s.weights_to_host_on_exit is False  # read-only files cannot be written back
    with pytest.raises(ValueError, match="read-only np.memmap"):
        s.load_checkpoint(good, report_missing="none")
    for p, v in _files(mm_dir).items():
        np.testing.assert_array_equal(v, before[p])
