"""The CPU-testable parts of graph replay and the copies' pool: the torch version gate, the process-wide
switch, work areas held weakly, ``release_all`` / ``release_pools``, the pooled clones' fallbacks and
the worker's sleep hook. The CUDA paths themselves are in ``tests/gpu/test_graph_replay_gpu.py`` and
``tests/gpu/test_owned_copies_gpu.py``."""

from __future__ import annotations

import contextlib
import gc
import logging

import pytest
import torch

from refit_verify.digest.kernels import replay
from refit_verify.digest.kernels.launch import Planned
from refit_verify.vllm_plugin import worker_copies as worker, worker_sessions as sessions


@pytest.mark.parametrize(("version", "ok"), [
    ("2.11.0+cu130", False), ("2.11.1", False), ("2.9.1+cu128", False), ("2.6.0", False),
    ("2.12.0a0+git603e244", False), ("2.12.0.dev20260401+cu130", False), ("2.12.0rc2", False), ("garbage", False),
    ("2.12.0", True), ("2.12.1+cu130", True), ("2.13.0+cpu", True), ("2.12", True), ("3.0.0", True)])
def test_the_torch_gate_admits_releases_from_2_12_only(version, ok):
    assert replay.torch_supports_graphs(version) is ok


@pytest.mark.parametrize(("value", "active", "said"), [("1", False, "REFIT_VERIFY_CUDA_GRAPHS=1 ignored"),
                                                       ("force", True, "REFIT_VERIFY_CUDA_GRAPHS=force")])
