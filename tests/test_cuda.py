"""The simulator on a CUDA GPU: kernels, Sessions with replication, RTS and remote buffers,
popxl.compile against eager torch, and one NCCL process.

Every test here needs a GPU (marker ``cuda``) and is skipped without one. The oracles are
the same programs on the CPU simulator (which the rest of the suite checks against references)
and eager torch on the GPU. Tolerances: integer results and data movement (gathers, slices,
remote loads and stores) are exact; float reductions may sum in another order on the GPU
(rtol 1e-6); trained weights after a few steps rtol 1e-5 / atol 1e-6 (Adam: 2e-5).

The rest of the suite can run on the GPU too, unchanged: ``TORCH_POPXL_DEVICE=cuda`` makes
every Session and ``popxl.compile`` that names no device hold its replicas there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl import ops
from torch_popxl.opdefs._common import VALID_OPS
from torch_popxl.runtime import gemm as G

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_C = torch.ops.torch_popxl
DEVICES = ("cpu", "cuda")


# ---- the C++ kernels on CUDA tensors ------------------------------------------------------


def _stacked(R=4, shape=(6,), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(R, *shape, generator=g).to(dtype)
    return torch.randint(0, 2 if dtype == torch.bool else 50, (R, *shape), generator=g).to(dtype)


@pytest.mark.parametrize("op", VALID_OPS)
@pytest.mark.parametrize("group", [(1, 1), (2, 1), (2, 2), (4, 1)])  # (size, stride)
def test_stacked_collectives_on_cuda_equal_the_cpu_kernels(op, group):
    size, stride = group
    dtype = torch.bool if op in ("and", "or") else torch.float32
    x = _stacked(dtype=dtype)
    for name, args in [
        ("all_reduce_stacked", (op, size, stride)),
        ("reduce_scatter_stacked", (op, size, stride)),
    ]:
        if name == "reduce_scatter_stacked" and op not in ("add", "mean", "max", "min", "mul"):
            continue
        cpu = getattr(_C, name)(x, *args)
        gpu = getattr(_C, name)(x.cuda(), *args)
        assert gpu.is_cuda
        torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-6, atol=1e-6, msg=name)
    gathered = _C.all_gather_stacked(x, size, stride)
    assert torch.equal(_C.all_gather_stacked(x.cuda(), size, stride).cpu(), gathered)
    own = _C.take_own_stacked(gathered, size, stride)
    assert torch.equal(_C.take_own_stacked(gathered.cuda(), size, stride).cpu(), own)


def test_full_group_kernels_and_fused_matmul_on_cuda():
    x = _stacked(shape=(5, 3))
    torch.testing.assert_close(_C.all_reduce_full(x.cuda(), "add").cpu(),
                               _C.all_reduce_full(x, "add"), rtol=1e-6, atol=1e-6)  # fmt: skip
    assert torch.equal(_C.all_gather_full(x.cuda()).cpu(), _C.all_gather_full(x))
    a, b = _stacked(shape=(8, 5)), _stacked(shape=(5, 7), seed=1)
    torch.testing.assert_close(_C.mm_all_reduce_stacked(a.cuda(), b.cuda(), "add").cpu(),
                               _C.mm_all_reduce_stacked(a, b, "add"), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_gemm_on_cuda_is_torch_matmul():
    # On a GPU the simulator's gemm is ATen's (cuBLAS): bit-equal to torch's own call.
    a, b, bias = (torch.randn(64, 96, device="cuda"), torch.randn(96, 48, device="cuda"),
                  torch.randn(48, device="cuda"))  # fmt: skip
    for kernel in G.KERNELS if torch.backends.mkldnn.is_available() else ("aten",):
        with G.using(kernel):
            assert torch.equal(_C.gemm(a, b, bias), torch.addmm(bias, a, b))
            assert torch.equal(_C.gemm(a, b), torch.mm(a, b))


def test_remote_kernels_on_cuda_move_the_same_rows():
    R, entries = 2, 3
    buffer = torch.arange(R * entries * 4, dtype=torch.float32).reshape(R, entries, 4)
    offsets = torch.tensor([2, 0])
    value = -torch.ones(R, 4)
    cpu_buf, gpu_buf = buffer.clone(), buffer.cuda()
    loaded = _C.remote_load_stacked(gpu_buf, offsets, 1)
    assert loaded.is_cuda and torch.equal(loaded.cpu(), _C.remote_load_stacked(cpu_buf, offsets, 1))
    _C.remote_store_stacked_(cpu_buf, offsets, value, 1)
    _C.remote_store_stacked_(gpu_buf, offsets, value.cuda(), 1)
    assert torch.equal(gpu_buf.cpu(), cpu_buf)


@pytest.mark.parametrize("device", DEVICES)
def test_a_value_on_another_device_is_a_clear_error_never_a_crash(device):
    # In a child process: a crash there fails this test instead of ending the run.
    code = (
        "import torch, torch_popxl\n"
        f"buf = torch.zeros(2, 3, 4, device={device!r})\n"
        "other = 'cpu' if buf.is_cuda else 'cuda'\n"
        "try:\n"
        "    torch.ops.torch_popxl.remote_store_stacked_(buf, torch.tensor([0, 1]),\n"
        "                                               torch.ones(2, 4, device=other), 1)\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert done.returncode == 0, f"rc={done.returncode}: {done.stderr[-2000:]}"
    assert "ValueError: remote_store: value is on" in done.stdout, done.stdout


# ---- Sessions: replication, RTS, remote buffers ---------------------------------------------


def _rts_training_program(R=4):
    """Two SGD steps of a linear layer whose weight is an RTS variable (on chip) and whose bias
    is a remote RTS variable, gradients reduce-scattered onto the shards; plus a remote buffer
    written and read back and a host stream per replica."""
    ir = popxl.Ir(replication=R)
    ir.num_host_transfers = 2
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(8, 4)).astype(np.float32)
    b0 = rng.normal(size=(4,)).astype(np.float32)
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((3, 8), popxl.float32, "x")
        w, w_shard = popxl.replica_sharded_variable(w0, popxl.float32, "w")
        b_buf = popxl.replica_sharded_buffer(b0.shape, popxl.float32)
        b = popxl.remote_replica_sharded_variable(b0, b_buf, 0, name="b")
        scratch = popxl.remote_buffer((4,), popxl.float32, entries=2)
        losses = popxl.d2h_stream((), popxl.float32, "loss")
        echoes = popxl.d2h_stream((4,), popxl.float32, "echo")
        for step in range(2):
            x = ops.host_load(xs)
            b_shard = ops.remote_load(b_buf, 0)
            W = ops.collectives.replicated_all_gather(w_shard).reshape((8, 4))
            B = ops.collectives.replicated_all_gather(b_shard).reshape((4,))
            y = x @ W + B
            ops.host_store(losses, ops.mean(y * y))
            dy = y * (2.0 / y.nelms)
            dW = ops.matmul(ops.transpose(x), dy).flatten()
            dB = ops.sum(dy, 0)
            gw = ops.collectives.replicated_reduce_scatter(dW, "mean", configure_output_for_replicated_tensor_sharding=True)  # fmt: skip
            gb = ops.collectives.replicated_reduce_scatter(dB, "mean", configure_output_for_replicated_tensor_sharding=True)  # fmt: skip
            ops.scaled_add_(w_shard, gw, b=-0.1)
            ops.scaled_add_(b_shard, gb, b=-0.1)
            ops.remote_store(b_buf, 0, b_shard)
            ops.remote_store(scratch, step, B * 2.0)
            ops.host_store(echoes, ops.remote_load(scratch, step))
    x = rng.normal(size=(2, R, 3, 8)).astype(np.float32)
    return ir, {"x": xs, "loss": losses, "echo": echoes, "w": w, "b": b}, x


@pytest.mark.parametrize("executor", ("fast", "reference"))
def test_rts_and_remote_session_on_cuda_equals_cpu(executor):
    got = {}
    for device in DEVICES:
        ir, h, x = _rts_training_program()
        with popxl.Session(ir, "ipu_hw", device=device, executor=executor) as session:
            assert session.device.type == device
            out = session.run({h["x"]: x})
            counters = session._last_run_counters
            got[device] = {
                "loss": out[h["loss"]], "echo": out[h["echo"]],
                "w": session.get_tensor_data(h["w"]), "b": session.get_tensor_data(h["b"]),
            }  # fmt: skip
            got[device]["counters"] = counters
    for key in ("loss", "echo", "w", "b"):
        np.testing.assert_allclose(got["cuda"][key], got["cpu"][key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)  # fmt: skip
    # The weights really trained, and the traffic the report counts is the same on both.
    ir, h, _ = _rts_training_program()
    assert not np.allclose(got["cpu"]["w"], ir._variables[h["w"].id][1])
    if executor == "fast":
        assert got["cuda"]["counters"] == got["cpu"]["counters"]


def test_the_device_env_var_is_the_default_device(monkeypatch):
    monkeypatch.setenv("TORCH_POPXL_DEVICE", "cuda")
    ir, h, x = _rts_training_program()
    with popxl.Session(ir, "ipu_hw") as session:
        assert session.device.type == "cuda"
        session.run({h["x"]: x})
    monkeypatch.setenv("TORCH_POPXL_DEVICE", "cuda:99")
    with pytest.raises(ValueError, match=r"TORCH_POPXL_DEVICE='cuda:99'.*CUDA device"):
        popxl.Session(_rts_training_program()[0], "ipu_hw")


def test_weights_and_host_io_round_trip_through_the_gpu():
    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        v = popxl.variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="v")
        ops.var_updates.accumulate_(v, popxl.constant(np.ones((2, 3), np.float32)))
    with popxl.Session(ir, "ipu_hw", device="cuda") as session:
        session.run()
        np.testing.assert_array_equal(session.get_tensor_data(v), np.arange(6).reshape(2, 3) + 1)
        session.write_variable_data(v, np.full((2, 3), 7, np.float32))
        session.run()
        np.testing.assert_array_equal(session.get_tensor_data(v), np.full((2, 3), 8))


# ---- popxl.compile on the GPU against eager torch ------------------------------------------


def _mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.LayerNorm(64), torch.nn.ReLU(), torch.nn.Linear(64, 5))  # fmt: skip


class _Attention(torch.nn.Module):
    """Causal self-attention over 20 features as 4 tokens of 5 (scaled_dot_product_attention:
    captured on the CPU as its flash kernel, run on the GPU by Note [portable attention])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.qkv, self.out = torch.nn.Linear(5, 15), torch.nn.Linear(20, 5)

    def forward(self, x):
        q, k, v = self.qkv(x.view(-1, 4, 5)).unsqueeze(1).chunk(3, dim=-1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.flatten(1))


