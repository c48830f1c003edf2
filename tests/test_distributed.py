"""Several processes, one PopXL program: torch.distributed (gloo) against the simulator.

Every scenario is a function ``scenario(replication, executor) -> {key: array}``. The tests run
it in this process with ``Ir(replication=4)`` (the simulator is the oracle) and, through
``torchrun``, on 2 and 4 gloo processes on 127.0.0.1 with ``Ir(replication="popdist")`` and
``TORCH_POPXL_REPLICATION_FACTOR=4`` (2 instances x 2 replicas, 4 instances x 1 replica).
Keys say how the instances' values combine:

* ``run/<name>``: a ``session.run`` output in canonical shape ``(nht, R_local, *shape)``;
  the instances' arrays, concatenated along dim 1 in rank order, must equal the simulator's;
* ``host/<name>``: a host read (``get_tensor_data``, a loss); every instance must return the
  simulator's full global value;
* ``calls/<name>``, ``bytes/<name>``: traffic counters of a run; calls are per instance and
  equal, bytes are this instance's share and sum to the simulator's.

Tolerances: integer results and host transfers are exact; float collectives that sum across
processes reduce in a different order, so they match to rtol=1e-6, trained weights to 1e-5.

The same file is the worker: ``python tests/test_distributed.py <scenario set> <out dir>``
under torchrun. All launches start together and share one bounded wait.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.runtime import distributed

R = 4
EXECUTORS = ("fast", "reference")
FAIL_TIMEOUT_S = 4.0
LAUNCH_BUDGET_S = 240.0


# ---- scenarios ------------------------------------------------------------------------------


def _store(t):
    s = popxl.d2h_stream(t.shape, t.dtype)
    ops.host_store(s, t)
    return s


def _offset(ir) -> int:
    """The first global replica of this instance (0 in one process)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return rank * ir.instance_replication_factor


def _canonical(ir, arr: np.ndarray, shape) -> np.ndarray:
    return np.asarray(arr).reshape(ir.num_host_transfers, ir.instance_replication_factor, *shape)


def _session(ir, executor):
    return popxl.Session(ir, "ipu_hw", executor=executor)


def scenario_collectives(replication, executor):
    """Spec §11.5 with R=4 (x_r = [r]): every collective under every grouping of 4 replicas."""
    ir = popxl.Ir(replication=replication)
    streams = {}
    with ir.main_graph:
        x = popxl.variable(
            np.arange(R, dtype=np.float32)[:, None], replica_grouping=ir.replica_grouping(1, 1)
        )
        v = x * popxl.constant(np.arange(1, 6, dtype=np.float32))  # 5 elements: RTS padding
        for stride, size in [(1, 1), (1, 2), (2, 2), (1, 4)]:
            rg = ir.replica_grouping(stride, size)
            key = f"{stride}x{size}"
            coll = ops.collectives
            streams[f"add/{key}"] = _store(coll.replicated_all_reduce(x, group=rg))
            streams[f"max/{key}"] = _store(coll.replicated_all_reduce(x, "max", group=rg))
            streams[f"mean/{key}"] = _store(coll.replicated_all_reduce(v, "mean", group=rg))
            inplace = x + 0.0
            coll.replicated_all_reduce_(inplace, group=rg)
            streams[f"inplace/{key}"] = _store(inplace)
            streams[f"gather/{key}"] = _store(
                coll.replicated_all_gather(x, group=rg, output_shape="new_axis")
            )
            streams[f"scatter/{key}"] = _store(coll.replicated_reduce_scatter(v, group=rg))
            streams[f"scatter1/{key}"] = _store(coll.replicated_reduce_scatter(x, group=rg))
            streams[f"slice/{key}"] = _store(coll.replica_sharded_slice(v, group=rg))
            as_int = ops.cast(x, popxl.int32)
            streams[f"int/{key}"] = _store(coll.replicated_all_reduce(as_int, group=rg))
    with _session(ir, executor) as session:
        out = session.run()
        counters = session._last_run_counters
    result = {f"run/{k}": _canonical(ir, out[s], s.shape) for k, s in streams.items()}
    if executor == "fast":
        result["calls/collectives"] = np.array(counters["num_collectives"])
        result["bytes/collectives"] = np.array(counters["collective_bytes"])
    return result


