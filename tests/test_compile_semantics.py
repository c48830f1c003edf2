"""popxl.compile keeps the torch objects as the source of truth (issue 13).

Every test runs the same data through eager torch and through the compiled program and
compares weights, losses and optimizer state. Tolerances as in test_compile.py: float32
reductions in a different order (per replica, per micro-batch).
"""

import copy
import gc
import io
import pickle

import numpy as np
import pytest
import torch

import torch_popxl as popxl

RTOL, ATOL = 2e-4, 2e-5
CE = torch.nn.functional.cross_entropy


def mlp(dropout=False):
    layers = [torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)]
    if dropout:
        layers.insert(2, torch.nn.Dropout(0.5))
    return torch.nn.Sequential(*layers)


def bn_mlp():
    return torch.nn.Sequential(torch.nn.Linear(12, 16, bias=False), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))  # fmt: skip


def batches(n, batch=16, seed=0):
    rng = np.random.default_rng(seed)
    return [(torch.from_numpy(rng.normal(size=(batch, 12)).astype(np.float32)),
             torch.from_numpy(rng.integers(0, 4, batch))) for _ in range(n)]  # fmt: skip


def eager_step(model, opt, x, y, chunks, max_norm=None):
    """The compiled schedule in eager torch: the mean of the chunks' gradients, one step."""
    opt.zero_grad()
    total = 0.0
    for xc, yc in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
        loss = CE(model(xc), yc)
        (loss / chunks).backward()
        total += loss.item() / chunks
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return total


def assert_close(a, b, what=""):
    np.testing.assert_allclose(
        torch.as_tensor(a).detach().numpy(),
        torch.as_tensor(b).detach().numpy(),
        rtol=RTOL,
        atol=ATOL,
        err_msg=what,
    )


def assert_same_params(m, ref):
    for (n, p), (_, q) in zip(m.state_dict().items(), ref.state_dict().items(), strict=True):
        assert_close(p.float(), q.float(), n)


def assert_same_optimizer_state(opt, ref_opt):
    a, b = opt.state_dict(), ref_opt.state_dict()
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys(), k
        for name in a["state"][k]:
            assert_close(a["state"][k][name], b["state"][k][name], f"{k}.{name}")


# (R, GA, rts, state): replication 1/2/4, accumulation 1/4, RTS on/off, on-chip/remote.
LAYOUTS = [(1, 1, False, "on_chip"), (2, 4, True, "remote"), (4, 1, True, "on_chip"),
           (4, 4, False, "remote")]  # fmt: skip
IDS = ["R1", "R2-GA4-rts-remote", "R4-rts", "R4-GA4-remote"]


def compiled(model, opt, layout, **kw):
    R, GA, rts, state = layout
    return popxl.compile(model, CE, opt, replication_factor=R, gradient_accumulation=GA,
                         rts_threshold=64 if rts else None, optimizer_state=state, **kw)  # fmt: skip


# ---- 1. hyperparameters are read from optimizer.param_groups at every step --------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_lr_scheduler_and_param_group_edits_match_eager(layout):
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (opt, ref_opt))
    trainer = compiled(model, opt, layout)
    R, GA = layout[0], layout[1]
    for i, (x, y) in enumerate(batches(5)):
        if i == 3:  # manual edits of the numeric hyperparameters
            for o in (opt, ref_opt):
                o.param_groups[0]["betas"] = (0.8, 0.99)
                o.param_groups[0]["eps"] = 1e-6
        loss = trainer.step(x, y)
        assert_close(loss, eager_step(ref, ref_opt, x, y, R * GA))
        sched.step()
        ref_sched.step()
    assert_same_params(model, ref)
    assert len(trainer.programs) == 1  # no rebuild for numeric changes