MODELS = {"mlp": _mlp, "attention": _Attention}


@pytest.mark.parametrize(
    "layout",
    [{}, {"rts_threshold": 64}, {"rts_threshold": 64, "optimizer_state": "remote"}],
    ids=["on-chip", "rts", "rts+remote"],
)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model", MODELS)
def test_compiled_trainer_on_cuda_trains_as_eager_cuda(model, layout, optimizer):
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        # eps: Adam turns rounding noise on a gradient that is 0 in exact arithmetic (the key
        # bias of attention) into steps of +-lr; eps = 1e-4 keeps that below float32 rounding.
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-4),
    }[optimizer]
    eager, compiled = MODELS[model]().cuda(), MODELS[model]()
    opt = make(eager.parameters())
    trainer = popxl.compile(compiled, torch.nn.functional.cross_entropy, make(compiled.parameters()),
                            replication_factor=2, gradient_accumulation=2, device="cuda",
                            **layout)  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(4):
        x = rng.normal(size=(16, 20)).astype(np.float32)
        y = rng.integers(0, 5, 16)
        loss = trainer.step(x, y)
        opt.zero_grad()
        ref = torch.nn.functional.cross_entropy(eager(torch.from_numpy(x).cuda()),
                                                torch.from_numpy(y).cuda())  # fmt: skip
        ref.backward()
        opt.step()
        np.testing.assert_allclose(float(loss), ref.item(), rtol=1e-5)
    trainer.sync_weights()
    tol = 2e-5 if optimizer == "adam" else 1e-6
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=tol)