def scenario_variables(replication, executor):
    """Grouped variables fed per instance: one_per_group and all_replicas reads, writes, nht=2."""
    ir = popxl.Ir(replication=replication)
    ir.num_host_transfers = 2
    # in_sequence: the second accumulate_ of w must follow the first iteration's read of w.
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        w = popxl.variable(
            np.ones((2, 3), np.float32) * [[1], [10]], replica_grouping=ir.replica_grouping(2, 2)
        )
        z = popxl.variable(np.zeros((2, 3), np.float32), replica_grouping=ir.replica_grouping(1, 2),
                           retrieval_mode="all_replicas")  # fmt: skip
        ys = popxl.d2h_stream((3,), popxl.float32, "y")
        for _ in range(2):
            x = ops.host_load(xs)
            ops.var_updates.accumulate_(
                w, ops.collectives.replicated_all_reduce(x, group=ir.replica_grouping(2, 2))
            )
            ops.var_updates.accumulate_(z, x)
            ops.host_store(ys, w + z)
    data = np.arange(2 * R * 3, dtype=np.float32).reshape(2, R, 3)
    local = data[:, _offset(ir) : _offset(ir) + ir.instance_replication_factor]
    if ir.instance_replication_factor == 1:
        local = local[:, 0]  # a replica dim of 1 is omitted (spec §6.3)
    result = {}
    with _session(ir, executor) as session:
        result["run/first"] = _canonical(ir, session.run({xs: local})[ys], (3,))
        result["host/w"] = session.get_tensor_data(w).copy()
        result["host/z"] = session.get_tensor_data(z).copy()
        session.write_variable_data(w, np.full((2, 3), -1.0, np.float32))
        result["run/second"] = _canonical(ir, session.run({xs: local})[ys], (3,))
    result["host/w_after"] = session.get_tensor_data(w).copy()
    result["host/z_after"] = session.get_tensor_data(z).copy()
    return result


def scenario_remote(replication, executor):
    """Spec §11.2 at R=4: a replica-grouped remote variable, plus a scratch remote buffer."""
    ir = popxl.Ir(replication=replication)
    with ir.main_graph:
        buf = popxl.remote_buffer((8,), popxl.int32, 2)
        v = popxl.remote_variable(np.arange(R * 8, dtype=np.int32).reshape(R, 8), buf, 1,
                                  replica_grouping=ir.replica_grouping(group_size=1))  # fmt: skip
        loaded = ops.remote_load(buf, 1)
        loaded = loaded + 1
        ops.remote_store(buf, 1, loaded)
        scratch = popxl.remote_buffer((2,), popxl.float32, 3)
        x = popxl.variable(
            np.arange(R * 2, dtype=np.float32).reshape(R, 2),
            replica_grouping=ir.replica_grouping(1, 1),
        )
        for slot in range(3):
            ops.remote_store(scratch, slot, x * float(slot + 1))
        back = ops.remote_load(scratch, 2)
        s_loaded, s_back = _store(loaded), _store(back)
    with _session(ir, executor) as session:
        out = session.run()
    return {
        "run/loaded": _canonical(ir, out[s_loaded], (8,)),
        "run/back": _canonical(ir, out[s_back], (2,)),
        "host/v": session.get_tensor_data(v).copy(),
    }