def test_sgd_param_groups_and_structure_changes_match_eager():
    """Two groups with their own lr / momentum; toggling weight decay rebuilds the program
    and carries the momentum buffers over."""
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)

    def make(m):
        return torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.05},
                                {"params": m[2].parameters(), "momentum": 0.5}],
                               lr=0.1, momentum=0.9)  # fmt: skip

    opt, ref_opt = make(model), make(ref)
    trainer = compiled(model, opt, (2, 1, True, "on_chip"))
    for i, (x, y) in enumerate(batches(5)):
        if i == 2:
            for o in (opt, ref_opt):
                o.param_groups[1]["lr"] = 0.02
                o.param_groups[1]["dampening"] = 0.3
        if i == 3:
            for o in (opt, ref_opt):
                o.param_groups[0]["weight_decay"] = 1e-2
        assert_close(trainer.step(x, y), eager_step(ref, ref_opt, x, y, 2))
    assert_same_params(model, ref)
    assert_same_optimizer_state(opt, ref_opt)


# ---- 2. train() / eval() select the program at each step -----------------------------------


@pytest.mark.parametrize("GA", [1, 4])
def test_train_eval_at_step_time_matches_eager_with_one_build_per_mode(GA):
    torch.manual_seed(0)
    model = bn_mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    trainer = compiled(model, opt, (1, GA, False, "on_chip"))
    for mode, (x, y) in zip(["train", "eval", "train", "eval"], batches(4), strict=True):
        getattr(model, mode)()
        getattr(ref, mode)()
        assert_close(trainer.step(x, y), eager_step(ref, ref_opt, x, y, GA))
    assert_same_params(model, ref)  # running statistics included
    assert_same_optimizer_state(opt, ref_opt)
    assert sorted(training for training, _ in trainer.programs) == [False, True]


def test_dropout_is_off_in_eval_mode():
    torch.manual_seed(0)
    model = mlp(dropout=True).eval()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    trainer = compiled(model, opt, (2, 1, False, "on_chip"))
    for x, y in batches(2):
        assert_close(trainer.step(x, y), eager_step(ref, ref_opt, x, y, 2))
    assert_same_params(model, ref)


# ---- 3. parameters are always current; the model stays an ordinary module --------------


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=IDS[:2])
def test_parameters_are_live_and_model_copies_and_pickles(layout):
    torch.manual_seed(0)
    model = mlp()
    cls = type(model)
    held = model[0].weight  # a reference taken before training
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    trainer = compiled(model, opt, layout)
    ema = copy.deepcopy(model)
    R, GA = layout[0], layout[1]
    for i, (x, y) in enumerate(batches(3)):
        if i == 1:  # an in-place edit between steps is used by the next step
            with torch.no_grad():
                model[2].bias.add_(0.5)
                ref[2].bias.add_(0.5)
        trainer.step(x, y)
        eager_step(ref, ref_opt, x, y, R * GA)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)
    assert type(model) is cls
    assert_close(held, ref[0].weight)
    assert_same_params(model, ref)
    assert_same_params(copy.deepcopy(model), ref)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert_same_params(torch.load(buf, weights_only=False), ref)
    assert_same_params(pickle.loads(pickle.dumps(model)), ref)
    assert not torch.equal(ema[0].weight, model[0].weight)  # the EMA saw the trained values
    model.double()  # new storage for every parameter: refused, not silently ignored
    with pytest.raises(ValueError, match="storage of '0.weight' was replaced"):
        trainer.step(*batches(1)[0])


def test_replaced_parameter_is_detected_and_recompiling_matches_eager():
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = compiled(model, opt, (2, 1, False, "on_chip"))
    data = batches(3)
    trainer.step(*data[0])
    new_weight = torch.randn(4, 32)
    model[2].weight = torch.nn.Parameter(new_weight.clone())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"\['2.weight'\].*replaced.*popxl.compile again"):
        trainer.step(*data[1])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # no change
    # The fix the message gives, done in eager torch as well: a new optimizer, then train on.
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    eager_step(ref, ref_opt, *data[0], 2)
    ref[2].weight = torch.nn.Parameter(new_weight.clone())
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    trainer = compiled(model, opt, (2, 1, False, "on_chip"))
    for x, y in data[1:]:
        assert_close(trainer.step(x, y), eager_step(ref, ref_opt, x, y, 2))
    assert_same_params(model, ref)
    assert_same_optimizer_state(opt, ref_opt)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1]], ids=IDS[:2])