def test_compiled_inference_on_cuda_equals_eager():
    model = _mlp().eval()
    x = torch.randn(8, 20)
    program = popxl.compile(model, replication_factor=2, device="cuda")
    got = program(x)
    torch.testing.assert_close(torch.as_tensor(got).cpu(), model(x), rtol=1e-5, atol=1e-5)


# ---- one NCCL process ------------------------------------------------------------------------


def test_one_nccl_process_matches_the_simulator(tmp_path):
    """tests/test_distributed.py's scenarios in one torchrun process on the NCCL backend with
    the replicas on the GPU, against the same scenarios in this process on the CPU."""
    sys.path.insert(0, str(Path(__file__).parent))
    import test_distributed as td

    env = {**os.environ, "TORCH_POPXL_DIST_BACKEND": "nccl", "TORCH_POPXL_DEVICE": "cuda",
           "TORCH_POPXL_REPLICATION_FACTOR": str(td.R), "TORCH_POPXL_DIST_TIMEOUT_S": "120"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
           "--master_addr=127.0.0.1", f"--master_port={td._free_port()}", td.__file__, "all",
           str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sim = {}
    for name, (fn, executors) in td.SCENARIOS.items():
        for executor in executors:
            for k, v in fn(td.R, executor).items():
                sim[f"{name}/{executor}/{k}"] = np.asarray(v)
    ranks = [dict(np.load(tmp_path / "rank0.npz"))]
    compared = sum(
        td._compare(f"{name}/{executor}/", sim, ranks)
        for name, (_, executors) in td.SCENARIOS.items()
        for executor in executors
    )
    assert compared > 50