def scenario_rts(replication, executor):
    """Spec §11.3/§11.4 at R=4: RTS and remote RTS variables, full and grouped sharding."""
    ir = popxl.Ir(replication=replication)
    with ir.main_graph:
        data = np.arange(1, 7, dtype=np.float32)  # 6 elements over 4 shards: padded to 8
        x_full, x_shard = popxl.replica_sharded_variable(data)
        y = popxl.variable(data * 10)
        ops.var_updates.accumulate_(x_shard, ops.collectives.replica_sharded_slice(y))
        pair = ir.replica_grouping(group_size=2)  # 2 groups {0,1} {2,3}, sharded within each
        g_data = np.stack([data, -data])
        g_full, g_shard = popxl.replica_sharded_variable(
            g_data, replica_grouping=pair, retrieval_mode="all_replicas"
        )
        ops.var_updates.accumulate_(g_shard, popxl.constant(np.full(3, 0.5, np.float32)))
        buf = popxl.replica_sharded_buffer((2, 3), popxl.float32)
        rv = popxl.remote_replica_sharded_variable(data.reshape(2, 3), buf, 0)
        loaded = ops.remote_load(buf, 0)
        full = ops.collectives.replicated_all_gather(loaded)
        ops.var_updates.accumulate_(full, popxl.constant(np.ones((2, 3), np.float32)))
        ops.remote_store(buf, 0, ops.collectives.replica_sharded_slice(full))
        s_full, s_shard = _store(full), _store(g_shard + 0.0)
    with _session(ir, executor) as session:
        out = session.run()
    return {
        "run/full": _canonical(ir, out[s_full], (2, 3)),
        "run/grouped_shard": _canonical(ir, out[s_shard], s_shard.shape),
        "host/x": session.get_tensor_data(x_full).copy(),
        "host/grouped": session.get_tensor_data(g_full).copy(),
        "host/remote": session.get_tensor_data(rv).copy(),
    }


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _fp16_compress(state, bucket):
    """DDP's fp16 gradient compression (torch's own hook), imported where a process group runs."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    return fp16_compress_hook(state, bucket)


def _data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """The wrapper a GPU script puts around its model: DistributedDataParallel in a process
    group (under torchrun), DataParallel alone (Note [data-parallel wrappers])."""
    if torch.distributed.is_initialized():
        return torch.nn.parallel.DistributedDataParallel(model)
    return torch.nn.DataParallel(model)


def _train(replication, optimizer, wrap=None, **kwargs):
    """Three popxl.compile steps (R=4, GA=2, micro=3); every instance feeds its own share;
    ``wrap`` puts a wrapper around the model given to popxl.compile."""
    GA = 2
    model = _mlp()
    given = model if wrap is None else wrap(model)
    trainer = popxl.compile(given, torch.nn.functional.cross_entropy, optimizer(given.parameters()),
                            replication_factor=R, gradient_accumulation=GA, **kwargs)  # fmt: skip
    rng = np.random.default_rng(1)
    result = {}
    for i in range(3):
        x = rng.standard_normal((R * GA * 3, 8)).astype(np.float32)
        t = rng.integers(0, 4, R * GA * 3).astype(np.int64)
        loss = trainer.step(
            distributed.instance_batch(x, R, GA), distributed.instance_batch(t, R, GA)
        )
        result[f"host/loss{i}"] = np.array(loss)
    state = trainer.state_dict()
    for name, value in state["model"].items():
        result[f"host/param/{name}"] = value.numpy()
    for name, slot in state["optimizer"]["state"].items():
        for k, value in slot.items():
            result[f"host/state/{name}/{k}"] = value.numpy()
    infer = popxl.compile(model, replication_factor=R)
    x = rng.standard_normal((R * 2, 8)).astype(np.float32)
    y = infer(distributed.instance_batch(x, R)).numpy()
    result["run/inference"] = y.reshape(1, -1, 2, 4)
    return result


def scenario_training(replication, executor):
    """Data-parallel training through popxl.compile: SGD with momentum, Adam with RTS
    (reduce-scatter/all-gather) off-chip optimizer state, and fused AdamW on chip."""
    assert replication in (R, "popdist")
    sgd = _train(replication, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    adam = _train(
        replication,
        lambda p: torch.optim.Adam(p, lr=0.01),
        rts_threshold=32,
        optimizer_state="remote",
    )
    # on-chip fused AdamW: one fused kernel call per step (Note [fused optimizer updates])
    fused = _train(replication, lambda p: torch.optim.AdamW(p, lr=0.01, fused=True))
    # a DDP-wrapped model under torchrun, DataParallel in one process: the module they hold
    wrapped = _train(replication, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                     wrap=_data_parallel)  # fmt: skip
    return {**{f"{k}@sgd": v for k, v in sgd.items()}, **{f"{k}@adam": v for k, v in adam.items()},
            **{f"{k}@fused_adamw": v for k, v in fused.items()},
            **{f"{k}@sgd_wrapped": v for k, v in wrapped.items()}}  # fmt: skip


def scenario_layout(replication, executor):
    """Which global replicas this instance holds, read through a stream."""
    ir = popxl.Ir(replication=replication)
    with ir.main_graph:
        ids = popxl.variable(
            np.arange(R, dtype=np.int32)[:, None], replica_grouping=ir.replica_grouping(1, 1)
        )
        s = _store(ids + 0)
    with _session(ir, executor) as session:
        out = session.run()[s]
    return {"run/replica": _canonical(ir, out, (1,)), "host/R": np.array(ir.replication_factor)}


def _compiled_alone():
    """Two popxl.compile(replication_factor=1) Adam steps on fixed data: a one-replica program,
    which every torchrun process runs alone (as ``Ir(replication=1)``)."""
    model = _mlp()
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy,
                            torch.optim.Adam(model.parameters(), lr=0.01))  # fmt: skip
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    t = rng.integers(0, 4, 6).astype(np.int64)
    losses = [trainer.step(distributed.instance_batch(x, 1), distributed.instance_batch(t, 1))
              for _ in range(2)]  # fmt: skip
    return np.array([*losses, *model[0].weight.detach().numpy().ravel()[:4]])


def scenario_wire(replication, executor):
    """One collective per program (12 float32 per replica, so 48 bytes a row): what this
    process sent through torch.distributed in the run (``wire``, Note [wire bytes]) next to
    the traffic counters' share of the run (``share``, what the report counts)."""
    result = {}
    programs = {
        "rs_full": lambda x, ir: ops.collectives.replicated_reduce_scatter(x),
        "rs_pair": lambda x, ir: ops.collectives.replicated_reduce_scatter(
            x, group=ir.replica_grouping(1, 2)
        ),
        "rs_strided": lambda x, ir: ops.collectives.replicated_reduce_scatter(
            x, group=ir.replica_grouping(2, 2)
        ),
        "ar_full": lambda x, ir: ops.collectives.replicated_all_reduce(x),
        "ar_pair": lambda x, ir: ops.collectives.replicated_all_reduce(
            x, group=ir.replica_grouping(1, 2)
        ),
        "ar_strided": lambda x, ir: ops.collectives.replicated_all_reduce(
            x, group=ir.replica_grouping(2, 2)
        ),
        "ag_full": lambda x, ir: ops.collectives.replicated_all_gather(x),
        "ag_pair": lambda x, ir: ops.collectives.replicated_all_gather(
            x, group=ir.replica_grouping(1, 2)
        ),
    }
    for name, build in programs.items():
        ir = popxl.Ir(replication=replication)
        with ir.main_graph:
            x = popxl.variable(
                np.arange(R * 12, dtype=np.float32).reshape(R, 12),
                replica_grouping=ir.replica_grouping(1, 1),
            )
            s = _store(build(x, ir))
        with _session(ir, executor) as session:
            before = distributed.wire_counters()["bytes"]
            out = session.run()[s]
            result[f"wire/{name}"] = np.array(distributed.wire_counters()["bytes"] - before)
            result[f"share/{name}"] = np.array(session._last_run_counters["collective_bytes"])
            result[f"run/{name}"] = _canonical(ir, out, s.shape)
    return result