def test_eager_optimizer_steps_mixed_with_compiled_steps_match_eager(kind, layout):
    """An eager warm-up step, compiled steps, an eager step in between: the state (moments,
    momentum buffers, Adam's step count) flows both ways, as in a pure eager loop."""
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)

    def make(m):
        if kind == "adam":
            return torch.optim.Adam(m.parameters(), lr=1e-2)
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    opt, ref_opt = make(model), make(ref)
    R, GA = layout[0], layout[1]
    data = batches(6)
    eager_step(model, opt, *data[0], R * GA)  # warm-up before compiling
    trainer = compiled(model, opt, layout)
    eager_step(ref, ref_opt, *data[0], R * GA)
    for i, (x, y) in enumerate(data[1:]):
        if i == 2:  # an eager step on the same model and optimizer, between compiled ones
            eager_step(model, opt, x, y, R * GA)
        else:
            trainer.step(x, y)
        eager_step(ref, ref_opt, x, y, R * GA)
    assert_same_params(model, ref)
    assert_same_optimizer_state(opt, ref_opt)


# ---- 4. optimizer.state as torch keeps it, and loads of torch checkpoints ----------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_optimizer_state_matches_torch_and_round_trips_through_eager(layout):
    torch.manual_seed(0)
    data = batches(4)
    R, GA = layout[0], layout[1]
    eager = mlp()
    start = copy.deepcopy(eager)
    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-2)
    for x, y in data[:2]:
        eager_step(eager, eager_opt, x, y, R * GA)
    # eager -> compiled: a torch checkpoint loaded into the optimizer and the model.
    ckpt = {
        "model": copy.deepcopy(eager.state_dict()),
        "opt": copy.deepcopy(eager_opt.state_dict()),
    }
    model = copy.deepcopy(start)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = compiled(model, opt, layout)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert trainer.state_dict()["optimizer"]["step"] == 2  # what was loaded, before a step
    for x, y in data[2:]:
        trainer.step(x, y)
        eager_step(eager, eager_opt, x, y, R * GA)
    assert_same_params(model, eager)
    assert_same_optimizer_state(opt, eager_opt)
    assert opt.state[model[0].weight]["exp_avg"].shape == (32, 12)  # unsharded, direct reads
    assert float(opt.state[model[0].weight]["step"]) == 4
    # compiled -> eager: exact (the saved tensors are the program's values).
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    back = copy.deepcopy(start)
    back_opt = torch.optim.Adam(back.parameters(), lr=1e-2)
    back.load_state_dict(saved["model"])
    back_opt.load_state_dict(saved["opt"])
    for k, st in back_opt.state_dict()["state"].items():
        for name, v in st.items():
            assert torch.equal(v, opt.state_dict()["state"][k][name])
    assert all(
        torch.equal(a, b) for a, b in zip(back.parameters(), model.parameters(), strict=True)
    )


def test_sgd_momentum_buffers_appear_in_optimizer_state():
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    trainer = compiled(model, opt, (4, 1, True, "remote"))
    assert len(opt.state) == 0  # as torch: empty before the first step
    for x, y in batches(2):
        trainer.step(x, y)
        eager_step(ref, ref_opt, x, y, 4)
    assert_same_optimizer_state(opt, ref_opt)
    assert copy.deepcopy(opt).state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_optimizer_state_is_current_after_the_trainer_is_garbage_collected(layout):
    """optimizer.state holds the trainer weakly: a trainer dropped (and collected) right after
    its last step still leaves that step's state, as eager's optimizer would hold it."""
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    R, GA = layout[0], layout[1]
    trainer = compiled(model, opt, layout)
    for x, y in batches(3):
        trainer.step(x, y)
        eager_step(ref, ref_opt, x, y, R * GA)
    del trainer
    gc.collect()
    assert float(opt.state[model[0].weight]["step"]) == 3
    assert_same_optimizer_state(opt, ref_opt)
    assert_same_params(model, ref)