def test_below_the_gate_1_is_ignored_force_replays_each_said_once(monkeypatch, caplog, value, active, said):
    monkeypatch.setenv("REFIT_VERIFY_CUDA_GRAPHS", value)
    monkeypatch.setattr(replay, "_TORCH_OK", False)
    monkeypatch.setattr(replay, "_OFF", None)
    monkeypatch.setattr(replay, "_LOGGED", set())
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        assert replay.active() is active
        assert replay.active() is active
    assert sum(said in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr(replay, "_OFF", "RuntimeError: capture invalidated")
    assert replay.active() is False  # a failed capture turns it off, forced or not


def test_replay_is_active_only_when_asked_gated_in_and_not_turned_off(monkeypatch):
    monkeypatch.setattr(replay, "_TORCH_OK", True)
    monkeypatch.setattr(replay, "_OFF", None)
    monkeypatch.setenv("REFIT_VERIFY_CUDA_GRAPHS", "0")
    assert replay.active() is False
    monkeypatch.setenv("REFIT_VERIFY_CUDA_GRAPHS", "1")
    assert replay.active() is True
    monkeypatch.setattr(replay, "_OFF", "RuntimeError: capture invalidated")
    assert replay.active() is False


def test_a_plan_runs_plainly_until_its_second_run_and_whenever_replay_is_off(monkeypatch):
    monkeypatch.setenv("REFIT_VERIFY_CUDA_GRAPHS", "0")
    p = Planned(torch.zeros(1, dtype=torch.int64), 0, 0, 0, 1, torch.device("cuda", 0))
    calls = []
    assert replay.replay(p, 8, lambda w, o: calls.append(1)) is None
    assert replay.replay(p, 8, lambda w, o: calls.append(1)) is None
    assert p.runs == 2 and p.graph is None and calls == []  # nothing captured, nothing launched here


@pytest.mark.parametrize(("elements", "want"), [(1, 64), (64, 64), (65, 128), ((1 << 17) - 65, (1 << 17) - 64), (1 << 17, 1 << 18),
                                                ((1 << 17) + 1, 1 << 18), (9216 * 300, 9216 * 300 // 262144 * 262144 + 262144)])
def test_work_areas_are_rounded_to_the_allocators_granularity_not_doubled(elements, want):
    got = replay._round_up(elements)
    assert got == want and got >= elements
    assert got * 8 - elements * 8 < (2 << 20)  # never more than one 2 MiB unit over (doubling would be)


def test_a_work_area_lives_only_as_long_as_a_graph_holds_it():
    d = replay._Device()
    cpu = torch.device("cpu")
    a = replay._work_area(d, cpu, 100, stream=7)
    assert a.numel() == 128 and replay._work_area(d, cpu, 90, stream=7) is a  # big enough: shared
    b = replay._work_area(d, cpu, 1000, stream=7)
    assert b is not a and b.numel() == 1024  # larger: a new one, the old one stays with whoever holds it
    c = replay._work_area(d, cpu, 10, stream=8)
    assert c is not b  # another stream, another area
    del a, b
    gc.collect()
    assert d.areas[7]() is None  # the slot does not keep it alive
    assert replay._work_area(d, cpu, 10, stream=7).numel() == 64


def test_release_all_drops_captured_graphs_and_resets_their_runs(monkeypatch):
    monkeypatch.setattr(replay, "_CAPTURED", replay.weakref.WeakSet())
    p = Planned(torch.zeros(1, dtype=torch.int64), 0, 0, 0, 1, torch.device("cuda", 0))
    q = Planned(torch.zeros(1, dtype=torch.int64), 0, 0, 0, 1, torch.device("cuda", 0))
    p.graph, p.runs, q.graph, q.runs = object(), 9, False, 3
    replay._CAPTURED.add(p)
    assert replay.release_all() == 1
    assert (p.graph, p.runs) == (None, 0)
    assert (q.graph, q.runs) == (False, 3)  # never captured: left alone
    assert replay.release_all() == 0


def test_release_pools_drops_pools_and_keeps_the_no_pool_marks(monkeypatch):
    monkeypatch.setattr(worker, "_POOLS", {0: object(), 1: False, 2: object()})
    assert worker.release_pools() == 2
    assert worker._POOLS == {1: False}
    assert worker.release_pools() == 0


class _Fake:
    """A tensor stand-in whose clone raises ``torch.OutOfMemoryError`` while ``fail[0] > 0``."""

    def __init__(self, value, fail):
        self.value, self.fail, self.device = value, fail, torch.device("cuda", 0)

    def clone(self):
        if self.fail[0] > 0:
            self.fail[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return ("copy", self.value)


def _pool_env(monkeypatch, enter_error=None):
    events = []

    @contextlib.contextmanager
    def use_mem_pool(mp, device=None):
        if enter_error is not None:
            raise enter_error
        events.append(("enter", mp, device))
        try:
            yield
        finally:
            events.append(("exit", mp, device))

    monkeypatch.setenv("REFIT_VERIFY_CUDA_GRAPHS", "1")
    monkeypatch.setattr(worker, "_POOLS", {0: "pool0"})
    monkeypatch.setattr(worker, "_copies_pool", lambda batch: (0, worker._POOLS[0]) if worker._POOLS.get(0) else None)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(("empty_cache",)))
    return events


def test_a_pooled_clone_out_of_memory_redoes_the_batch_plainly_and_keeps_the_pool(monkeypatch, caplog):
    events = _pool_env(monkeypatch)
    fail = [1]  # the first clone (in the pool) fails
    batch = [("a", _Fake(1, fail)), ("b", _Fake(2, fail))]
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        got = worker.owned_copies(batch)
    assert got == [("a", ("copy", 1)), ("b", ("copy", 2))]
    assert events == [("enter", "pool0", 0), ("exit", "pool0", 0)]  # left the pool before the plain clones
    assert worker._POOLS == {0: "pool0"}  # usable at the next refit
    assert any("ran out of memory in their pool" in r.getMessage() for r in caplog.records)
    assert not worker._POOLS_LOCK.locked()


def test_plain_clones_out_of_memory_too_release_the_pool_and_try_once_more(monkeypatch):
    events = _pool_env(monkeypatch)
    fail = [2]  # the pooled clone and the first plain clone fail
    batch = [("a", _Fake(1, fail)), ("b", _Fake(2, fail))]
    assert worker.owned_copies(batch) == [("a", ("copy", 1)), ("b", ("copy", 2))]
    assert events[-1] == ("empty_cache",) and worker._POOLS == {}
    fail[0] = 9
    with pytest.raises(torch.OutOfMemoryError):
        worker.owned_copies(batch)  # no pool left to give back: the error is the caller's


@pytest.mark.parametrize(("error", "kept"), [(RuntimeError("cudaErrorLaunchFailure: transient"), True),
                                             (RuntimeError("expandable segments do not support memory pools"), False),
                                             (AttributeError("module 'torch.cuda' has no attribute 'use_mem_pool'"), False)])
def test_only_an_error_saying_pools_are_unsupported_gives_the_pool_up(monkeypatch, error, kept):
    _pool_env(monkeypatch, enter_error=error)
    batch = [("a", _Fake(1, [0]))]
    assert worker.owned_copies(batch) == [("a", ("copy", 1))]
    want = {0: "pool0"} if kept else {0: False}
    assert want == worker._POOLS


def test_a_busy_pool_gives_plain_clones_without_waiting(monkeypatch):
    events = _pool_env(monkeypatch)
    with worker._POOLS_LOCK:
        assert worker.owned_copies([("a", _Fake(1, [0]))]) == [("a", ("copy", 1))]
    assert events == []


def test_the_sleep_hook_releases_graphs_and_pools_before_vllms_sleep(monkeypatch):
    order = []
    monkeypatch.setattr(replay, "release_all", lambda: order.append("graphs") or 3)
    monkeypatch.setattr(worker, "release_pools", lambda: order.append("pools") or 1)

    def raw_sleep(self, level=1):
        order.append(("sleep", level))
        return "slept"

    assert sessions.wrap_sleep(raw_sleep)(object(), level=2) == "slept"
    assert order == ["graphs", "pools", ("sleep", 2)]


def test_the_sleep_hook_never_stops_sleep(monkeypatch, caplog):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(replay, "release_all", broken)
    with caplog.at_level(logging.ERROR, logger="refit_verify"):
        assert sessions.wrap_sleep(lambda self: "slept")(object()) == "slept"
    assert any("before sleep failed" in r.getMessage() for r in caplog.records)


def test_the_sleep_patch_is_in_the_table_and_applied():
    from refit_verify.vllm_plugin import patches

    (p,) = [p for p in patches.PATCHES if p.name == "release-on-sleep"]
    assert p.target == "vllm.v1.worker.gpu_worker:Worker.sleep" and p.why and p.remove_when
    assert "release-on-sleep" in patches._APPLY