SCENARIOS = {
    "collectives": (scenario_collectives, EXECUTORS),
    "variables": (scenario_variables, EXECUTORS),
    "remote": (scenario_remote, EXECUTORS),
    "rts": (scenario_rts, EXECUTORS),
    "training": (scenario_training, ("fast",)),
    "layout": (scenario_layout, ("fast",)),
    "wire": (scenario_wire, ("fast",)),
}


# Scenarios also run with the integer spelling under torchrun (fast executor).
INT_SPELLING = ("collectives", "variables", "rts", "layout")


# ---- the worker (runs under torchrun) ------------------------------------------------------


def _worker_all(out: Path) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for name, (fn, executors) in SCENARIOS.items():
        for executor in executors:
            for k, v in fn("popdist", executor).items():
                results[f"{name}/{executor}/{k}"] = np.asarray(v)
    # The same programs spelled Ir(replication=4): each process is one instance as well.
    for name in INT_SPELLING:
        fn, executors = SCENARIOS[name]
        for k, v in fn(R, executors[0]).items():
            results[f"{name}@int/{executors[0]}/{k}"] = np.asarray(v)
    try:
        distributed.instance_layout(R + 1)
        results["error/bad_factor"] = np.array("")
    except ValueError as error:
        results["error/bad_factor"] = np.array(str(error))
    try:
        popxl.Ir(replication=2 * R + 1)
        results["error/int_bad_factor"] = np.array("")
    except ValueError as error:
        results["error/int_bad_factor"] = np.array(str(error))
    ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
    ddp.register_comm_hook(None, _fp16_compress)
    try:
        popxl.compile(ddp, torch.nn.functional.cross_entropy,
                      torch.optim.SGD(ddp.parameters(), lr=0.1), replication_factor=R)  # fmt: skip
        results["error/comm_hook"] = np.array("")
    except ValueError as error:
        results["error/comm_hook"] = np.array(str(error))
    ir = popxl.Ir()  # one replica: nothing to split, every process runs it alone
    results["layout/one"] = np.array([ir._num_instances, ir.instance_replication_factor])
    results["layout/compiled_alone"] = _compiled_alone()
    ir.replication_factor = R  # the upstream spelling of replication: set after construction
    results["layout/set"] = np.array([ir._num_instances, ir.instance_replication_factor])
    np.savez(out / f"rank{rank}.npz", **results)
    torch.distributed.destroy_process_group()  # clean teardown before the interpreter exits


def _worker_failure(out: Path, mode: str) -> None:
    """Rank 1 exits (or hangs) after the Session is built; rank 0 must fail with a clear error."""
    rank = int(os.environ["RANK"])
    ir = popxl.Ir(replication="popdist")
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32))
        _store(ops.collectives.replicated_all_reduce(x))
    session = _session(ir, "fast")
    session.__enter__()
    if rank == 1:
        if mode == "exit":
            os._exit(0)
        time.sleep(10 * FAIL_TIMEOUT_S)
        return
    time.sleep(0.5)
    start = time.monotonic()
    try:
        session.run()
        report = {"error": None}
    except distributed.DistributedError as error:
        report = {"error": str(error), "type": type(error).__name__}
    report["elapsed"] = time.monotonic() - start
    (out / "failure.json").write_text(json.dumps(report))
    sys.exit(3)