# ---- 5. Trainer checkpoints are all-or-nothing -------------------------------------------


def test_trainer_load_state_dict_validates_everything_before_changing_anything():
    torch.manual_seed(0)
    model = mlp()
    trainer = compiled(model, torch.optim.Adam(model.parameters(), lr=1e-2), (2, 1, True, "remote"))
    x, y = batches(1)[0]
    trainer.step(x, y)
    good = trainer.state_dict()
    before = trainer.state_dict()

    def broken(edit):
        ckpt = copy.deepcopy(good)
        edit(ckpt)
        return ckpt

    cases = {
        "missing keys": lambda c: c["model"].pop("2.bias"),
        "unexpected keys": lambda c: c["model"].update(extra=torch.zeros(1)),
        r"'0.weight' is \(3, 3\)": lambda c: c["model"].update({"0.weight": torch.zeros(3, 3)}),
        "torch.float64": lambda c: c["model"].update({"2.bias": torch.zeros(4, dtype=torch.float64)}),
        "0.bias.exp_avg": lambda c: c["optimizer"]["state"]["0.bias"].pop("exp_avg"),
        r"\(5,\)": lambda c: c["optimizer"]["state"]["0.bias"].update(exp_avg_sq=torch.zeros(5)),
    }  # fmt: skip
    for match, edit in cases.items():
        ckpt = broken(edit)
        # the model part is valid in the optimizer cases: it must not be applied either
        ckpt["model"] = {
            k: (v + 1 if v.is_floating_point() else v) for k, v in ckpt["model"].items()
        }
        with pytest.raises(ValueError, match=match):
            trainer.load_state_dict(ckpt)
        after = trainer.state_dict()
        for k, v in before["model"].items():
            assert torch.equal(after["model"][k], v), (match, k)
        for n, st in before["optimizer"]["state"].items():
            for k, v in st.items():
                assert torch.equal(after["optimizer"]["state"][n][k], v), (match, n, k)


def test_checkpoint_loaded_before_first_step_is_what_state_dict_returns():
    torch.manual_seed(0)
    data = batches(3)
    a_model = mlp()
    a = compiled(a_model, torch.optim.Adam(a_model.parameters(), lr=1e-2), (2, 1, True, "on_chip"))
    a.step(*data[0])
    ckpt = a.state_dict()
    b_model = mlp()
    b = compiled(b_model, torch.optim.Adam(b_model.parameters(), lr=1e-2), (2, 1, True, "on_chip"))
    b.load_state_dict(ckpt)
    got = b.state_dict()
    assert got["optimizer"]["step"] == 1
    for n, st in ckpt["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optimizer"]["state"][n][k], v)
    assert [a.step(x, y) for x, y in data[1:]] == [b.step(x, y) for x, y in data[1:]]
    assert_same_params(a_model, b_model)


# ---- 6. / 9. inference follows the current parameters; structured inputs and outputs ----


@pytest.mark.parametrize("R", [1, 2])
def test_inference_program_follows_training(R):
    torch.manual_seed(0)
    model = mlp()
    infer = popxl.compile(model, replication_factor=R)
    x_test = batches(1, batch=8, seed=1)[0][0]
    assert_close(infer(x_test), model(x_test))
    trainer = compiled(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), (R, 1, False, "on_chip")
    )
    for x, y in batches(3):
        trainer.step(x, y)
        assert_close(infer(x_test), model(x_test))
    assert infer.ir is not None and len(infer._programs) == 1  # no rebuild per call


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 4)
        self.b = torch.nn.Linear(3, 4)

    def forward(self, x, z=None):
        h = self.a(x) + self.b(z)
        return {"sum": h, "parts": (h.relu(), h.mean(dim=1))}


def test_inference_takes_tuples_and_dicts_and_returns_the_model_structure():
    torch.manual_seed(0)
    model = TwoInputs()
    x, z = torch.randn(8, 12), torch.randn(8, 3)
    want = model(x, z)
    for R in (1, 2):
        for inputs in ((x, z), {"x": x, "z": z}):
            got = popxl.compile(model, replication_factor=R)(inputs)
            assert set(got) == {"sum", "parts"} and isinstance(got["parts"], tuple)
            assert_close(got["sum"], want["sum"])
            assert_close(got["parts"][0], want["parts"][0])
            assert_close(got["parts"][1], want["parts"][1])


class TwoInputsOneOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 4)
        self.b = torch.nn.Linear(3, 4)

    def forward(self, x, z):
        return self.a(x) * torch.sigmoid(self.b(z))


def two_targets_loss(out, targets):
    y, w = targets
    return CE(out, y) + torch.nn.functional.mse_loss(out.mean(dim=1), w)


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_trainer_takes_several_inputs_and_targets(as_dict):
    torch.manual_seed(0)
    model = TwoInputsOneOutput()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    trainer = popxl.compile(model, two_targets_loss, opt, replication_factor=2,
                            gradient_accumulation=2)  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(2):
        x, z = torch.randn(8, 12), torch.randn(8, 3)
        y, w = torch.from_numpy(rng.integers(0, 4, 8)), torch.randn(8)
        loss = trainer.step({"x": x, "z": z} if as_dict else (x, z), (y, w))
        ref_opt.zero_grad()
        want = 0.0
        for xc, zc, yc, wc in zip(x.chunk(4), z.chunk(4), y.chunk(4), w.chunk(4), strict=True):
            chunk_loss = two_targets_loss(ref(xc, zc), (yc, wc))
            (chunk_loss / 4).backward()
            want += chunk_loss.item() / 4
        ref_opt.step()
        assert_close(loss, want)
    assert_same_params(model, ref)
    with pytest.raises(ValueError, match="same number of samples"):
        trainer.step((x, z[:4]), (y, w))


class WithOptions(torch.nn.Module):
    """A forward with keyword options that choose its code path (as Hugging Face models take
    ``return_loss=True``, ``output_hidden_states=False``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 4)

    def forward(self, x, y=None, scale=1.0, activation="tanh", return_loss=False, extra=None):
        out = getattr(torch, activation)(self.fc(x)) * scale
        assert extra is None
        return CE(out, y) if return_loss else out


def test_keyword_options_are_passed_to_the_forward_and_key_the_programs():
    """Python values among a dict's inputs (Note [keyword options]) reach the forward as given,
    in training (R=2, GA=2: the loss the model returns) and inference, against eager; another
    value builds another program. Refused before: "inputs['return_loss'] must have a batch
    dimension; got a scalar"."""
    torch.manual_seed(0)
    model = WithOptions()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    trainer = popxl.compile(model, None, opt, replication_factor=2, gradient_accumulation=2)
    g = torch.Generator().manual_seed(3)
    for scale, activation in [(1.0, "tanh"), (3.0, "sigmoid"), (1.0, "tanh")]:
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)
        options = {"scale": scale, "activation": activation, "return_loss": True, "extra": None}
        loss = trainer.step({"x": x, "y": y, **options})
        ref_opt.zero_grad()
        want = ref(x, y, **options)
        want.backward()
        ref_opt.step()
        assert_close(loss, want.item())
    assert_same_params(model, ref)
    assert [p for _, p in trainer.programs] == [
        f"([x=(8, 12) float32, y=(8,) int64, {o}extra=None, return_loss=True, scale={s}], [])"
        for o, s in [("activation='sigmoid', ", 3.0), ("activation='tanh', ", 1.0)]
    ]
    x = torch.randn(6, 12, generator=g)
    got = popxl.compile(model, replication_factor=2)({"x": x, "scale": 2.0, "activation": "relu"})
    assert_close(got, model(x, scale=2.0, activation="relu"))
    with pytest.raises(ValueError, match=r"keyword options only \(\['return_loss'\]\)"):
        trainer.step({"return_loss": True})


