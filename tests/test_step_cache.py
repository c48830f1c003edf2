"""The step cache (Note [step cache] in csrc/step_cache.cpp): large blocks a simulated step
frees serve its next run; torch's own allocator is back between runs; numbers never change."""

import threading

import numpy as np
import pytest
import torch

import torch_popxl as popxl
from torch_popxl.runtime import step_cache

BIG = 1 << 20  # elements: well above the cache's 64 KiB minimum block


def _trainer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    trainer = popxl.compile(model, torch.nn.functional.cross_entropy, opt,
                            replication_factor=2, gradient_accumulation=2)  # fmt: skip
    return model, trainer


def _data(seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(2 * 2 * 64, 64)).astype(np.float32), rng.integers(0, 10, 256)


@pytest.fixture(autouse=True)
def _restore_limit():
    before = step_cache.stats()["limit"]
    yield
    step_cache.set_limit(before)


def test_a_steady_step_takes_its_large_blocks_from_the_cache():
    _, trainer = _trainer()
    x, y = _data()
    trainer.step(x, y)
    trainer.step(x, y)
    before = step_cache.stats()
    trainer.step(x, y)
    after = step_cache.stats()
    assert after["hits"] > before["hits"]
    assert after["misses"] == before["misses"]  # nothing new from the system
    assert after["cached_bytes"] > 0


def _assert_torch_allocates_outside_runs():
    before = step_cache.stats()
    t = torch.empty(BIG)
    t.fill_(1.0)
    del t
    after = step_cache.stats()
    assert (after["hits"], after["misses"], after["live_bytes"]) == (
        before["hits"], before["misses"], before["live_bytes"]
    )  # fmt: skip


def test_outside_a_run_torch_allocates_as_usual():
    _assert_torch_allocates_outside_runs()


def test_inside_a_run_large_blocks_are_cached_and_small_ones_are_not():
    with step_cache.running():
        before = step_cache.stats()
        small = torch.empty(16)
        big = torch.empty(BIG)
        during = step_cache.stats()
        del big, small
        again = torch.empty(BIG)  # the block just freed
        after = step_cache.stats()
    assert during["misses"] + during["hits"] == before["misses"] + before["hits"] + 1
    assert during["live_bytes"] == before["live_bytes"] + BIG * 4
    assert after["hits"] == during["hits"] + 1
    del again


def test_numbers_are_the_same_with_and_without_the_cache():
    x, y = _data()
    results = {}
    for limit in (0, 1 << 31):
        step_cache.set_limit(limit)
        step_cache.empty()
        model, trainer = _trainer()
        losses = [trainer.step(x, y) for _ in range(3)]
        results[limit] = (losses, [p.detach().clone() for p in model.parameters()])
    (l0, p0), (l1, p1) = results.values()
    np.testing.assert_array_equal(l0, l1)
    for a, b in zip(p0, p1, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_limit_zero_keeps_nothing_and_empty_returns_every_block():
    with step_cache.running():
        t = torch.empty(BIG)
    del t
    assert step_cache.stats()["cached_bytes"] >= BIG * 4
    step_cache.empty()
    assert step_cache.stats()["cached_bytes"] == 0
    step_cache.set_limit(0)
    with step_cache.running():
        t = torch.empty(BIG)
    del t
    assert step_cache.stats()["cached_bytes"] == 0


def test_a_tensor_made_in_a_run_outlives_the_run_and_an_empty_cache():
    with step_cache.running():
        t = torch.arange(BIG, dtype=torch.float32)
    step_cache.empty()
    other = torch.zeros(BIG)  # outside a run: never the block ``t`` holds
    assert t.data_ptr() != other.data_ptr()
    assert float(t[-1]) == BIG - 1 and float(t.sum()) == pytest.approx(BIG * (BIG - 1) / 2)


def test_concurrent_runs_nest_and_leave_torchs_allocator_installed():
    x, y = _data()
    trainers = [_trainer(seed)[1] for seed in (0, 1)]
    for trainer in trainers:  # built here: graph building is not a thing to do in threads
        trainer.step(x, y)
    errors = []

    def work(trainer):
        try:
            for _ in range(5):
                trainer.step(x, y)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    _assert_torch_allocates_outside_runs()


@pytest.mark.parametrize("bad,error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_set_limit_rejects_what_is_not_a_byte_count(bad, error):
    with pytest.raises(error, match="byte count"):
        step_cache.set_limit(bad)


def test_dead_values_are_released_so_blocks_are_reused_within_a_step():
    """Note [release dead values]: a chain of large temporaries needs two blocks at a time,
    not one per value, and computes what the reference executor computes."""
    import torch_popxl.ops as ops

    n = 1 << 18  # 1 MiB of float32 per replica row
    results, cached = {}, {}
    for executor in ("fast", "reference"):
        ir = popxl.Ir(replication=2)
        with ir.main_graph, popxl.in_sequence():
            x = ops.host_load(popxl.h2d_stream((n,), popxl.float32, "x"))
            y = x
            for _ in range(6):  # six temporaries, each dead after the next is made
                y = torch.cumsum(y, 0) * 0.5  # cumsum makes a new tensor: none in place
            out = popxl.d2h_stream((), popxl.float32, "out")
            ops.host_store(out, y.sum())
        data = np.random.default_rng(0).normal(size=(2, n)).astype(np.float32)
        with popxl.Session(ir, "ipu_hw", executor=executor) as session:
            step_cache.empty()
            results[executor] = session.run({ir._h2d_streams[0]: data})[out]
            cached[executor] = step_cache.stats()["cached_bytes"]
    np.testing.assert_allclose(results["fast"], results["reference"], rtol=1e-5)
    row_block = 2 * n * 4  # one stacked temporary: both replicas' rows
    assert cached["fast"] <= 3 * row_block, cached["fast"] / row_block