HOST_SCENARIOS = ("collectives", "variables", "training")


def _worker_hosts(out: Path) -> None:
    """One process per "host" (network namespace): the host scenarios, plus the bytes this
    host's network interface sent while they ran."""
    rank = int(os.environ["RANK"])
    stats = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics/tx_bytes"
    tx, wire = int(stats.read_text()), distributed.wire_counters()["bytes"]
    results = {}
    for name in HOST_SCENARIOS:
        fn, executors = SCENARIOS[name]
        for k, v in fn("popdist", executors[0]).items():
            results[f"{name}/{executors[0]}/{k}"] = np.asarray(v)
    results["net/tx_bytes"] = np.array(int(stats.read_text()) - tx)
    results["net/wire_bytes"] = np.array(distributed.wire_counters()["bytes"] - wire)
    np.savez(out / f"rank{rank}.npz", **results)
    torch.distributed.destroy_process_group()


def _worker(argv: list[str]) -> None:
    what, out = argv[0], Path(argv[1])
    if what == "all":
        _worker_all(out)
    elif what == "hosts":
        _worker_hosts(out)
    else:
        _worker_failure(out, what)


# ---- launching -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(nproc: int, what: str, out: Path, env: dict[str, str]) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", __file__, what, str(out)]  # fmt: skip
    with open(out / "log.txt", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Start every torchrun job at once; wait for all within LAUNCH_BUDGET_S."""
    root = tmp_path_factory.mktemp("distributed")
    # A generous timeout for the jobs that must succeed: ten processes share two cores here.
    base = {
        "TORCH_POPXL_REPLICATION_FACTOR": str(R),
        "OMP_NUM_THREADS": "1",
        "TORCH_POPXL_DIST_TIMEOUT_S": "180",
    }
    fail = {
        "TORCH_POPXL_REPLICATION_FACTOR": "2",
        "TORCH_POPXL_DIST_TIMEOUT_S": str(FAIL_TIMEOUT_S),
    }
    jobs = {
        2: ("all", base),
        4: ("all", base),
        "exit": ("exit", fail),
        "hang": ("hang", fail),
    }
    procs, wall = {}, {}
    start = time.monotonic()
    for key, (what, env) in jobs.items():
        nproc = key if isinstance(key, int) else 2
        procs[key] = _launch(nproc, what, root / str(key), env)
    for key, proc in procs.items():
        try:
            proc.wait(timeout=max(1.0, LAUNCH_BUDGET_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        wall[key] = time.monotonic() - start
    return {key: (root / str(key), procs[key].returncode, wall[key]) for key in jobs}


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Two "hosts" on this machine: network namespaces joined by a veth pair (10.231.0.1 and
    .2), each running ``torchrun --nnodes=2 --nproc_per_node=1`` with the rendezvous on host
    0's address. Skips (with the reason) where namespaces cannot be made (not root, no
    CAP_NET_ADMIN, no ``ip``)."""
    tag = f"tpx{os.getpid() % 100000}"
    names = [f"{tag}h{k}" for k in range(2)]
    links = [f"{tag}v{k}" for k in range(2)]
    addrs = ["10.231.0.1", "10.231.0.2"]
    try:
        for ns in names:
            _run("ip", "netns", "add", ns)
    except (OSError, subprocess.SubprocessError) as error:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        detail = getattr(error, "stderr", None) or error
        pytest.skip(f"cannot create network namespaces here (needs root/CAP_NET_ADMIN): {detail}")
    root = tmp_path_factory.mktemp("hosts")
    procs = []
    try:
        _run("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(names, links, addrs, strict=True):
            _run("ip", "link", "set", link, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            _run("ip", "-n", ns, "link", "set", link, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        port = _free_port()
        env = {**os.environ, "TORCH_POPXL_REPLICATION_FACTOR": str(R), "OMP_NUM_THREADS": "1",
               "TORCH_POPXL_DIST_TIMEOUT_S": "120"}  # fmt: skip
        for k, (ns, link) in enumerate(zip(names, links, strict=True)):
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                   "--nnodes=2", "--nproc_per_node=1", f"--node_rank={k}",
                   f"--master_addr={addrs[0]}", f"--master_port={port}", __file__, "hosts",
                   str(root)]  # fmt: skip
            with open(root / f"log{k}.txt", "w") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**env, "GLOO_SOCKET_IFNAME": link},
                    )  # fmt: skip
                )
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=LAUNCH_BUDGET_S))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for ns in names:  # deleting a namespace deletes its end of the veth pair, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    logs = "\n".join((root / f"log{k}.txt").read_text()[-3000:] for k in range(2))
    assert codes == [0, 0], f"torchrun on two hosts failed ({codes}):\n{logs}"
    return [dict(np.load(root / f"rank{k}.npz")) for k in range(2)]