# ---- 8. max_grad_norm ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_max_grad_norm_matches_clip_grad_norm(layout):
    torch.manual_seed(0)
    model = mlp()
    ref, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt, un_opt = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
                            for m in (model, ref, unclipped))  # fmt: skip
    trainer = compiled(model, opt, layout, max_grad_norm=0.05)
    R, GA = layout[0], layout[1]
    for x, y in batches(3):
        assert_close(trainer.step(x, y), eager_step(ref, ref_opt, x, y, R * GA, max_norm=0.05))
        eager_step(unclipped, un_opt, x, y, R * GA)
    assert_same_params(model, ref)
    # the clip was active: without it the weights are far from these
    assert (unclipped[0].weight - model[0].weight).abs().max() > 1e-2


# ---- 10. / 11. plan before running; device errors at compile -------------------------------


def test_memory_report_is_available_before_the_first_step():
    torch.manual_seed(0)
    model = mlp()
    trainer = compiled(model, torch.optim.Adam(model.parameters()), (4, 1, True, "remote"))
    with pytest.raises(ValueError, match="trainer.plan"):
        trainer.memory_report()
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    trainer.plan(x, y)
    planned = trainer.memory_report()
    assert len(trainer.optimizer.state) == 0  # planning runs nothing
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    trainer.step(x, y)
    assert trainer.memory_report().on_chip_bytes == planned.on_chip_bytes
    assert planned.streaming_bytes > 0  # the sharded Adam state, off chip


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_fails_at_compile():
    model = mlp()
    with pytest.raises(ValueError, match="no CUDA GPU"):
        popxl.compile(model, CE, torch.optim.SGD(model.parameters(), lr=0.1), device="cuda")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        popxl.compile(model, device="cuda")


# ---- 7. dtypes (bf16, autocast and loss scaling: tests/test_compile_dtypes.py) -----------


def test_float16_model_trains_like_eager_float16():
    torch.manual_seed(0)
    model = mlp().half()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    trainer = compiled(model, opt, (2, 1, False, "on_chip"))
    for x, y in batches(3):
        loss = trainer.step(x.half(), y)
        np.testing.assert_allclose(loss, eager_step(ref, ref_opt, x.half(), y, 2), rtol=2e-3)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float16
        # One float16 ulp at |p| < 0.5: the update rounds as torch's (Note [optimizer
        # arithmetic as torch rounds it]); the replicas' addmm rounds before its bias.
        np.testing.assert_allclose(p.float().detach(), q.float().detach(), rtol=0, atol=2.5e-4)


def test_a_trainer_collected_inside_a_fake_mode_still_publishes_its_optimizer_state():
    """The collector may delete a trainer while a fragment is traced on fake tensors; its
    last step's off-chip, sharded optimizer state still reaches ``optimizer.state`` as real
    tensors, equal to eager's after the same step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.Adam(model.parameters()), torch.optim.Adam(ref.parameters())
    trainer = popxl.compile(model, torch.nn.functional.mse_loss, opt, replication_factor=2,
                            optimizer_state="remote", rts_threshold=1)  # fmt: skip
    x, y = np.ones((4, 5), np.float32), np.ones((4, 1), np.float32)
    trainer.step(x, y)
    torch.nn.functional.mse_loss(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    ref_opt.step()
    with FakeTensorMode():
        del trainer
        gc.collect()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        got, want = opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"]
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


class TeacherForced(torch.nn.Module):
    """A seq2seq decoder that feeds either the targets or its own predictions (the PyTorch
    seq2seq tutorial's teacher forcing), drawn from Python's ``random`` unless given."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.cell = torch.nn.Embedding(10, 8), torch.nn.GRUCell(8, 8)
        self.out = torch.nn.Linear(8, 10)

    def forward(self, src, tgt, teacher_forcing=None):
        import random

        if teacher_forcing is None:
            teacher_forcing = random.random() < 0.5
        h, tok, outs = self.emb(src).mean(1), src[:, 0], []
        for t in range(tgt.shape[1]):
            h = self.cell(self.emb(tok), h)
            outs.append(self.out(h))
            tok = tgt[:, t] if teacher_forcing else outs[-1].argmax(-1)
        return torch.stack(outs, 1)


def _seq_ce(out, y):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def test_python_random_draws_in_captured_code_are_refused_and_passing_them_in_trains_as_eager():
    """Note [Python random numbers in captured code]: a program would repeat the build's draw."""
    import random

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 10, (8, 5), generator=g), torch.randint(0, 10, (8, 3), generator=g))
            for _ in range(4)]  # fmt: skip
    model = TeacherForced()
    before = copy.deepcopy(model.state_dict())
    trainer = popxl.compile(model, _seq_ce, torch.optim.SGD(model.parameters(), lr=0.1),
                            replication_factor=2)  # fmt: skip
    with pytest.raises(popxl.errors.DataDependentError, match="draws from Python's `random`"):
        trainer.step({"src": data[0][0], "tgt": data[0][1]}, data[0][1])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k

    def numpy_noise(out, y):
        return _seq_ce(out, y) * float(np.random.uniform(0.9, 1.1))

    other = popxl.compile(model, numpy_noise, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(popxl.errors.DataDependentError, match="numpy's global generator"):
        other.step({"src": data[0][0], "tgt": data[0][1], "teacher_forcing": True}, data[0][1])

    # The way out the error names: draw on the host, pass the value in as a keyword option.
    eager = TeacherForced()
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    random.seed(1)
    draws = [random.random() < 0.5 for _ in data]
    assert len(set(draws)) == 2  # both branches
    for (src, tgt), tf in zip(data, draws, strict=True):
        opt.zero_grad()
        want = _seq_ce(eager(src, tgt, teacher_forcing=tf), tgt)
        want.backward()
        opt.step()
        got = trainer.step({"src": src, "tgt": tgt, "teacher_forcing": tf}, tgt)
        assert got == pytest.approx(want.item(), rel=1e-5)
    assert_same_params(model, eager)


# ---- data-parallel wrappers (Note [data-parallel wrappers]) ------------------------------


def _adam_trained_as_eager(make, layout, wrap=None):
    """``make()`` trained three Adam steps through popxl.compile (given wrapped in ``wrap``
    when set) and an equal copy eagerly on the compiled schedule: losses, weights and Adam
    state compared; returns (model, eager copy)."""
    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    given = model if wrap is None else wrap(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (given, ref))
    trainer = compiled(given, opt, layout)
    R, GA = layout[:2]
    for x, y in batches(3):
        assert_close(trainer.step(x, y), eager_step(ref, ref_opt, x, y, R * GA), "loss")
    assert_same_params(model, ref)
    assert_same_optimizer_state(opt, ref_opt)
    return model, ref


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=IDS[:2])
def test_a_model_wrapped_in_data_parallel_trains_as_the_module_it_holds(layout):
    """Scripts written for GPUs wrap their model in nn.DataParallel; compiling the wrapper
    trains the module it holds as eager does (DataParallel on the CPU calls the module), and
    the wrapper, the module and the optimizer all see the trained weights and state."""
    model, ref = _adam_trained_as_eager(mlp, layout, wrap=torch.nn.DataParallel)
    wrapped = torch.nn.DataParallel(model)
    x = batches(1, seed=5)[0][0]
    with torch.no_grad():
        assert_close(wrapped(x), ref(x), "the wrapper's forward after training")
        assert_close(popxl.compile(wrapped, replication_factor=2)(x), ref(x), "inference")


def test_hooks_on_a_data_parallel_wrapper_are_refused_before_anything_changes():
    torch.manual_seed(0)
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    wrapped = torch.nn.DataParallel(model)
    wrapped.register_forward_hook(lambda m, i, o: o * 2)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"DataParallel wrapper has its own hooks.*model\.module"):
        popxl.compile(wrapped, CE, opt)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