@pytest.fixture(scope="module")
def simulator():
    """The oracle: every scenario in this process with Ir(replication=4)."""
    out = {}
    for name, (fn, executors) in SCENARIOS.items():
        for executor in executors:
            for k, v in fn(R, executor).items():
                out[f"{name}/{executor}/{k}"] = np.asarray(v)
    return out


def _rank_results(launches, world: int) -> list[dict[str, np.ndarray]]:
    path, rc, _ = launches[world]
    log = (path / "log.txt").read_text()[-4000:]
    assert rc == 0, f"torchrun with {world} processes failed (rc={rc}):\n{log}"
    return [dict(np.load(path / f"rank{k}.npz")) for k in range(world)]


def _compare(prefix: str, sim: dict, ranks: list[dict], spelling: str = "") -> int:
    """Compare the ranks' results under ``prefix`` (scenario/executor/) with the simulator's;
    ``spelling`` ("@int") picks the worker's results of the integer spelling."""
    keys = sorted(k for k in sim if k.startswith(prefix))
    assert keys, f"no results for {prefix}"
    name = prefix.split("/", 1)[0]
    for key in keys:
        kind = key.split("/")[2]
        values = [r[f"{name}{spelling}/{key.split('/', 1)[1]}"] for r in ranks]
        exact = np.issubdtype(sim[key].dtype, np.integer)
        rtol = 0 if exact else (1e-5 if prefix.startswith("training") else 1e-6)
        atol = 0 if exact else rtol
        if kind == "run":
            got = np.concatenate(values, axis=1)
            np.testing.assert_allclose(got, sim[key], rtol=rtol, atol=atol, err_msg=key)
        elif kind == "host":
            for rank, value in enumerate(values):
                np.testing.assert_allclose(
                    value, sim[key], rtol=rtol, atol=atol, err_msg=f"{key} rank {rank}"
                )
        elif kind == "calls":
            assert all(int(v) == int(sim[key]) for v in values), (key, values, sim[key])
        elif kind == "bytes":
            assert sum(int(v) for v in values) == int(sim[key]), (key, values, sim[key])
    return len(keys)


# ---- tests ---------------------------------------------------------------------------------

WORLDS = (2, 4)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_grouped_collectives_match_the_simulator(launches, simulator, world, executor):
    """Spec §11.5 at R=4 on 2x2 and 4x1 instances: all_reduce (add/max/mean/int/in place),
    all_gather, reduce_scatter and replica_sharded_slice under (S,G) in 1x1, 1x2, 2x2, 1x4;
    the fast executor also counts the same collectives (bytes summed over instances)."""
    ranks = _rank_results(launches, world)
    assert _compare(f"collectives/{executor}/", simulator, ranks) >= 32


def test_spec_values_of_all_reduce_2x2_on_two_instances(launches):
    """Spec §11.5, R=4, (S=2,G=2): [2,4,2,4]; reduce_scatter (1,4): [6,0,0,0]."""
    ranks = _rank_results(launches, 2)
    got = np.concatenate([r["collectives/fast/run/add/2x2"] for r in ranks], axis=1).ravel()
    np.testing.assert_array_equal(got, [2, 4, 2, 4])
    got = np.concatenate([r["collectives/fast/run/scatter1/1x4"] for r in ranks], axis=1).ravel()
    np.testing.assert_array_equal(got, [6, 0, 0, 0])
    # 5 elements r*[1..5] over 4 members: chunks of 2 of the padded sum 6*[1..5, 0, 0, 0].
    got = np.concatenate([r["collectives/fast/run/scatter/1x4"] for r in ranks], axis=1)[0]
    np.testing.assert_array_equal(got, [[6, 12], [18, 24], [30, 0], [0, 0]])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_grouped_variables_and_per_instance_io_match_the_simulator(
    launches, simulator, world, executor
):
    """Run arrays hold the local replicas; one_per_group and all_replicas reads and writes of
    grouped variables are global on every instance."""
    assert _compare(f"variables/{executor}/", simulator, _rank_results(launches, world)) == 6


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_remote_buffers_match_the_simulator(launches, simulator, world, executor):
    """Spec §11.2 at R=4: get_tensor_data of a grouped remote variable equals v_h + 1."""
    ranks = _rank_results(launches, world)
    assert _compare(f"remote/{executor}/", simulator, ranks) == 3
    expected = np.arange(R * 8, dtype=np.int32).reshape(R, 8) + 1
    np.testing.assert_array_equal(ranks[-1][f"remote/{executor}/host/v"], expected)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_rts_variables_match_the_simulator(launches, simulator, world, executor):
    """RTS (§11.4), grouped RTS with all_replicas reads and remote RTS (§11.3) at R=4."""
    ranks = _rank_results(launches, world)
    assert _compare(f"rts/{executor}/", simulator, ranks) == 5
    data = np.arange(1, 7, dtype=np.float32)
    np.testing.assert_array_equal(ranks[0][f"rts/{executor}/host/x"], data * 11)


@pytest.mark.parametrize("world", WORLDS)
def test_data_parallel_training_matches_the_simulator(launches, simulator, world):
    """popxl.compile, unchanged under torchrun: 3 steps of SGD+momentum and of Adam with RTS
    off-chip state give the simulator's losses, weights and optimizer state (rtol 1e-5);
    inference returns each instance's share of the outputs."""
    assert _compare("training/fast/", simulator, _rank_results(launches, world)) >= 20


@pytest.mark.parametrize("world", WORLDS)
def test_instances_hold_contiguous_blocks_of_replicas(launches, world):
    """Spec §10: instance k holds replicas [k*R/W, (k+1)*R/W); ir.replication_factor is global."""
    ranks = _rank_results(launches, world)
    for k, r in enumerate(ranks):
        local = R // world
        np.testing.assert_array_equal(
            r["layout/fast/run/replica"].ravel(), np.arange(k * local, (k + 1) * local)
        )
        assert int(r["layout/fast/host/R"]) == R


@pytest.mark.parametrize("world", WORLDS)
def test_a_replication_factor_that_does_not_split_is_rejected(launches, world):
    message = str(_rank_results(launches, world)[0]["error/bad_factor"])
    assert (
        f"global replication factor {R + 1}" in message
        and "TORCH_POPXL_REPLICATION_FACTOR" in message
    )


@pytest.mark.parametrize("world", WORLDS)
def test_a_ddp_communication_hook_is_refused_by_name(launches, world):
    """Note [data-parallel wrappers]: a DDP-wrapped model trains as the module it holds
    (scenario_training's ``@sgd_wrapped`` keys); a communication hook, which would change the
    summed gradients, is refused naming it."""
    message = str(_rank_results(launches, world)[0]["error/comm_hook"])
    assert "DistributedDataParallel wrapper has a communication hook (_fp16_compress)" in message


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_lost_peer_ends_the_job_with_a_clear_error(launches, mode):
    """Rank 1 exits (or stops calling) after the Session is built: rank 0 raises
    DistributedError naming the cause and the timeout variable within the timeout, and the
    whole torchrun job ends instead of hanging."""
    path, rc, wall = launches[mode]
    report = json.loads((path / "failure.json").read_text())
    assert report["type"] == "DistributedError", report
    assert "TORCH_POPXL_DIST_TIMEOUT_S" in report["error"] and "rank 0 of 2" in report["error"]
    assert report["elapsed"] < FAIL_TIMEOUT_S + 2.0, report
    if mode == "hang":  # nothing closed the connection: the configured timeout fired
        assert report["elapsed"] > FAIL_TIMEOUT_S - 1.0 and "Timed out" in report["error"], report
    assert rc not in (0, None), rc


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", INT_SPELLING)
def test_integer_replication_under_torchrun_splits_over_the_processes(
    launches, simulator, world, scenario
):
    """Issue 18: a program written with Ir(replication=4) and launched with torchrun on W
    processes runs as W instances of 4/W replicas (like Ir(replication="popdist")), with the
    simulator's numbers; feeding each instance its own rows."""
    ranks = _rank_results(launches, world)
    executor = SCENARIOS[scenario][1][0]
    assert _compare(f"{scenario}/{executor}/", simulator, ranks, spelling="@int") >= 1
    for k, r in enumerate(ranks):
        local = R // world
        np.testing.assert_array_equal(
            r["layout@int/fast/run/replica"].ravel(), np.arange(k * local, (k + 1) * local)
        )