# ---- a loss that reads the model (Note [the loss reads the model's parameters]) ----------


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_an_l2_penalty_the_loss_fn_reads_from_the_model_trains_as_eager(layout):
    """``loss_fn`` closes over the model and adds an L2 penalty on its parameters: the penalty
    and its gradient follow the trained weights at every step (bit for bit at one replica)."""
    torch.manual_seed(0)
    model, ref = mlp(), mlp()
    ref.load_state_dict(model.state_dict())

    def penalised(m):
        return lambda out, y: CE(out, y) + 0.01 * sum(p.pow(2).sum() for p in m.parameters())

    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    R, GA, rts, state = layout
    trainer = popxl.compile(model, penalised(model), opt, replication_factor=R,
                            gradient_accumulation=GA, rts_threshold=64 if rts else None,
                            optimizer_state=state)  # fmt: skip
    for x, y in batches(3):
        ref_opt.zero_grad()
        want = penalised(ref)(ref(x), y)
        want.backward()
        ref_opt.step()
        got = trainer.step(x, y)
        if R * GA == 1:
            assert got == want.item()
        assert_close(got, want.item(), "loss")
    if R * GA == 1:
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)
    assert_same_params(model, ref)
    assert_same_optimizer_state(opt, ref_opt)


# ---- writes under a boolean mask (runtime/explicit.py _masked_index_put) ------------------


class _MaskedWrites(torch.nn.Module):
    """``x[mask] = v`` in four forms: a mask from the data, a fixed mask over a later dim
    (``h[:, dead] = v``), a row of values added to the masked rows (``accumulate=True``),
    and out of place (``torch.index_put``)."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(12, 16), torch.nn.Linear(16, 4)
        self.register_buffer("dead", torch.arange(16) % 5 == 0)
        self.register_buffer("shift", torch.tensor([0.5, -0.25, 0.0, 1.0]))

    def forward(self, x):
        h = self.inp(x)
        h[h < 0] = 0.0
        h[:, self.dead] = 0.5
        out = self.out(h)
        out = out.index_put((out.sum(1) > 0,), self.shift, accumulate=True)  # rows += shift
        return torch.index_put(out, (out > 0.3,), torch.tensor(0.3))


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_writes_under_a_boolean_mask_train_as_eager(layout):
    """torch's batching rule refuses ``index_put`` with a boolean mask (a selection's size
    depends on the data); one value written under one mask is a ``masked_fill``: the same
    numbers on every replica (Gemma 3 writes its token ids so)."""
    _adam_trained_as_eager(_MaskedWrites, layout)


class _BuildsALayerInForward(torch.nn.Module):
    """BigBird's forward (block-sparse attention on a short sequence) builds new attention
    layers and moves its weights into them: a layer made inside the forward, whose
    initialisation writes its fresh parameters in place."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        torch.nn.Linear(12, 12)  # made and dropped, as the weights BigBird's new layers make
        return self.net(x)


def test_a_layer_built_inside_the_forward_trains_as_eager():
    torch.manual_seed(0)
    model = _BuildsALayerInForward()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    trainer = compiled(model, opt, LAYOUTS[1])
    for x, y in batches(2):
        assert_close(trainer.step(x, y), eager_step(ref, ref_opt, x, y, 8), "loss")
    assert_same_params(model, ref)


class _ScoresAndLoss(torch.nn.Module):
    def __init__(self, reduction: str):
        super().__init__()
        self.net, self.reduction = mlp(), reduction

    def forward(self, x, labels):
        scores = self.net(x)
        return {"scores": scores, "loss": CE(scores, labels, reduction=self.reduction)}


@pytest.mark.parametrize("R, reduction", [(1, "mean"), (2, "none"), (3, "none"), (3, "mean")])
def test_inference_hands_int64_inputs_to_the_model_as_int64(R, reduction):
    """Host int64 travels as int32 (as PopXL streams it); the model gets int64 back, as in
    eager: a cross-entropy on labels given to an inference program takes them (16 rows on 3
    replicas are padded, the padding's outputs dropped; a mean over the batch is put
    together from the replicas' parts: tests/test_compile_infer_losses.py)."""
    torch.manual_seed(0)
    model = _ScoresAndLoss(reduction).eval()
    x, y = batches(1)[0]
    got = popxl.compile(model, replication_factor=R)({"x": x, "labels": y})
    with torch.no_grad():
        want = model(x, y)
    assert_close(got["scores"], want["scores"], "scores")
    assert_close(got["loss"], want["loss"], "loss")