@pytest.mark.parametrize("world", WORLDS)
def test_integer_replication_layout_rules_under_torchrun(launches, world):
    """R=1 stays one independent instance per process; setting ir.replication_factor after
    construction splits it; an R the processes do not divide is a ValueError naming both."""
    rank0 = _rank_results(launches, world)[0]
    np.testing.assert_array_equal(rank0["layout/one"], [1, 1])
    np.testing.assert_array_equal(rank0["layout/set"], [world, R // world])
    message = str(rank0["error/int_bad_factor"])
    assert f"Ir(replication={2 * R + 1})" in message and f"{world} processes" in message, message


@pytest.mark.parametrize("world", WORLDS)
def test_a_one_replica_compiled_trainer_runs_alone_in_every_process(launches, world):
    """popxl.compile(replication_factor=1) under torchrun: each process trains its own copy,
    with the numbers one process gets (losses not averaged across the processes)."""
    expected = _compiled_alone()
    for r in _rank_results(launches, world):
        np.testing.assert_array_equal(r["layout/compiled_alone"], expected)


def test_collectives_send_the_bytes_the_report_counts_with_one_replica_per_process(
    launches, simulator
):
    """4 processes x 1 replica: the process ring is the replica ring, so what each process
    handed to torch.distributed (wire_counters) equals its share of the traffic counters for
    reduce-scatter (native reduce_scatter_tensor), all-reduce and all-gather, full and
    grouped; and the results are the simulator's."""
    ranks = _rank_results(launches, 4)
    for name in ("rs_full", "rs_pair", "rs_strided", "ar_full", "ar_pair", "ar_strided",
                 "ag_full", "ag_pair"):  # fmt: skip
        for rank, r in enumerate(ranks):
            assert int(r[f"wire/fast/wire/{name}"]) == int(r[f"wire/fast/share/{name}"]) > 0, (
                name,
                rank,
            )
        got = np.concatenate([r[f"wire/fast/run/{name}"] for r in ranks], axis=1)
        np.testing.assert_allclose(got, simulator[f"wire/fast/run/{name}"], rtol=1e-6)
    # Hand-computed: 12 floats over 4 members = chunks of 3; each process sends 3 of 4 chunks.
    assert int(ranks[0]["wire/fast/wire/rs_full"]) == 3 * 3 * 4


def test_reduce_scatter_sends_half_the_bytes_of_an_all_reduce_on_two_processes(launches):
    """2 processes x 2 replicas: each process reduces its replicas first, then one
    reduce_scatter_tensor of 4 chunks of 3 floats (48 bytes, half of it sent: 24) against
    the all-reduce of one 48-byte partial (48 sent). Before issue 18 the reduce-scatter was
    that all-reduce plus a slice."""
    for r in _rank_results(launches, 2):
        assert int(r["wire/fast/wire/rs_full"]) == 24
        assert int(r["wire/fast/wire/ar_full"]) == 48


def test_two_hosts_give_the_single_process_numbers(two_hosts, simulator):
    """torchrun --nnodes=2 across two network namespaces (a veth pair, rendezvous on host 0's
    address): 2 instances x 2 replicas reproduce the simulator's collectives, grouped
    variables and data-parallel training; the bytes sent over each host's interface are at
    least what the process handed to torch.distributed (the traffic really crossed)."""
    for name in HOST_SCENARIOS:
        executor = SCENARIOS[name][1][0]
        assert _compare(f"{name}/{executor}/", simulator, two_hosts) >= 1
    for r in two_hosts:
        assert int(r["net/tx_bytes"]) >= int(r["net/wire_bytes"]) > 0


def test_popdist_without_torchrun_is_one_instance(monkeypatch):
    """Like popdist outside poprun: one instance holding every replica, R from
    TORCH_POPXL_REPLICATION_FACTOR or 1; it computes what Ir(replication=R) does."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    monkeypatch.delenv("TORCH_POPXL_REPLICATION_FACTOR", raising=False)
    ir = popxl.Ir(replication="popdist")
    assert (ir.replication_factor, ir.instance_replication_factor) == (1, 1)
    monkeypatch.setenv("TORCH_POPXL_REPLICATION_FACTOR", str(R))
    ir = popxl.Ir(replication="popdist")
    assert (ir.replication_factor, ir.instance_replication_factor) == (R, R)
    got = scenario_collectives("popdist", "fast")
    want = scenario_collectives(R, "fast")
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    monkeypatch.setenv("TORCH_POPXL_REPLICATION_FACTOR", "four")
    with pytest.raises(ValueError, match="TORCH_POPXL_REPLICATION_FACTOR must be a positive int"):
        popxl.Ir(replication="popdist")


def test_timeout_must_be_a_positive_number(monkeypatch):
    monkeypatch.setenv("TORCH_POPXL_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="TORCH_POPXL_DIST_TIMEOUT_S"):
        distributed.timeout_s()
    monkeypatch.setenv("TORCH_POPXL_DIST_TIMEOUT_S", "2.5")
    assert distributed.timeout_s() == 2.5


if __name__ == "__main__":
    _worker(sys.argv[1:])
